"""Minimal reproductions of admission-order bugs found by tests/test_scripts_model.py.

Each test drives the real scripts on a real redis-server and states the rule that breaks.
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
        reply = self.call("acquire", *self.defaults, 0, *triples)
        return [int(x) for x in reply[4::4]]

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
    """acquire.lua: when the wait list is full, the request loop reaps expired waiters and resets
    the lane_len cache. A lane this call parked into *before* the reap is then counted again at
    the end, after the ZADD of this call's parks, so it counts its own new waiter (1, not 0) and
    never enters fair or big: its waiters are never handed a permit (only a later removal from
    the lane, via lanes_touched, puts it in big)."""
    g = Gate(r, max_queued=2)
    assert g.acquire(("pa:1", 0, None)) == [1]  # holds the only unit
    assert g.acquire(("pa:2", 0, None)) == [2]  # parks in the default lane
    r.zadd(g.keys.waiters, {r.zrange(g.keys.lanes, 0, -1)[0]: 1})  # ... and expires
    # One batch: 'a' parks (list 2/2), 'b' finds the list full, reaps pa:2, parks.
    assert g.acquire(("pa:3", 0, "a"), ("pa:4", 0, "b")) == [2, 2]
    assert g.lanes() == {"a}100", "b}100"}
    assert g.scheduled() == g.lanes(), "every non-empty lane must be in fair or big"
    # The consequence: with the unit free and nobody else waiting, 'a' is never granted.
    assert g.call("release", "pa:1") == 1
    assert g.call("release", "pa:4") == 1
    assert r.zscore(g.keys.holders, "pa:3") is not None, "pa:3 waits while the gate is idle"
