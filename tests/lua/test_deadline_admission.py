"""Deadline-aware admission through the scripts, on a real redis-server: each band's drain (how
fast its waiters are granted) is measured by the hand-offs; an arrival that would park is
refused at once (status 7, the expected wait in ms) when, by that drain and the waiters ahead of
it, it would start after its deadline; never without history, behind the recovery fence, for a
call without a deadline, or on a gate that turned it off.
"""

from __future__ import annotations

import math
import uuid
from typing import Any

import pytest
import redis

from fleetgate.admission import lane_class
from fleetgate.keys import GateKeys
from fleetgate.scripts import SCRIPT_NAMES, script_source

from ._admission import banded

# the scripts against each server of the matrix (tests/_servers.py)
pytestmark = pytest.mark.servers

LONG_MS = 600_000
NO_DEADLINE_MS = 24 * 3600 * 1000
GRANTED, PARKED, TOO_LATE = 1, 2, 7


def bound(ahead: int, per_s: float) -> Any:
    """The estimate the scripts give for ``ahead`` waiters at ``per_s`` grants per second:
    ahead + sqrt(ahead) (a standard deviation of a Poisson count) over the rate, in ms."""
    return pytest.approx((ahead + math.sqrt(ahead)) / per_s * 1000, abs=10)


class Gate:
    """One gate of ``floor`` units; ``admission``: deadline_admission as the scripts take it
    (0 off, 1 start, 2 finish)."""

    def __init__(self, r: redis.Redis, floor: int = 1, admission: int = 1) -> None:
        self.r = r
        self.keys = GateKeys.of(f"d{uuid.uuid4().hex[:8]}", "deadline")
        self.scripts = {n: r.register_script(script_source(n)) for n in SCRIPT_NAMES}
        self.defaults = [
            floor, 64, 100, LONG_MS, LONG_MS, 100, 0, "", "", int(admission), "", "", "a}3"
        ]  # fmt: skip

    def call(self, name: str, *args: object) -> Any:
        return self.scripts[name](keys=self.keys.script_keys(), args=list(args))

    def acquire(
        self, lease_id: str, wait_ms: int = LONG_MS, priority: int = 0, tenant: str | None = None
    ) -> tuple[int, int]:
        """One request; (status, n): n = the expected wait (ms) when refused as too late. The
        reply's estimate (parked: the expected wait; refused as too late: the hold counted,
        with 'finish') is left in ``estimate``."""
        cls = lane_class(priority, tenant)
        lease_id = banded(lease_id, priority)  # the band tag a call of this priority carries
        reply = self.call("acquire", *self.defaults, 0, 0, 0, lease_id, wait_ms, cls)
        self.estimate = int(reply[9])
        return int(reply[5]), int(reply[7])

    def release(self, *ids: str) -> int:
        return int(self.call("release", 0, *ids))

    def set_drain(self, band: str, grants: float, over_ms: float) -> None:
        """Plant a band's drain history: ``grants`` counted over ``over_ms``, last moved now
        (the shape lib_drain.lua keeps, so an estimate can be checked exactly)."""
        now = self.r.time()
        now_ms = now[0] * 1000 + now[1] // 1000
        self.r.hset(self.keys.adm, f"dr:{band}", f"{grants},{over_ms},{now_ms}")

    def drain(self, band: str = "100") -> tuple[float, float, int] | None:
        v = self.r.hget(self.keys.adm, f"dr:{band}")
        if v is None:
            return None
        s, w, at = v.split(",")
        return float(s), float(w), int(at)


def test_hand_offs_measure_the_band_drain(r: redis.Redis) -> None:
    g = Gate(r)
    assert g.acquire("p:0")[0] == GRANTED
    holder = "p:0"
    for i in range(1, 31):
        assert g.acquire(f"p:{i}")[0] == PARKED
        assert g.release(holder) == 1  # hands the unit to p:i
        holder = f"p:{i}"
    s, w, _ = g.drain() or (0, 0, 0)
    assert 29 < s <= 30 and w > 0  # 30 hand-offs, a few ms of counted time
    # nothing but grants to waiters is counted: a direct grant adds nothing
    g.release(holder)
    assert g.acquire("p:99")[0] == GRANTED
    assert (g.drain() or (0,))[0] == s


def test_an_arrival_that_would_start_after_its_deadline_is_refused_at_once(
    r: redis.Redis,
) -> None:
    g = Gate(r)
    assert g.acquire("p:0")[0] == GRANTED
    for i in range(1, 5):
        assert g.acquire(f"p:{i}")[0] == PARKED
    g.set_drain("100", 100, 10_000)  # 10 grants/s
    # 4 wait ahead: it starts with the 5th grant, ~500 ms from now on average, and by ~724 ms
    # within a standard deviation (what it is refused by, so that it does not wait out a
    # deadline just past the average half of the time)
    status, expected = g.acquire("p:5", wait_ms=400)
    assert (status, expected) == (TOO_LATE, bound(5, 10))
    assert g.acquire("p:6", wait_ms=1000)[0] == PARKED  # it can make it: it waits
    assert r.hget(g.keys.stats, "too_late") == "1"
    assert r.zcard(g.keys.waiters) == 5  # the refused one holds no place
    # no deadline at all: never refused
    assert g.acquire("p:7", wait_ms=NO_DEADLINE_MS)[0] == PARKED


def test_higher_bands_wait_ahead_and_tenants_of_a_band_by_their_share(r: redis.Redis) -> None:
    g = Gate(r)
    assert g.acquire("p:0")[0] == GRANTED
    for i in range(1, 5):  # 4 waiters of priority 10 ...
        assert g.acquire(f"p:{100 + i}", priority=10)[0] == PARKED
    for i in range(1, 7):  # ... and 6 of tenant b (weight 1) at priority 0
        assert g.acquire(f"p:b{i}", tenant="b")[0] == PARKED
    g.set_drain("090", 50, 10_000)  # band of priority 10: 5 grants/s
    g.set_drain("100", 50, 10_000)  # band of priority 0: 5 grants/s
    # priority 10 arrival: the 4 of its band ahead and itself, at its band's rate
    assert g.acquire("p:105", wait_ms=1, priority=10) == (TOO_LATE, bound(5, 5))
    # tenant a (weight 3) at priority 0: the 4 of priority 10, and of b's 6 only what fair
    # queuing serves there while a's lane serves its first: ceil(1 / 3) = 1; 6 grants at the
    # two bands' 10 per s
    assert g.acquire("p:a1", wait_ms=1, tenant="a") == (TOO_LATE, bound(6, 10))
    # tenant b's next: 6 of its lane and the 4 above, plus itself: 11 at 10 per s
    assert g.acquire("p:b7", wait_ms=1, tenant="b") == (TOO_LATE, bound(11, 10))
    # priority 0 alone, no higher band: a drain of its band only
    assert g.acquire("p:b8", wait_ms=5000, tenant="b")[0] == PARKED


@pytest.mark.parametrize("case", ["no history", "turned off", "stale history"])
def test_no_refusal_without_a_measured_drain(r: redis.Redis, case: str) -> None:
    g = Gate(r, admission=int(case != "turned off"))
    assert g.acquire("p:0")[0] == GRANTED
    assert g.acquire("p:1")[0] == PARKED
    if case == "no history":
        g.set_drain("100", 19, 10_000)  # fewer than 20 grants counted
    elif case == "turned off":
        g.set_drain("100", 1000, 1000)
    else:
        g.set_drain("100", 1000, 1000)
        s = r.hget(g.keys.adm, "dr:100").rsplit(",", 1)[0]
        r.hset(g.keys.adm, "dr:100", f"{s},1")  # the last grant long ago
    assert g.acquire("p:2", wait_ms=1)[0] == PARKED


def test_the_recovery_fence_is_no_drain(r: redis.Redis) -> None:
    """Behind the recovery fence of a gate found without state every request parks: the
    fence's end, not the drain, says when grants start."""
    g = Gate(r)
    r.hset(g.keys.cfg, mapping={"floor": 1, "fence": 10**15, "schema": 2})
    g.set_drain("100", 1000, 1000)
    assert g.acquire("p:1", wait_ms=1)[0] == PARKED


def test_a_parked_waiter_whose_estimate_passes_its_deadline_leaves_at_its_heartbeat(
    r: redis.Redis,
) -> None:
    g = Gate(r)
    assert g.acquire("p:0")[0] == GRANTED
    for i in range(1, 5):
        assert g.acquire(f"p:{i}", wait_ms=LONG_MS)[0] == PARKED
    members = {m.rsplit("}", 1)[1]: m for m in r.zrange(g.keys.lanes, 0, -1)}
    g.set_drain("100", 100, 100_000)  # the drain slowed to 1 grant/s
    # p:4 (3 before it) may wait 1 s more, p:1 (the head) 2.5 s; p:2 has no deadline
    waiters = [(members["p:4"], 1000), (members["p:1"], 2500), (members["p:2"], NO_DEADLINE_MS)]
    args: list[object] = ["p", 10_000, 1, "p:0", 0, len(waiters)]
    for member, remaining in waiters:
        args += [member, remaining]
    reply = g.call("heartbeat", *args, 0, 0, *g.defaults)
    too_late, too_late_ms = reply[18], reply[19]
    assert too_late == ["p:4"] and int(too_late_ms[0]) == bound(4, 1), (too_late, too_late_ms)
    assert members["p:4"] not in r.zrange(g.keys.lanes, 0, -1)  # it left the wait list
    assert r.hget(g.keys.stats, "too_late") == "1"
    assert r.zcard(g.keys.waiters) == 3


def test_callers_refused_by_a_full_list_are_told_to_return_a_place_apart(r: redis.Redis) -> None:
    """Overloaded's retry_after: each caller refused because the wait list is full is told to
    come back once the drain has freed a place for it and for those refused before it (the
    acquire reply's token of a status-0 request), so callers refused together return spread
    over the drain, not together; the callers already due back no longer count."""
    g = Gate(r)
    g.defaults[2] = 2  # max_queued
    assert g.acquire("p:0")[0] == GRANTED
    assert [g.acquire(f"p:{i}")[0] for i in (1, 2)] == [PARKED, PARKED]
    g.set_drain("100", 50, 10_000)  # 5 grants/s: a place frees every 200 ms
    reqs = [x for i in range(3, 8) for x in (f"p:{i}", LONG_MS, "")]
    reply = g.call("acquire", *g.defaults, 0, 0, 0, *reqs)
    assert [int(x) for x in reply[5::5]] == [0] * 5  # full
    assert [int(x) for x in reply[6::5]] == pytest.approx([200, 400, 600, 800, 1000], abs=5)
    # 5 callers due back over the next second; 0.4 s later two of them are due already
    at = float(r.hget(g.keys.adm, "rj").split(",")[1])
    r.hset(g.keys.adm, "rj", f"5,{at - 400:.0f}")
    reply = g.call("acquire", *g.defaults, 0, 0, 0, "p:8", LONG_MS, "")
    assert (int(reply[5]), int(reply[6])) == (0, pytest.approx(800, abs=5))
    # a gate that turned deadline admission off keeps no drain: no estimate
    assert g.call("publish", 1, LONG_MS, "", 1, "deadline_admission", 0)[0] == 1
    reply = g.call("acquire", *g.defaults, 0, 0, 0, "p:9", LONG_MS, "")
    assert (int(reply[5]), int(reply[6])) == (0, 0)


def test_a_parked_call_is_told_its_expected_wait(r: redis.Redis) -> None:
    """The acquire reply of a call that parks carries the wait the drain predicts for it (the
    estimate a refusal would name), also for a call without a deadline; none without history,
    and none for a grant."""
    g = Gate(r)
    assert g.acquire("p:0")[0] == GRANTED
    assert g.estimate == -1
    assert g.acquire("p:1")[0] == PARKED
    assert g.estimate == -1  # no drain history yet
    g.set_drain("100", 100, 10_000)  # 10 grants/s
    for i in range(2, 5):
        assert g.acquire(f"p:{i}", wait_ms=NO_DEADLINE_MS)[0] == PARKED
        assert g.estimate == bound(i, 10)  # i - 1 ahead of it, and itself
    g2 = Gate(r, admission=0)
    assert g2.acquire("p:0")[0] == GRANTED
    g2.set_drain("100", 100, 10_000)
    assert g2.acquire("p:1")[0] == PARKED
    assert g2.estimate == -1  # admission off: no estimate


def test_finish_admission_counts_the_bands_mean_hold(r: redis.Redis) -> None:
    """With deadline_admission 'finish' (2) the deadline must cover the expected wait and the
    band's mean hold, its units held over its grant rate (Little's law): a call that would
    start in time but end past its deadline is refused, naming the hold; 'start' parks it."""
    for admission in (1, 2):
        g = Gate(r, floor=2, admission=admission)
        assert [g.acquire(f"p:{i}")[0] for i in (0, 1)] == [GRANTED, GRANTED]
        assert g.acquire("p:2")[0] == PARKED
        g.set_drain("100", 100, 10_000)  # 10 grants/s with 2 units held: a mean hold of 200 ms
        # 1 ahead + itself: ~341 ms to start, ~541 ms to end
        status, expected = g.acquire("p:3", wait_ms=450)
        if admission == 1:
            assert (status, g.estimate) == (PARKED, bound(2, 10))
        else:
            assert (status, expected) == (TOO_LATE, bound(2, 10))
            assert g.estimate == pytest.approx(200, abs=1)
            assert g.acquire("p:4", wait_ms=700)[0] == PARKED  # wait and hold fit: it waits


def test_finish_admission_at_the_heartbeat(r: redis.Redis) -> None:
    """A parked waiter re-estimated by its pod's heartbeat under 'finish' leaves when its wait
    and its band's mean hold pass what it may still wait; the reply names the hold."""
    g = Gate(r, admission=2)
    assert g.acquire("p:0")[0] == GRANTED
    for i in range(1, 3):
        assert g.acquire(f"p:{i}", wait_ms=LONG_MS)[0] == PARKED
    members = {m.rsplit("}", 1)[1]: m for m in r.zrange(g.keys.lanes, 0, -1)}
    g.set_drain("100", 100, 100_000)  # 1 grant/s, 1 unit held: a mean hold of 1 s
    # p:1, the head, starts by ~2 s: with 2.5 s left it would end past them, with 3.5 s not
    waiters = [(members["p:1"], 2500), (members["p:2"], 6000)]
    args: list[object] = ["p", 10_000, 1, "p:0", 0, len(waiters)]
    for member, remaining in waiters:
        args += [member, remaining]
    reply = g.call("heartbeat", *args, 0, 0, *g.defaults)
    assert reply[18] == ["p:1"], reply[18:]
    assert int(reply[19][0]) == bound(1, 1)
    assert int(reply[20][0]) == pytest.approx(1000, abs=1)


def test_finish_admission_counts_band_100s_own_units(r: redis.Redis) -> None:
    """Band 100's hold counts its own units only: the units held less those of the other bands
    (lib_units.lua adm_bands), so a lease of priority -10 beside them lengthens nothing."""
    g = Gate(r, floor=3, admission=2)
    assert g.acquire("low:0", priority=-10)[0] == GRANTED
    assert [g.acquire(f"p:{i}")[0] for i in (0, 1)] == [GRANTED, GRANTED]
    assert g.acquire("p:2")[0] == PARKED
    g.set_drain("100", 100, 10_000)  # 10 grants/s with 2 units of band 100 held: 200 ms
    status, expected = g.acquire("p:3", wait_ms=450)
    assert (status, expected) == (TOO_LATE, bound(2, 10))
    assert g.estimate == pytest.approx(200, abs=1)  # not 300: the unit of band 110 is not its
