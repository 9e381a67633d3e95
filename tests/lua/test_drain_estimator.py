"""The drain estimator of deadline-aware admission (``lua/lib_drain.lua``) on a real
redis-server, driven with a clock of the test's own: a steady drain is measured at its rate
(from the first grants on: no warm-up that would refuse calls), a change of pace is followed
within a time constant or two, an idle gap does not count as a stalled drain, an old history
starts again, and over random paces (hypothesis) the counters stay finite and non-negative and
the rate stays within the paces it saw."""

from __future__ import annotations

import json
import uuid

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetgate.keys import GateKeys
from fleetgate.scripts._library import lib_source

# the scripts against each server of the matrix (tests/_servers.py)
pytestmark = pytest.mark.servers

# Run drain_note for each (ms since the start, grants) of ARGV[2] (JSON) from ARGV[1] on, then
# return {s, w, rate at the last instant (grants per s), the rate after ARGV[3] ms more}.
_DRIVER = """
local t0, steps, after = tonumber(ARGV[1]), cjson.decode(ARGV[2]), tonumber(ARGV[3])
local last = t0
for _, st in ipairs(steps) do
  last = t0 + st[1]
  drain_note(last, '100', st[2])
end
adm_flush()
local s, w = drain_parse(adm_get('dr:100'))
local function per_s(x) if x == nil then return -1 end return x * 1000 end
return cjson.encode({s, w, per_s(drain_rate(last, '100')), per_s(drain_rate(last + after, '100'))})
"""


class Drain:
    def __init__(self, r: redis.Redis) -> None:
        self.r = r
        self.keys = GateKeys.of(f"e{uuid.uuid4().hex[:8]}", "drain")
        self.script = r.register_script(lib_source() + "\n" + _DRIVER)

    def run(
        self, steps: list[tuple[float, int]], after_ms: float = 0, t0: float = 10**12
    ) -> tuple[float, float, float, float]:
        """(s, w, grants/s at the last step, grants/s ``after_ms`` later; -1: no estimate),
        from no history."""
        self.r.delete(self.keys.adm)
        out = self.script(keys=self.keys.script_keys(), args=[t0, json.dumps(steps), after_ms])
        s, w, rate, later = json.loads(out)
        return float(s), float(w), float(rate), float(later)


def steady(per_s: float, seconds: float, start_ms: float = 0.0) -> list[tuple[float, int]]:
    """One grant every 1/per_s seconds for ``seconds`` from ``start_ms``."""
    gap = 1000.0 / per_s
    return [(start_ms + i * gap, 1) for i in range(int(seconds * per_s))]


@pytest.fixture
def drain(r: redis.Redis) -> Drain:
    return Drain(r)


def test_a_steady_drain_is_measured_at_its_rate_from_the_first_grants(drain: Drain) -> None:
    # 19 grants (weighted ~18.7): no history yet, so no estimate and no refusal
    assert drain.run(steady(50, 0.38))[2] == -1
    # 25 grants at 50/s (0.5 s): the first estimate is near the truth, a little high (the
    # first grant opens the window): an under-estimated wait, never a false refusal from it
    s, _, rate, _ = drain.run(steady(50, 0.5))
    assert s == pytest.approx(24.4, rel=0.02) and 50 <= rate <= 53, (s, rate)
    _, _, rate, _ = drain.run(steady(50, 60))
    assert rate == pytest.approx(50, rel=0.02)


def test_a_change_of_pace_is_followed(drain: Drain) -> None:
    """A 10x change of pace, either way, is followed to within 10 % (time constant 10 s): a
    slowdown, whose old count is 10x larger, in 60 s (meanwhile the rate is high: waits are
    under-estimated, refusals fewer), a speed-up in 30 s (meanwhile waits are over-estimated)."""
    for seconds, want in ((30, (6, 8)), (60, (4.5, 5.5))):
        _, _, rate, _ = drain.run(steady(50, 30) + steady(5, seconds, start_ms=30_000))
        assert want[0] <= rate <= want[1], (seconds, rate)
    for seconds, want in ((10, (25, 40)), (30, (45, 55))):
        _, _, rate, _ = drain.run(steady(5, 30) + steady(50, seconds, start_ms=30_000))
        assert want[0] <= rate <= want[1], (seconds, rate)


def test_idle_time_is_no_stalled_drain_and_an_old_history_starts_again(drain: Drain) -> None:
    # 50/s, then nothing for 20 s: the band had nobody waiting; at most 2 s of it count
    _, _, rate, later = drain.run(steady(50, 30), after_ms=20_000)
    assert later >= 0.8 * rate, (rate, later)
    # 40 s after the last grant the history is stale: no estimate at all
    _, _, _, later = drain.run(steady(50, 30), after_ms=40_000)
    assert later == -1
    # and the next grants start a new history
    s, _, _, _ = drain.run([*steady(50, 30), (75_000.0, 1)])
    assert s == 1


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    paces=st.lists(
        st.tuples(st.floats(0.5, 500), st.floats(0.1, 8), st.floats(0, 40_000)),
        min_size=1,
        max_size=5,
    )
)
def test_over_random_paces_the_counters_stay_sane(
    r: redis.Redis, paces: list[tuple[float, float, float]]
) -> None:
    steps: list[tuple[float, int]] = []
    t = 0.0
    for per_s, seconds, idle_ms in paces:
        part = steady(per_s, seconds, start_ms=t)
        steps += part
        t = (part[-1][0] if part else t) + idle_ms
    if not steps:
        return
    s, w, rate, _ = Drain(r).run(steps)
    assert s >= 0 and w >= 0
    if rate >= 0:  # an estimate: within the paces seen (the first window can be high)
        fastest = max(p for p, _, _ in paces)
        assert rate <= 2 * fastest + 1e-6, (rate, paces)
