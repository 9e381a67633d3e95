"""The admission order's rules through the scripts, step by step, on a real redis-server.

Each test drives the real scripts through a sequence of calls that puts one rule to the test
(the random sequences of ``test_transitions_model.py`` cover the rest): every lane with waiters
stays in the fair order or in big, through reaps, batches and tags; units a call frees go to the
waiters; and a ceiling lowered below a parked head refuses that head and lets its lane move on.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import redis

from fleetgate.admission import lane_class
from fleetgate.keys import GateKeys
from fleetgate.scripts import SCRIPT_NAMES, HeartbeatReply, script_source

from ._admission import banded

# the scripts against each server of the matrix (tests/_servers.py)
pytestmark = pytest.mark.servers

LONG_MS = 600_000


class Gate:
    def __init__(self, r: redis.Redis, max_queued: int, floor: int = 1, ceiling: int = 6) -> None:
        self.r = r
        self.keys = GateKeys.of(f"b{uuid.uuid4().hex[:8]}", "steps")
        self.scripts = {n: r.register_script(script_source(n)) for n in SCRIPT_NAMES}
        self.defaults = [
            floor, ceiling, max_queued, LONG_MS, LONG_MS, max_queued, 0, "", "", 0, "", "", ""
        ]  # fmt: skip

    def call(self, name: str, *args: object) -> Any:
        return self.scripts[name](keys=self.keys.script_keys(), args=list(args))

    def acquire(self, *reqs: tuple[str, int, str | None]) -> list[int]:
        """reqs: (id, priority, tenant); returns the statuses."""
        # each id with the band tag a call of its priority carries
        triples = [x for i, p, t in reqs for x in (banded(i, p), LONG_MS, lane_class(p, t))]
        reply = self.call("acquire", *self.defaults, 0, 0, 0, *triples)
        return [int(x) for x in reply[5::5]]

    def lanes(self) -> set[str]:
        return {
            m.split("}")[0] + "}" + m.split("}")[1] for m in self.r.zrange(self.keys.lanes, 0, -1)
        }

    def scheduled(self) -> set[str]:
        """Lanes in fair ('<R>}<F20>}<tenant>') or big (lane)."""
        fair = {
            f"{f.split('}')[2]}}}{f.split('}')[0]}" for f in self.r.zrange(self.keys.fair, 0, -1)
        }
        return fair | set(self.r.zrange(self.keys.big, 0, -1))


def test_a_lane_parked_into_before_a_waiter_reap_in_the_same_acquire_is_scheduled(
    r: redis.Redis,
) -> None:
    """When the wait list is full, the request loop reaps expired waiters and resets the
    lane_len cache. A lane this call parked into *before* the reap is still scheduled: lanes are
    counted before the parks go in (counted after the ZADD of this call's parks, 1 not 0, the
    lane would never enter fair or big, and its waiters would never be handed a permit)."""
    g = Gate(r, max_queued=2)
    assert g.acquire(("pa:1", 0, None)) == [1]  # holds the only unit
    assert g.acquire(("pa:2", 0, None)) == [2]  # parks in the default lane
    r.zadd(g.keys.waiters, {r.zrange(g.keys.lanes, 0, -1)[0]: 1})  # ... and expires
    # One batch: 'a' parks (list 2/2), 'b' finds the list full, reaps pa:2, parks.
    assert g.acquire(("pa:3", 0, "a"), ("pa:4", 0, "b")) == [2, 2]
    assert g.lanes() == {"a}100", "b}100"}
    assert g.scheduled() == g.lanes(), "every non-empty lane must be in fair or big"
    # Both lanes are served, in tag order (a tie: by tenant name).
    assert g.call("release", 0, "pa:1") == 1
    assert r.zrange(g.keys.holders, 0, -1) == ["pa:3"]
    assert g.call("release", 0, "pa:3") == 1
    assert r.zrange(g.keys.holders, 0, -1) == ["pa:4"]


def test_a_batch_leaves_no_idle_unit_when_its_parks_put_a_fitting_head_first(
    r: redis.Redis,
) -> None:
    """Within one batch a request that does not fit parks (only handoff reserves), and a later
    request of the same band parks behind it although its lane gets the smaller tag: the first
    lane of fair then has a head that fits the free unit. An acquire that parked hands off
    before it returns, so the unit does not idle until some later call hands off."""
    g = Gate(r, max_queued=5)
    g.defaults[-1] = "a}2"  # tenant a weighs 2: its tags grow half as fast
    assert g.call("set_target", 2, 1, LONG_MS)[0] == 1
    assert g.acquire(("pa:1", 0, "b")) == [1]  # 1 of 2 units held
    # pa:2w2 does not fit (parks, tag 0 + 2000); pa:3 of tenant a parks too (tag 0 + 500)
    assert g.acquire(("pa:2w2", 0, None), ("pa:3", 0, "a")) == [2, 2]
    # pa:3 (weight 1, the smaller tag) was handed the free unit by the same call
    assert sorted(r.zrange(g.keys.holders, 0, -1)) == ["pa:1", "pa:3"]
    [wake] = r.lrange(g.keys.wake("pa"), 0, -1)
    assert wake.startswith("pa:3=")
    assert r.zrange(g.keys.fair, 0, -1) == ["100}00000000000000002000}"]  # pa:2w2 next


def test_a_big_lane_whose_head_fits_after_a_waiter_reap_in_acquire_is_served(
    r: redis.Redis,
) -> None:
    """A lane whose head weighs more than the limit is in big. When that head expires and
    acquire's waiter reap removes it (wait list full), acquire readmits the lane, whose new head
    fits (as set_target, publish, cancel and heartbeat do): a later, lower-band request is not
    granted before it."""
    g = Gate(r, max_queued=2)
    g.defaults[6] = -1  # shed_below -1: priority -1 parks/grants like any other band
    assert g.call("set_target", 4, 1, LONG_MS)[0] == 1
    assert g.acquire(("pa:1w4", 0, None)) == [1]  # the limit is held
    assert g.acquire(("pa:2w5", 0, "a")) == [2]  # heavier than the limit: lane a}100 in big
    assert g.acquire(("pa:3", 0, "a")) == [2]  # behind it (list full: 2 of 2)
    head = r.zrange(g.keys.lanes, 0, 0)[0]
    assert head.endswith("}pa:2w5")
    r.zadd(g.keys.waiters, {head: 1})  # the heavy head expires
    # A lower-band arrival finds the list full: the reap removes pa:2w5; it parks
    assert g.acquire(("pb:4", -1, None)) == [2]
    assert g.call("release", 0, "pa:1w4") == 1
    # pa:3 (priority 0) is served, first (strict bands), then pb:4 (-1) with the units left
    assert sorted(r.zrange(g.keys.holders, 0, -1)) == ["pa:3", "pb:4b101"]
    tokens = {
        w.partition("=")[0]: int(w.partition("=")[2])
        for w in r.lrange(g.keys.wake("pa"), 0, -1) + r.lrange(g.keys.wake("pb"), 0, -1)
    }
    assert tokens["pa:3"] < tokens["pb:4b101"]


def test_a_head_behind_another_lanes_tag_reserves_nothing(r: redis.Redis) -> None:
    """After a grant, a lane's next head gets a tag past the other lane's. The tags are compared
    before the "does not fit: reserve" check, so that head reserves nothing and the other
    lane's head -- first by tag, and fitting -- is served (rules 3 and 4: only the chosen head,
    the smallest tag, reserves)."""
    g = Gate(r, max_queued=10)
    assert g.call("set_target", 4, 1, LONG_MS)[0] == 1
    assert g.acquire(*((f"pa:h{i}", 0, None) for i in range(4))) == [1, 1, 1, 1]
    assert g.acquire(("pa:1", 0, "a"), ("pa:2w3", 0, "a"), ("pb:1", 0, "b")) == [2, 2, 2]
    assert g.call("release", 0, "pa:h0", "pa:h1") == 2
    # a's pa:1 (tie on tags: by tenant name), then b's pb:1 (a's next tag is past b's)
    assert sorted(r.zrange(g.keys.holders, 0, -1)) == ["pa:1", "pa:h2", "pa:h3", "pb:1"]
    assert not any(k.startswith("rsv:") for k in r.hkeys(g.keys.adm))
    assert [m.rsplit("}", 1)[1] for m in r.zrange(g.keys.lanes, 0, -1)] == ["pa:2w3"]
    # and pa:2w3, now first by tag, reserves the unit a release frees
    assert g.call("release", 0, "pa:h2") == 1
    assert r.hget(g.keys.adm, "rsv:100") is not None


def test_units_an_acquire_reaps_go_to_the_waiters_even_when_it_refuses(r: redis.Redis) -> None:
    """An arrival that reaps an expired lease to make room, and is then refused (here: its
    tenant's queue bound), hands the units it freed off before it returns: a waiter that fits
    now does not wait for the next heartbeat or release."""
    g = Gate(r, max_queued=10)
    g.defaults[5] = 1  # max_queued_per_tenant
    assert g.call("set_target", 3, 1, LONG_MS)[0] == 1
    assert g.acquire(("pa:h0", 0, None), ("pa:h1", 0, None)) == [1, 1]
    assert g.acquire(("pw:1w2", 0, "x")) == [2]  # 2 + 2 > 3: tenant x's one waiter
    r.zadd(g.keys.holders, {"pa:h0": 1})  # pa:h0's lease has expired (its pod died)
    # A band above pw:1w2's: not blocked; it does not fit (2 + 3 > 3), so the expired lease is
    # reaped (2 free now), it still does not fit, and tenant x is at its bound: refused.
    assert g.acquire(("pz:2w3", 10, "x")) == [3]
    assert sorted(r.zrange(g.keys.holders, 0, -1)) == ["pa:h1", "pw:1w2"]
    [wake] = r.lrange(g.keys.wake("pw"), 0, -1)
    assert wake.startswith("pw:1w2=")


# -- a lowered ceiling never wedges a lane ------------------------------------------------------
# A head heavier than the ceiling in force (lowered after it parked) is refused as an arrival that
# heavy is (ConfigError: wake '<id>=c<ceiling>', or the heartbeat's too_heavy list when the wake
# is lost) and its lane moves on; left in `big`, it would wait for a limit the ceiling forbids,
# and every waiter of its lane behind it too (a weight-1 call timing out with 0 of 4 units held).
# A head heavier than the limit but within the ceiling still waits.


def publish(g: Gate, **cfg: object) -> list[Any]:
    flat = [x for kv in cfg.items() for x in kv]
    reply = g.call("publish", 1, LONG_MS, "", len(cfg), *flat)
    assert reply[0] == 1
    return reply  # type: ignore[no-any-return]


def member_of(g: Gate, lease_id: str) -> str:
    [m] = [m for m in g.r.zrange(g.keys.lanes, 0, -1) if m.endswith("}" + lease_id)]
    return m


def heartbeat(g: Gate, pod: str, *members: str) -> HeartbeatReply:
    args: list[object] = [pod, 10_000, 0, len(members)]
    for m in members:
        args += [m, LONG_MS]
    args.append(0)
    return HeartbeatReply.decode(g.call("heartbeat", *args))


def wakes(g: Gate, pod: str) -> list[str]:
    return g.r.lrange(g.keys.wake(pod), 0, -1)  # type: ignore[return-value]


def refused_once(g: Gate, lease_id: str) -> None:
    """lease_id was refused (heavier than the ceiling), recorded for the heartbeat, counted."""
    assert lease_id not in {m.rsplit("}", 1)[1] for m in g.r.zrange(g.keys.waiters, 0, -1)}
    assert g.r.zscore(g.keys.evicted, f"{lease_id}=c") is not None
    assert g.r.zscore(g.keys.evicted, lease_id) is None  # not an eviction (Overloaded)
    assert int(g.r.hget(g.keys.stats, "too_heavy") or 0) == 1
    assert g.scheduled() == g.lanes()


def test_a_publish_lowering_the_ceiling_refuses_a_parked_head_too_heavy_for_it(
    r: redis.Redis,
) -> None:
    """floor = ceiling = 8, pb:1w8 parks (reserved) while
    a unit is held, pb:2 parks behind it in the same lane; the publish lowering floor and
    ceiling to 4 refuses pb:1w8 and hands a unit to pb:2 in the same call."""
    g = Gate(r, max_queued=10, floor=8, ceiling=8)
    assert g.acquire(("pa:1", 0, None)) == [1]
    assert g.acquire(("pb:1w8", 0, None), ("pb:2", 0, None)) == [2, 2]
    assert publish(g, floor=4, ceiling=4)[3] == 1  # one grant: pb:2
    assert sorted(r.zrange(g.keys.holders, 0, -1)) == ["pa:1", "pb:2"]
    [refusal, grant] = sorted(wakes(g, "pb"))
    assert refusal == "pb:1w8=c4" and grant.startswith("pb:2=")
    refused_once(g, "pb:1w8")
    assert r.zcard(g.keys.lanes) == 0 and r.zcard(g.keys.big) == 0


def test_a_lane_already_in_big_is_refused_by_the_publish_that_lowers_the_ceiling(
    r: redis.Redis,
) -> None:
    """pb:1w8 waits in big (limit 2 < 8 <= ceiling 8) with pb:2 behind it; a publish lowering
    the ceiling to 4 refuses it from big, and pb:2 is granted."""
    g = Gate(r, max_queued=10, floor=2, ceiling=8)
    assert g.acquire(("pa:1", 0, None)) == [1]
    assert g.acquire(("pb:1w8", 0, None), ("pb:2", 0, None)) == [2, 2]
    assert r.zrange(g.keys.big, 0, -1, withscores=True) == [("}100", 8.0)]
    assert publish(g, ceiling=4)[3] == 1
    assert sorted(r.zrange(g.keys.holders, 0, -1)) == ["pa:1", "pb:2"]
    assert "pb:1w8=c4" in wakes(g, "pb")
    refused_once(g, "pb:1w8")


def test_a_set_target_refuses_a_head_above_a_ceiling_lowered_without_a_settle(
    r: redis.Redis,
) -> None:
    """A ceiling written without a settle (by hand, or a publish that does not settle): the next
    set_target refuses the head of big that weighs more than it."""
    g = Gate(r, max_queued=10, floor=2, ceiling=8)
    assert g.acquire(("pa:1", 0, None)) == [1]
    assert g.acquire(("pb:1w8", 0, "t"), ("pb:2w3", 0, "t")) == [2, 2]
    r.hset(g.keys.cfg, "ceiling", 4)
    assert g.call("set_target", 4, 1, LONG_MS)[:2] == [1, 4]
    assert sorted(r.zrange(g.keys.holders, 0, -1)) == ["pa:1", "pb:2w3"]
    assert "pb:1w8=c4" in wakes(g, "pb")
    refused_once(g, "pb:1w8")


def test_a_heartbeat_refuses_a_head_above_the_ceiling_and_reports_it(r: redis.Redis) -> None:
    """The heartbeat refuses a head of big heavier than the ceiling, reports it to its own pod
    in the same reply (too_heavy, with the ceiling), and the lane's next head is granted."""
    g = Gate(r, max_queued=10, floor=2, ceiling=8)
    assert g.acquire(("pa:1", 0, None)) == [1]
    assert g.acquire(("pb:1w8", 0, None), ("pb:2", 0, None)) == [2, 2]
    heavy, light = member_of(g, "pb:1w8"), member_of(g, "pb:2")
    r.hset(g.keys.cfg, "ceiling", 4)
    reply = heartbeat(g, "pb", heavy, light)
    assert (reply.too_heavy, reply.ceiling) == (["pb:1w8"], 4)
    assert reply.evicted == [] and reply.lost_waiters == []
    assert sorted(r.zrange(g.keys.holders, 0, -1)) == ["pa:1", "pb:2"]
    assert "pb:1w8=c4" in wakes(g, "pb")
    refused_once(g, "pb:1w8")


def test_a_refusal_whose_wake_is_lost_is_reported_by_the_next_heartbeat(r: redis.Redis) -> None:
    """The publish refused pb:1w8 but its wake list is gone (a Redis failover, a pod that popped
    and died): the pod's next heartbeat reports it in too_heavy, not as lost (which would park
    it again) nor as evicted (Overloaded)."""
    g = Gate(r, max_queued=10, floor=8, ceiling=8)
    assert g.acquire(("pa:1", 0, None)) == [1]
    assert g.acquire(("pb:1w8", 0, None)) == [2]
    heavy = member_of(g, "pb:1w8")
    publish(g, floor=4, ceiling=4)
    assert r.delete(g.keys.wake("pb")) == 1
    reply = heartbeat(g, "pb", heavy)
    assert (reply.too_heavy, reply.ceiling) == (["pb:1w8"], 4)
    assert reply.lost_waiters == [] and reply.evicted == [] and reply.granted_waiters == []


def test_a_release_refuses_a_fair_head_the_lowered_ceiling_left_when_the_gate_was_full(
    r: redis.Redis,
) -> None:
    """The gate was full when the ceiling was lowered, so the publish's hand-off never met the
    heavy head (still first in the fair order); the release that frees a unit refuses it and
    grants the next head."""
    g = Gate(r, max_queued=10, floor=8, ceiling=8)
    held = [f"pa:{i}" for i in range(8)]
    assert g.acquire(*((h, 0, None) for h in held)) == [1] * 8
    assert g.acquire(("pb:1w8", 0, None), ("pb:2", 0, None)) == [2, 2]
    assert publish(g, floor=4, ceiling=4)[3] == 0
    assert r.zcard(g.keys.evicted) == 0  # not met yet (the limit is held)
    assert g.call("release", 0, *held[:5]) == 5
    assert sorted(r.zrange(g.keys.holders, 0, -1)) == [*held[5:], "pb:2"]
    assert "pb:1w8=c4" in wakes(g, "pb")
    refused_once(g, "pb:1w8")
    assert int(r.hget(g.keys.stats, "abandoned_waiters") or 0) == 0


def test_a_head_above_the_limit_within_the_ceiling_keeps_waiting(r: redis.Redis) -> None:
    """A head heavier than the limit but not than the ceiling waits in big
    through publishes, heartbeats and set_targets below it, and is granted once the limit
    reaches its weight."""
    g = Gate(r, max_queued=10, floor=2, ceiling=8)
    assert g.acquire(("pb:1w6", 0, None)) == [2]
    heavy = member_of(g, "pb:1w6")
    publish(g, ceiling=6)  # lowered to its weight exactly: still grantable
    reply = heartbeat(g, "pb", heavy)
    assert reply.too_heavy == [] and reply.ceiling == 6
    assert g.call("set_target", 5, 1, LONG_MS)[:2] == [1, 5]
    assert r.zrange(g.keys.big, 0, -1, withscores=True) == [("}100", 6.0)]
    assert r.zcard(g.keys.evicted) == 0 and r.hget(g.keys.stats, "too_heavy") is None
    assert g.call("set_target", 6, 1, LONG_MS)[:2] == [1, 6]
    assert r.zrange(g.keys.holders, 0, -1) == ["pb:1w6"]
