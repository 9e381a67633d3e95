"""Revocation (``lua/lib_revoke.lua``) against a real redis-server: once the head of a higher
band has waited ``revoke_after``, the gate asks lower bands for the units it lacks (lowest band
first), the holders' heartbeats mark their newest leases of those bands, once per shortage, and
a revoked lease keeps its units until it is released or lapses: the cap never slips."""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import redis

from fleetgate.admission import lane_class
from fleetgate.keys import GateKeys
from fleetgate.scripts import SCRIPT_NAMES, script_source
from fleetgate.settings import GateSettings

from ._admission import banded, units

# the scripts against each server of the matrix (tests/_servers.py)
pytestmark = pytest.mark.servers

LONG_MS = 600_000
GRANTED, PARKED = 1, 2
REVOKE_S = 0.2


class Gate:
    """One gate of ``floor`` units, strict bands, revocation after ``revoke_after`` s."""

    def __init__(self, r: redis.Redis, floor: int, revoke_after: float | None = REVOKE_S) -> None:
        self.r = r
        self.keys = GateKeys.of(f"v{uuid.uuid4().hex[:8]}", "revoke")
        self.scripts = {n: r.register_script(script_source(n)) for n in SCRIPT_NAMES}
        self.settings = GateSettings(
            floor=floor,
            ceiling=16,
            lease_ms=LONG_MS,
            waiter_ms=LONG_MS,
            deadline_admission=False,
            shed_below=-100,  # every band parks
            revoke_after=revoke_after,
        )

    def call(self, name: str, *args: object) -> Any:
        return self.scripts[name](keys=self.keys.script_keys(), args=list(args))

    def acquire(self, lease_id: str, priority: int = 0) -> int:
        """One request of ``priority`` (``lease_id`` gets the band tag); its status."""
        lid, cls = banded(lease_id, priority), lane_class(priority, None)
        return int(self.call("acquire", *self.settings.argv(), 0, 0, 0, lid, LONG_MS, cls)[5])

    def member(self, lease_id: str) -> str:
        return next(m for m in self.r.zrange(self.keys.lanes, 0, -1) if m.endswith(lease_id))

    def beat(self, pod: str, leases: list[str] = (), waiters: list[str] = ()) -> list[str]:  # type: ignore[assignment]
        """``pod``'s heartbeat with its leases (newest first) and parked waiters (lease ids);
        the leases it is told are revoked."""
        args: list[object] = [pod, 10_000, len(leases)]
        for lid in leases:
            args += [lid, 10**15]
        args.append(len(waiters))
        for wid in waiters:
            args += [self.member(wid), LONG_MS]
        reply = self.call("heartbeat", *args, 0, 0, *self.settings.argv())
        return list(reply[21])

    def demand(self) -> str | None:
        return self.r.hget(self.keys.adm, "rd")

    def holders(self) -> set[str]:
        return set(self.r.zrange(self.keys.holders, 0, -1))

    def marks(self) -> list[str]:
        return list(self.r.zrangebyscore(self.keys.evicted, 2**52, 2**52))


def commands(r: redis.Redis, run: Callable[[], object]) -> Counter[str]:
    """The Redis commands run while ``run()`` runs, by name (INFO commandstats deltas; the
    tests' server runs nothing else meanwhile)."""

    def calls() -> Counter[str]:
        stats = r.info("commandstats")
        return Counter({k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()})

    before = calls()
    run()
    return calls() - before


def test_a_waiting_head_gets_units_back_from_the_newest_lease_once(r: redis.Redis) -> None:
    g = Gate(r, floor=3)
    assert [g.acquire(f"b:{i}") for i in (1, 2, 3)] == [GRANTED] * 3  # batch fills the gate
    assert g.acquire("i:1", priority=10) == PARKED
    # not yet: the head has waited less than revoke_after
    assert g.beat("i", waiters=[banded("i:1", 10)]) == [] and g.demand() is None
    assert g.beat("b", leases=["b:3", "b:2", "b:1"]) == []
    time.sleep(REVOKE_S + 0.05)
    # the waiter's pod asks band 100 for the one unit its head lacks ...
    assert g.beat("i", waiters=[banded("i:1", 10)]) == []
    assert g.demand() == "100=1"
    # ... and the holder's heartbeat gives its newest lease back, once
    assert g.beat("b", leases=["b:3", "b:2", "b:1"]) == ["b:3"]
    assert g.demand() is None
    assert (
        g.beat("i", waiters=[banded("i:1", 10)]) == [] and g.demand() is None
    )  # the shortage is covered
    assert g.beat("b", leases=["b:3", "b:2", "b:1"]) == ["b:3"]  # told again, nothing more
    assert r.hget(g.keys.stats, "revoked") == "1"
    # a mark frees nothing: the head still waits, the units are all held
    assert units(r, g.keys) == 3 and g.holders() == {"b:1", "b:2", "b:3"}
    # released, the revoked lease's unit goes to the head
    assert int(g.call("release", 0, "b:3")) == 1
    assert g.holders() == {"b:1", "b:2", banded("i:1", 10)}
    assert g.beat("b", leases=["b:2", "b:1"]) == []  # nothing more is asked
    assert r.zrangebyscore(g.keys.evicted, 2**52, 2**52) == []  # the mark is gone


def test_the_lowest_band_gives_first_and_only_what_the_head_lacks(r: redis.Redis) -> None:
    g = Gate(r, floor=4)
    assert g.acquire("low:1", priority=-10) == GRANTED
    assert [g.acquire(f"mid:{i}") for i in (1, 2)] == [GRANTED, GRANTED]
    assert g.acquire("top:1", priority=20) == GRANTED
    heavy = "i:1w3"  # a head of priority 10 needs 3 units, 0 are free
    assert g.acquire(heavy, priority=10) == PARKED
    time.sleep(REVOKE_S + 0.05)
    g.beat("i", waiters=[banded(heavy, 10)])
    # band 110 (priority -10) first, then band 100; band 080 (above the head) never
    assert g.demand() == "100=2,110=1"
    assert g.beat("low", leases=[banded("low:1", -10)]) == [banded("low:1", -10)]
    assert g.beat("mid", leases=["mid:2", "mid:1"]) == ["mid:2", "mid:1"]
    assert g.beat("top", leases=[banded("top:1", 20)]) == []
    assert g.demand() is None and units(r, g.keys) == 4


def test_band_100_is_asked_no_more_than_its_own_units(r: redis.Redis) -> None:
    """Band 100 holds the units held less the other bands' (lib_units.lua adm_bands): a head
    lacking more than the bands below it hold asks each for what it holds, no more."""
    g = Gate(r, floor=4)
    assert g.acquire("low:1", priority=-10) == GRANTED
    assert [g.acquire(f"mid:{i}") for i in (1, 2)] == [GRANTED, GRANTED]
    assert g.acquire("top:1", priority=20) == GRANTED
    heavy = "i:1w4"  # a head of priority 10 needs all 4 units; below it are 3
    assert g.acquire(heavy, priority=10) == PARKED
    time.sleep(REVOKE_S + 0.05)
    g.beat("i", waiters=[banded(heavy, 10)])
    assert g.demand() == "100=2,110=1"


def test_a_frozen_holder_keeps_its_units_until_its_lease_lapses(r: redis.Redis) -> None:
    """A revoked holder that never beats again holds its units: the head is granted only once
    the lease has lapsed and been reaped."""
    g = Gate(r, floor=1)
    assert g.acquire("b:1") == GRANTED
    assert g.acquire("i:1", priority=10) == PARKED
    time.sleep(REVOKE_S + 0.05)
    g.beat("i", waiters=[banded("i:1", 10)])
    assert g.beat("b", leases=["b:1"]) == ["b:1"]
    for _ in range(3):  # its holder is frozen: the waiter's beats change nothing
        g.beat("i", waiters=[banded("i:1", 10)])
        assert g.holders() == {"b:1"} and units(r, g.keys) == 1
    r.zadd(g.keys.holders, {"b:1": 1})  # its TTL lapses
    g.call("heartbeat", "", 1000, 0, 0)  # the coordinator's sweep
    assert g.holders() == {banded("i:1", 10)}


def test_no_revocation_without_revoke_after(r: redis.Redis) -> None:
    g = Gate(r, floor=1, revoke_after=None)
    assert g.acquire("b:1") == GRANTED
    assert g.acquire("i:1", priority=10) == PARKED
    time.sleep(REVOKE_S + 0.05)
    assert g.beat("i", waiters=[banded("i:1", 10)]) == []
    assert g.beat("b", leases=["b:1"]) == [] and g.demand() is None
    assert r.hget(g.keys.cfg, "revoke_after_ms") is None


def test_revoke_after_is_stored_and_shown(r: redis.Redis) -> None:
    g = Gate(r, floor=1, revoke_after=1.5)
    assert g.acquire("b:1") == GRANTED
    assert r.hget(g.keys.cfg, "revoke_after_ms") == "1500"
    assert GateSettings(revoke_after=1.5).as_cfg()["revoke_after_ms"] == 1500


def test_nobody_waiting_and_no_mark_costs_the_heartbeat_no_revocation_lookup(
    r: redis.Redis,
) -> None:
    """With revoke_after, a heartbeat where nobody waits and no lease is revoked only reads adm's
    demand and mark flag (one HMGET) and, for a pod that holds leases, whether they are revoked
    (one ZMSCORE): no look for the marks, none at the fair order's first lane."""
    cost: dict[float | None, list[Counter[str]]] = {}
    for after in (None, REVOKE_S):
        g = Gate(r, floor=2, revoke_after=after)
        assert g.acquire("b:1") == GRANTED
        g.beat("b", leases=["b:1"])
        cost[after] = [commands(r, partial(g.beat, "b", leases=ls)) for ls in ([], ["b:1"])]
    extra = [cost[REVOKE_S][k] - cost[None][k] for k in (0, 1)]
    assert extra == [Counter(hmget=1), Counter(hmget=1, zmscore=1)]


def test_with_nobody_waiting_a_revoked_lease_is_still_told_and_its_mark_dropped(
    r: redis.Redis,
) -> None:
    """The waiter that asked leaves: its holder is still told of the revoked lease every beat,
    the mark goes with the lease, and then the beats are cheap again."""
    g = Gate(r, floor=2)
    assert [g.acquire(f"b:{i}") for i in (1, 2)] == [GRANTED, GRANTED]
    assert g.acquire("i:1", priority=10) == PARKED
    time.sleep(REVOKE_S + 0.05)
    g.beat("i", waiters=[banded("i:1", 10)])
    assert g.beat("b", leases=["b:2", "b:1"]) == ["b:2"]
    assert int(g.call("cancel", banded("i:1", 10), g.member(banded("i:1", 10)))[0]) == 1
    assert r.zcard(g.keys.waiters) == 0
    for _ in range(2):
        assert g.beat("b", leases=["b:2", "b:1"]) == ["b:2"] and g.marks() == ["b:2=v"]
    assert int(g.call("release", 0, "b:2")) == 1
    assert g.marks() == ["b:2=v"]  # a release leaves the mark to the next heartbeat
    assert g.beat("b", leases=["b:1"]) == [] and g.marks() == []
    plain = Gate(r, floor=2, revoke_after=None)  # the same holder's beat without revocation
    assert plain.acquire("b:1") == GRANTED
    plain.beat("b", leases=["b:1"])
    cost = commands(r, lambda: g.beat("b", leases=["b:1"]))
    assert cost - commands(r, lambda: plain.beat("b", leases=["b:1"])) == Counter(
        hmget=1, zmscore=1
    )
