"""Regression tests for admission-order bugs found by tests/test_scripts_model.py.

Each test drives the real scripts on a real redis-server through the steps that broke a rule
before the fix, and checks the rule holds (each failed on the first schema-2 scripts).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from fleetgate.admission import lane_class
from fleetgate.keys import GateKeys
from fleetgate.scripts import SCRIPT_NAMES, script_source

from .conftest import RedisUnderTest

LONG_MS = 600_000


class Gate:
    def __init__(self, r: redis.Redis, max_queued: int, floor: int = 1, ceiling: int = 6) -> None:
        self.r = r
        self.keys = GateKeys.of(f"b{uuid.uuid4().hex[:8]}", "bugs")
        self.scripts = {n: r.register_script(script_source(n)) for n in SCRIPT_NAMES}
        self.defaults = [floor, ceiling, max_queued, LONG_MS, LONG_MS, max_queued, 0, ""]

    def call(self, name: str, *args: object) -> Any:
        return self.scripts[name](keys=self.keys.script_keys(), args=list(args))

    def acquire(self, *reqs: tuple[str, int, str | None]) -> list[int]:
        """reqs: (id, priority, tenant); returns the statuses."""
        triples = [x for i, p, t in reqs for x in (i, LONG_MS, lane_class(p, t))]
        reply = self.call("acquire", *self.defaults, 0, "", 0, 0, *triples)
        return [int(x) for x in reply[5::4]]

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


@pytest.fixture
def r(rut: RedisUnderTest) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(rut.url, decode_responses=True)
    yield client
    client.close()


def test_a_lane_parked_into_before_a_waiter_reap_in_the_same_acquire_is_scheduled(
    r: redis.Redis,
) -> None:
    """Was: when the wait list is full, the request loop reaps expired waiters and resets the
    lane_len cache; a lane this call parked into *before* the reap was counted again after the
    ZADD of this call's parks (1, not 0) and never entered fair or big: its waiters were never
    handed a permit. Now lanes are counted before the parks go in."""
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
    """Was: within one batch a request that does not fit parks (only handoff reserves), and a
    later request of the same band parks behind it although its lane gets the smaller tag: the
    first lane of fair then had a head that fit the free unit, and the unit idled until some
    later call handed off. Now an acquire that parked hands off before it returns."""
    g = Gate(r, max_queued=5)
    g.defaults[7] = "a}2"  # tenant a weighs 2: its tags grow half as fast
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
    """Was: a lane whose head weighs more than the limit is in big; when that head expired and
    acquire's waiter reap removed it (wait list full), the lane stayed in big although its new
    head fit (only set_target, publish, cancel and heartbeat readmitted): a later, lower-band
    request was granted before it. Now acquire readmits after a reap."""
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
    assert sorted(r.zrange(g.keys.holders, 0, -1)) == ["pa:3", "pb:4"]
    tokens = {
        w.partition("=")[0]: int(w.partition("=")[2])
        for w in r.lrange(g.keys.wake("pa"), 0, -1) + r.lrange(g.keys.wake("pb"), 0, -1)
    }
    assert tokens["pa:3"] < tokens["pb:4"]


def test_a_head_behind_another_lanes_tag_reserves_nothing(r: redis.Redis) -> None:
    """Was (found by review): after a grant, a lane's next head got a tag past the other
    lane's, but the "does not fit: reserve" check came before the tag check, so that head
    reserved the free unit and the other lane's head -- first by tag, and fitting -- waited
    behind it (rules 3 and 4: only the chosen head, the smallest tag, reserves). Now the tags
    are compared first."""
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
    """Was (found by review): an arrival that reaped an expired lease to make room, and was then
    refused (here: its tenant's queue bound), returned without a hand-off, so the units it freed
    idled while a waiter that now fit waited for the next heartbeat or release."""
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
