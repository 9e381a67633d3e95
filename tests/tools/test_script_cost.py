"""``benchmarks/script_cost.py`` counts the Redis commands a script call runs inside it: the
``INFO commandstats`` deltas around a pipeline, less the script calls and the framing INFO."""

from __future__ import annotations

import redis

from benchmarks.script_cost import commands_run

from ..conftest import RedisUnderTest

# three commands inside, whatever the call
SCRIPT = (
    "redis.call('SET', KEYS[1], 1); redis.call('INCR', KEYS[1]); return redis.call('GET', KEYS[1])"
)


def test_the_commands_a_script_runs_are_counted_without_the_call_itself(
    rut: RedisUnderTest,
) -> None:
    r = redis.Redis.from_url(rut.url, decode_responses=True)
    try:
        sha = r.script_load(SCRIPT)
        key = f"{rut.prefix}:script-cost"
        with r.pipeline(transaction=False) as p:
            p.info("commandstats")
            for _ in range(5):
                p.evalsha(sha, 1, key)
            p.eval(SCRIPT, 1, key)
            p.info("commandstats")
            out = p.execute()
        assert out[1:-1] == ["2"] * 6
        assert commands_run(out[0], out[-1]) == 6 * 3
    finally:
        r.close()


def test_commands_run_reads_new_commands_and_skips_the_calls() -> None:
    before = {"cmdstat_get": {"calls": 4}, "cmdstat_fcall": {"calls": 1}}
    after = {
        "cmdstat_get": {"calls": 6},
        "cmdstat_zadd": {"calls": 3},  # first seen in between
        "cmdstat_fcall": {"calls": 3},
        "cmdstat_info": {"calls": 1},
    }
    assert commands_run(before, after) == 5
