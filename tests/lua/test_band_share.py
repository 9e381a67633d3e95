"""Headroom between bands (``lua/lib_share.lua``) against a real redis-server: a band share
bounds what a band and the bands below it hold together, the units above it stay free for
higher bands even while none of theirs waits, and the held counts per band follow every path
that adds or removes a lease."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
import redis

from fleetgate.admission import lane_class
from fleetgate.keys import GateKeys
from fleetgate.scripts import SCRIPT_NAMES, script_source
from fleetgate.settings import GateSettings

from ._admission import banded

# the scripts against each server of the matrix (tests/_servers.py)
pytestmark = pytest.mark.servers

LONG_MS = 600_000
GRANTED, PARKED, OVER_SHARE = 1, 2, 8


class Gate:
    """One gate of ``floor`` units with band shares ``share`` (deadline admission off)."""

    def __init__(
        self, r: redis.Redis, floor: int, share: dict[int, float], ceiling: int = 16
    ) -> None:
        self.r = r
        self.keys = GateKeys.of(f"s{uuid.uuid4().hex[:8]}", "share")
        self.scripts = {n: r.register_script(script_source(n)) for n in SCRIPT_NAMES}
        self.settings = GateSettings(
            floor=floor,
            ceiling=ceiling,
            lease_ms=LONG_MS,
            waiter_ms=LONG_MS,
            deadline_admission=False,
            shed_below=-100,  # every band parks
            band_share=share,
        )

    def call(self, name: str, *args: object) -> Any:
        return self.scripts[name](keys=self.keys.script_keys(), args=list(args))

    def acquire(self, lease_id: str, priority: int = 0, tenant: str | None = None) -> int:
        """One request of ``priority``; its status (``lease_id`` gets the band tag)."""
        lid = banded(lease_id, priority)
        cls = lane_class(priority, tenant)
        reply = self.call("acquire", *self.settings.argv(), 0, 0, 0, lid, LONG_MS, cls)
        return int(reply[5])

    def release(self, lease_id: str, priority: int = 0) -> int:
        return int(self.call("release", 0, banded(lease_id, priority)))

    def holders(self) -> set[str]:
        return set(self.r.zrange(self.keys.holders, 0, -1))

    def inspect(self) -> dict[str, Any]:
        return json.loads(self.call("inspect", 10))

    def band_units(self) -> dict[str, int]:
        return self.inspect()["band_units"]

    def publish_share(self, share: dict[int, float]) -> None:
        cfg = GateSettings(band_share=share).as_cfg()
        assert self.call("publish", 1, LONG_MS, "", 1, "band_share", cfg["band_share"])[0] == 1


def test_a_band_holds_no_more_than_its_share_and_the_rest_stays_free(r: redis.Redis) -> None:
    g = Gate(r, floor=4, share={0: 0.5})  # priority 0 and below: 2 of 4 units
    assert [g.acquire(f"p:{i}") for i in (1, 2, 3)] == [GRANTED, GRANTED, PARKED]
    # 2 units are free and no higher band waits: they stay free all the same
    assert g.holders() == {"p:1", "p:2"}
    assert g.inspect()["lanes"][0]["reserved"] == "p:3"  # its band's head, kept for it
    # an interactive arrival starts at once, twice
    assert g.acquire("h:1", priority=10) == GRANTED
    assert g.acquire("h:2", priority=10) == GRANTED
    assert g.band_units() == {"0": 2, "10": 2}
    # an interactive release frees a unit the batch band may not take ...
    assert g.release("h:1", priority=10) == 1
    assert "p:3" not in g.holders()
    assert g.acquire("h:3", priority=10) == GRANTED
    # ... a batch release frees one it may: the parked head gets it in the same call
    assert g.release("p:1") == 1
    assert g.holders() == {"p:2", "p:3", "h:2b090", "h:3b090"}


def test_nested_shares_bind_each_band_by_every_share_at_or_above_it(r: redis.Redis) -> None:
    # priority 0 and below: 3 of 4; priority -5 and below: 1 of 4
    g = Gate(r, floor=4, share={0: 0.75, -5: 0.25})
    assert [g.acquire(f"l:{i}", priority=-5) for i in (1, 2)] == [GRANTED, PARKED]
    assert [g.acquire(f"b:{i}") for i in (1, 2, 3)] == [GRANTED, GRANTED, PARKED]
    assert g.acquire("h:1", priority=10) == GRANTED
    assert g.band_units() == {"-5": 1, "0": 2, "10": 1}
    # a release of priority 0: its own head first (strict bands), not the -5 one
    assert g.release("b:1") == 1
    assert "b:3" in g.holders() and "l:2b105" not in g.holders()
    # the -5 lease goes: its parked one takes the band's single unit
    assert g.release("l:1", priority=-5) == 1
    assert "l:2b105" in g.holders()


def test_a_share_never_shuts_a_band_out(r: redis.Redis) -> None:
    g = Gate(r, floor=1, share={0: 0.3})  # 0.3 of 1 unit: still one call at a time
    assert [g.acquire("p:1"), g.acquire("p:2")] == [GRANTED, PARKED]
    assert g.release("p:1") == 1
    assert g.holders() == {"p:2"}


def test_a_call_heavier_than_its_share_of_the_ceiling_is_refused(r: redis.Redis) -> None:
    g = Gate(r, floor=4, ceiling=8, share={0: 0.5})  # at most 4 units of priority 0, ever
    reply = g.call("acquire", *g.settings.argv(), 0, 0, 0, "p:1w5", LONG_MS, lane_class(0, None))
    assert (int(reply[5]), int(reply[7])) == (OVER_SHARE, 4)
    assert g.acquire("p:2w5", priority=10) == PARKED  # a higher band is not bound: it waits
    assert int(g.inspect()["stats"]["too_heavy"]) == 1


def test_a_head_heavier_than_its_share_at_this_limit_waits_for_the_limit(r: redis.Redis) -> None:
    g = Gate(r, floor=4, ceiling=8, share={0: 0.5})
    assert g.acquire("p:1w3", tenant="a") == PARKED  # 3 > 2 = half of 4: needs a limit of 6
    assert r.zscore(g.keys.big, "a}100") == 6
    assert g.acquire("p:2", tenant="b") == GRANTED  # it stalls nobody else
    assert g.call("set_target", 6, 1, LONG_MS)[0] == 1  # half of 6 = 3; 1 held by p:2
    assert g.holders() == {"p:2"}  # 1 + 3 > 3: it waits in the fair order now
    assert g.release("p:2") == 1
    assert g.holders() == {"p:1w3"}


def test_a_lowered_share_refuses_a_parked_head_it_can_never_admit(r: redis.Redis) -> None:
    g = Gate(r, floor=8, ceiling=8, share={0: 0.5})
    assert [g.acquire("p:1w4"), g.acquire("p:2w4")] == [GRANTED, PARKED]
    g.publish_share({0: 0.25})  # priority 0 may hold 2 units now: a weight of 4 never
    assert r.zcard(g.keys.waiters) == 0
    assert r.lrange(g.keys.wake("p"), 0, -1) == ["p:2w4=s2"]
    # what is held stays held (nothing is revoked); the band waits until it is below its share
    assert g.holders() == {"p:1w4"}
    assert g.acquire("p:3") == PARKED
    assert g.release("p:1w4") == 1
    assert g.holders() == {"p:3"}


@pytest.mark.parametrize("removal", ["release", "expiry", "loss and adoption"])
def test_the_held_counts_follow_every_path_a_lease_takes(r: redis.Redis, removal: str) -> None:
    g = Gate(r, floor=6, share={0: 0.5})
    assert g.acquire("h:1w2", priority=10) == GRANTED
    assert g.acquire("l:2", priority=-3) == GRANTED
    assert g.acquire("p:3") == GRANTED
    assert r.hget(g.keys.adm, "held") == "090=2,103=1"  # band 100 holds the rest
    lid = "h:1b090w2"
    if removal == "release":
        assert g.release("h:1w2", priority=10) == 1
    elif removal == "expiry":
        r.zadd(g.keys.holders, {lid: 1})  # its pod died: reaped by the next sweep
        g.call("heartbeat", "", 1000, 0, 0)
    else:  # Redis lost it while its work runs: the pod's heartbeat counts it again
        r.zrem(g.keys.holders, lid)
        r.hset(g.keys.adm, "held", "103=1")
        r.hincrby(g.keys.adm, "extra", -1)
        g.call("heartbeat", "h", 10_000, 1, lid, 10**15, 0, 0, 0, *g.settings.argv())
    want = "090=2,103=1" if removal == "loss and adoption" else "103=1"
    assert r.hget(g.keys.adm, "held") == want
    for lease in sorted(g.holders()):
        assert int(g.call("release", 0, lease)) == 1
    assert r.hget(g.keys.adm, "held") is None  # nothing is left once no lease is


def test_an_id_without_the_band_of_its_class_is_refused(r: redis.Redis) -> None:
    g = Gate(r, floor=2, share={})
    with pytest.raises(redis.ResponseError, match="does not carry the band"):
        g.call("acquire", *g.settings.argv(), 0, 0, 0, "p:1", LONG_MS, lane_class(10, None))
    assert r.zcard(g.keys.holders) == 0
