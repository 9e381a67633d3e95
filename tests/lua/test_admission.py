"""Admission (weights, priority bands, tenants) against a real redis-server, the fleet across
several OS processes: the cap under random requests, refusals that reach their callers (a
lowered ceiling, a full list, bad arguments, a malformed class), a killed process, and rolling
upgrades between schemas. Who goes first is in test_admission_order.py; see docs/admission.md."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
import redis
import redis.asyncio as aredis
from prometheus_client import CollectorRegistry

from fleetgate.admission import member_id
from fleetgate.client import Fleet
from fleetgate.errors import ConfigError, DeadlineExceeded, Overloaded
from fleetgate.keys import GateKeys
from fleetgate.scripts import SCHEMA, GateScripts
from fleetgate.settings import GateSettings

from .._workers import wait_for
from ..conftest import RedisUnderTest
from . import _admission_workers as workers
from ._admission import Sampler, assert_no_trace, ctx, publish_cfg, units


@pytest.mark.servers
def test_units_never_above_limit_across_processes(rut: RedisUnderTest, r: redis.Redis) -> None:
    """4 processes x 6 loops of random weights (1..8), priorities (-1, 0, 5) and tenants, with
    cancellations and short deadlines: units held never pass the limit, sampled from Redis and
    from an external counter the workers keep around their work; nothing is left after."""
    limit, keys, probe = 16, GateKeys.of(rut.prefix, "units"), f"{rut.prefix}:probe"
    with Sampler(rut.url, keys) as sampler, ctx.Pool(4) as pool:
        outs = pool.starmap(
            workers.random_weights,
            [(rut.url, rut.prefix, "units", limit, 6, 25, probe, seed) for seed in range(4)],
        )
    peak = max(o["peak"] for o in outs)
    assert sampler.peak <= limit, (sampler.peak, peak, outs)
    assert peak <= limit, peak
    assert peak >= limit // 2, f"the cap was never approached (peak {peak})"
    assert sum(o["granted"] for o in outs) >= 300
    assert sum(o["cancelled"] + o["timed_out"] for o in outs) > 0
    wait_for(lambda: units(r, keys) == 0, 10)
    assert_no_trace(r, keys)
    assert int(r.get(probe) or 0) == 0


async def test_a_lowered_ceiling_refuses_the_parked_head_and_its_lane_moves_on(
    rut: RedisUnderTest, r: redis.Redis, fleet: Fleet
) -> None:
    """floor = ceiling = 8; another process parks a weight-8 call (no
    deadline) while this one holds a unit; the coordinator lowers floor and ceiling to 4 and
    the unit is released. The heavy call can never be granted now: its caller gets the
    ConfigError an arrival of weight 8 gets, and a weight-1 call of the same lane is granted at
    once (not the heavy head waiting in `big` for ever, and the weight-1 call timing out after
    3 s with 0 of 4 units held)."""
    gate = fleet.gate("lowered", floor=8, ceiling=8)
    held = await gate.acquire()
    with ctx.Pool(1) as pool:
        heavy = pool.apply_async(workers.park_heavy, (rut.url, rut.prefix, "lowered", 8, 8, 20.0))
        await asyncio.to_thread(wait_for, lambda: r.zcard(gate.keys.waiters) == 1, 30)
        published = time.time()
        await publish_cfg(rut.url, gate.keys, {"floor": 4, "ceiling": 4})
        await held.release()
        t0 = time.monotonic()
        try:
            lease = await gate.acquire(deadline=3)
        except DeadlineExceeded:
            pytest.fail(
                f"the weight-1 call timed out after {time.monotonic() - t0:.1f} s with "
                f"{units(r, gate.keys)} of 4 units held"
            )
        granted_ms = (time.monotonic() - t0) * 1000
        assert units(r, gate.keys) == 1
        await lease.release()
        out = await asyncio.to_thread(heavy.get, 30)
    refused_ms = (out["at"] - published) * 1000
    print(f"weight-1 granted in {granted_ms:.0f} ms; heavy caller {out['error']} "
          f"{refused_ms:.0f} ms after the publish")  # fmt: skip
    assert out["error"] == "ConfigError", out
    assert "weight: 8 is above the gate's ceiling (4)" in out["message"]
    assert granted_ms < 1000 and refused_ms < 2000, (granted_ms, refused_ms)
    assert int(r.hget(gate.keys.stats, "too_heavy") or 0) == 1
    wait_for(lambda: units(r, gate.keys) == 0, 5)
    assert_no_trace(r, gate.keys)


async def test_a_refusal_whose_wake_is_lost_reaches_its_caller_by_the_heartbeat(
    fleet: Fleet, r: redis.Redis
) -> None:
    """As above, with the wake of the refusal lost: the pod's next heartbeat reports the waiter
    as too heavy and its caller gets the ConfigError (not Overloaded, not parked again)."""
    gate = fleet.gate("lowered-lost", floor=8, ceiling=8)
    held = await gate.acquire()
    gate._woken = lambda value: None  # type: ignore[method-assign]
    heavy = asyncio.create_task(gate.acquire(deadline=None, weight=8))
    await asyncio.to_thread(wait_for, lambda: r.zcard(gate.keys.waiters) == 1, 10)
    t0 = time.monotonic()
    await publish_cfg(fleet.url, gate.keys, {"floor": 4, "ceiling": 4})
    with pytest.raises(ConfigError, match=r"weight: 8 is above the gate's ceiling \(4\)"):
        await asyncio.wait_for(heavy, 5)
    print(f"heavy caller ConfigError {(time.monotonic() - t0) * 1000:.0f} ms after the publish "
          "(wake lost, heartbeat 0.2 s)")  # fmt: skip
    assert r.zcard(gate.keys.waiters) == 0
    await held.release()


async def test_full_list_evicts_the_lowest_band(fleet: Fleet, async_redis: aredis.Redis) -> None:
    """A list full of priority-0 calls: a priority-10 arrival parks and the newest priority-0
    waiter gets Overloaded (by its wake, or by the heartbeat when the wake is lost)."""
    gate = fleet.gate("evict", floor=1, ceiling=1, max_queued=5)
    held = await gate.acquire()
    low = [asyncio.create_task(gate.acquire(deadline=30)) for _ in range(5)]
    while await async_redis.zcard(gate.keys.waiters) < 5:
        await asyncio.sleep(0.01)
    high = asyncio.create_task(gate.acquire(deadline=30, priority=10))
    done, _ = await asyncio.wait(low, timeout=5, return_when=asyncio.FIRST_COMPLETED)
    [evicted] = done
    assert isinstance(evicted.exception(), Overloaded)
    assert evicted is low[-1]  # the newest
    assert "higher priority" in str(evicted.exception())
    # The wake is lost this time: the heartbeat's eviction record tells the pod.
    orig = gate._woken
    gate._woken = lambda value: None  # type: ignore[method-assign]
    high2 = asyncio.create_task(gate.acquire(deadline=30, priority=10))
    done, _ = await asyncio.wait(low[:-1], timeout=5, return_when=asyncio.FIRST_COMPLETED)
    gate._woken = orig  # type: ignore[method-assign]
    [evicted2] = done
    assert isinstance(evicted2.exception(), Overloaded)
    assert int(await async_redis.hget(gate.keys.stats, "evicted") or 0) == 2
    await held.release()
    for t in (high, high2):
        await (await t).release()
    for t in low[:-2]:
        await (await t).release()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"weight": 0}, "weight"),
        ({"weight": True}, "weight"),
        ({"priority": 101}, "priority"),
        ({"priority": 1.5}, "priority"),
        ({"tenant": "a{b"}, "tenant"),
        ({"tenant": ""}, "tenant"),
    ],
)
async def test_bad_arguments_name_the_argument(
    fleet: Fleet, kwargs: dict[str, object], field: str
) -> None:
    gate = fleet.gate("args")
    with pytest.raises(ConfigError, match=field):
        await gate.acquire(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=field):
        async with gate.permit(**kwargs):  # type: ignore[arg-type]
            pass


async def test_a_malformed_class_is_refused_before_anything_is_written(
    async_redis: aredis.Redis, rut: RedisUnderTest
) -> None:
    """The scripts check what the client library would never send (a class outside 000..200,
    a brace in the tenant): an error, and the release in the same call is not applied."""
    keys = GateKeys.of(rut.prefix, "malformed")
    scripts = GateScripts(async_redis)
    d = GateSettings(floor=2, ceiling=2)
    [held] = await scripts.acquire_many(keys, [("p:1", 1000, "")], d)
    before = await async_redis.zrange(keys.holders, 0, -1)
    for cls in ("201}x", "abc", "090}a}b"):
        with pytest.raises(Exception, match="request class"):
            await scripts.acquire_many(keys, [("p:2", 1000, cls)], d, releases=["p:1"])
        assert await async_redis.zrange(keys.holders, 0, -1) == before == ["p:1"]
    assert held.status == 1


def test_killed_process_leaves_no_units(rut: RedisUnderTest, r: redis.Redis) -> None:
    """SIGKILL a process holding heavy leases and waiting in several lanes: after the TTLs and a
    sweep every unit is back and no lane, band or tenant entry is left."""
    keys = GateKeys.of(rut.prefix, "kill")
    proc = ctx.Process(
        target=workers.flood, args=(rut.url, rut.prefix, "kill", 4, 30, 3600, 0, "t1")
    )
    proc.start()
    try:
        wait_for(lambda: r.zcard(keys.waiters) >= 20, 20)
        os.kill(proc.pid or 0, signal.SIGKILL)
        proc.join(10)
    finally:
        if proc.is_alive():
            proc.kill()

    async def sweep_until_empty() -> None:
        async with aredis.Redis.from_url(rut.url) as client:
            scripts = GateScripts(client)
            for _ in range(200):
                await scripts.heartbeat(keys, "", 0, [], [])  # the coordinator's sweep
                if units(r, keys) == 0 and r.zcard(keys.waiters) == 0:
                    return
                await asyncio.sleep(0.1)

    asyncio.run(sweep_until_empty())
    assert_no_trace(r, keys)


# -- schema: rolling upgrades -------------------------------------------------------------------

SCHEMA1 = Path(__file__).parent / "lua_schema1"


def _schema1(r: redis.Redis, name: str) -> object:
    """A script of fleetgate 0.1 (schema 1), as released."""
    lib = (SCHEMA1 / "lib.lua").read_text()
    return r.register_script(lib + "\n" + (SCHEMA1 / f"{name}.lua").read_text())


def test_old_client_is_refused_by_a_schema2_gate(rut: RedisUnderTest, r: redis.Redis) -> None:
    """A 0.1 client's acquire on a gate this version registered fails (WRONGTYPE on the fenced
    queue key, whose value says why) before it can grant: no unit is miscounted."""
    keys = GateKeys.of(rut.prefix, "fence")

    async def new_client() -> None:
        async with Fleet(rut.url, prefix=rut.prefix, registry=CollectorRegistry()) as fleet:
            await fleet.gate("fence", floor=2, ceiling=2).acquire(weight=2)  # held: leaked

    asyncio.run(new_client())
    assert r.hget(keys.cfg, "schema") == str(SCHEMA)
    before = r.zrange(keys.holders, 0, -1, withscores=True)
    old_acquire = _schema1(r, "acquire")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        old_acquire(keys=[keys.base], args=[1, 8, 100, 10_000, 5_000, 0, "old:1", 1000])
    assert r.zrange(keys.holders, 0, -1, withscores=True) == before
    assert "older than 0.2" in r.get(keys.queue)


async def test_newer_schema_is_refused_clearly(fleet: Fleet, async_redis: aredis.Redis) -> None:
    gate = fleet.gate("future")
    async with gate.permit():
        pass
    await async_redis.hset(gate.keys.cfg, "schema", SCHEMA + 1)
    before = await async_redis.hgetall(gate.keys.stats)
    with pytest.raises(ConfigError, match=r"schema 3.*upgrade"):
        await gate.acquire()
    assert await async_redis.hgetall(gate.keys.stats) == before


def test_schema1_gate_is_converted_with_its_waiters_in_order(
    rut: RedisUnderTest, r: redis.Redis
) -> None:
    """A gate run by 0.1 scripts with parked callers: the first call of this version converts it
    (waiters kept, in FIFO order) and hands off in that order."""
    keys = GateKeys.of(rut.prefix, "convert")
    acquire = _schema1(r, "acquire")
    args = [1, 8, 100, 10_000, 60_000, 0]
    assert acquire(keys=[keys.base], args=[*args, "o:1", 60_000])[4] == 1  # granted
    for i in range(2, 6):
        assert acquire(keys=[keys.base], args=[*args, f"o:{i}", 60_000])[4] == 2  # parked
    assert r.type(keys.queue) == "zset"

    async def release_old_holder() -> int:
        async with aredis.Redis.from_url(rut.url) as client:
            return await GateScripts(client).release_many(keys, ["o:1"])

    assert asyncio.run(release_old_holder()) == 1
    assert r.hget(keys.cfg, "schema") == str(SCHEMA) and r.type(keys.queue) == "string"
    assert r.zrange(keys.holders, 0, -1) == ["o:2"]
    assert [member_id(m) for m in r.zrange(keys.lanes, 0, -1)] == ["o:3", "o:4", "o:5"]
    assert r.zcard(keys.fair) == 1
