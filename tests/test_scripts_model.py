"""Property-based test: random sequences of transitions against the real scripts.

A plain-Python model of the semantics (DESIGN.md) predicts the exact holders, the exact FIFO
queue and every counter after each step; the real scripts on a real redis-server must agree, and
the invariants (cap, FIFO, no idle slot while someone waits, no lost waiter) must hold.
"""

from __future__ import annotations

import itertools
import uuid
from typing import Any

import redis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from fleetgate.keys import GateKeys
from fleetgate.scripts import SCRIPT_NAMES, script_source

from .conftest import RedisUnderTest

FLOOR, CEILING, MAX_QUEUED = 1, 4, 5
PODS = ("pa", "pb", "pc")
LONG_MS = 600_000  # nothing expires by itself during a run; expiry is a rule


class GateModel:
    def __init__(self) -> None:
        self.holders: dict[str, bool] = {}  # id -> expired
        self.queue: list[str] = []
        self.expired_waiters: set[str] = set()
        self.target: tuple[int, int, bool] | None = None  # value, epoch, expired
        self.stats = dict.fromkeys(
            ("granted", "rejected", "released", "cancelled", "expired_leases", "abandoned_waiters"),
            0,
        )
        self.woken: list[str] = []

    def limit(self) -> int:
        lim = FLOOR
        if self.target is not None and not self.target[2]:
            lim = self.target[0]
        return max(FLOOR, min(CEILING, lim))

    def reap_leases(self) -> None:
        for hid in [h for h, exp in self.holders.items() if exp]:
            del self.holders[hid]
            self.stats["expired_leases"] += 1

    def reap_waiters(self) -> None:
        for wid in [w for w in self.queue if w in self.expired_waiters]:
            self.queue.remove(wid)
            self.stats["abandoned_waiters"] += 1
        self.expired_waiters.clear()

    def handoff(self) -> None:
        """Free slots to the live heads in order; a dead head met on the way is dropped."""
        while self.queue and len(self.holders) < self.limit():
            wid = self.queue.pop(0)
            if wid in self.expired_waiters:
                self.expired_waiters.discard(wid)
                self.stats["abandoned_waiters"] += 1
                continue
            self.holders[wid] = False
            self.stats["granted"] += 1
            self.woken.append(wid)

    def settle(self) -> None:
        self.reap_leases()
        self.reap_waiters()
        self.handoff()

    def acquire(self, ids: list[str], releases: list[str]) -> tuple[int, list[int]]:
        """acquire.lua for a batch: the releases, then lazy reaping (leases when full, waiters
        when the list is full), room while others wait goes to them first, then each id in
        order."""
        released = 0
        for lid in set(releases):
            if self.holders.pop(lid, None) is not None:
                released += 1
        self.stats["released"] += released
        if len(self.holders) >= self.limit():
            self.reap_leases()
        if self.queue and len(self.holders) < self.limit():
            self.handoff()
        out, waiters_reaped = [], False
        for lid in ids:
            if not self.queue and len(self.holders) < self.limit():
                self.holders[lid] = False
                self.stats["granted"] += 1
                out.append(1)
                continue
            if len(self.queue) >= MAX_QUEUED and not waiters_reaped:
                waiters_reaped = True
                self.reap_waiters()
            if len(self.queue) >= MAX_QUEUED:
                self.stats["rejected"] += 1
                out.append(0)
            else:
                self.queue.append(lid)
                out.append(2)
        return released, out

    def release(self, ids: list[str]) -> int:
        """release.lua for a batch: no reaping; hand-off only when someone waits."""
        n = 0
        for lid in set(ids):
            if self.holders.pop(lid, None) is not None:
                n += 1
        self.stats["released"] += n
        if self.queue:
            self.handoff()
        return n


class GateMachine(RuleBasedStateMachine):
    def __init__(self, url: str) -> None:
        super().__init__()
        self.r = redis.Redis.from_url(url, decode_responses=True)
        self.keys = GateKeys.of(f"h{uuid.uuid4().hex[:8]}", "model")
        self.scripts = {n: self.r.register_script(script_source(n)) for n in SCRIPT_NAMES}
        self.m = GateModel()
        self.ids = itertools.count(1)
        self.epoch = 0

    def call(self, name: str, *args: object) -> Any:
        return self.scripts[name](keys=self.keys.script_keys(), args=list(args))

    @rule(pods=st.lists(st.sampled_from(PODS), min_size=1, max_size=3), data=st.data())
    def acquire(self, pods: list[str], data: st.DataObject) -> None:
        """A batch: some leases released (maybe none, maybe unknown ids), then new requests."""
        choices = [*self.m.holders, "nobody:0"]
        releases = data.draw(st.lists(st.sampled_from(choices), max_size=2))
        ids = [f"{pod}:{next(self.ids)}" for pod in pods]
        pairs = [a for i in ids for a in (i, LONG_MS)]
        args = (FLOOR, CEILING, MAX_QUEUED, LONG_MS, LONG_MS, len(releases), *releases, *pairs)
        reply = self.call("acquire", *args)
        statuses = [int(x) for x in reply[4::4]]
        assert (int(reply[3]), statuses) == self.m.acquire(ids, releases)

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        choices = [*self.m.holders, "nobody:0"]
        ids = data.draw(st.lists(st.sampled_from(choices), min_size=1, max_size=3))
        released = self.call("release", *ids)
        assert released == self.m.release(ids)

    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        choices = [*self.m.queue, *self.m.holders, "nobody:0"]
        lid = data.draw(st.sampled_from(choices))
        outcome = self.call("cancel", lid)[0]
        m = self.m
        if lid in m.queue:
            m.queue.remove(lid)
            m.expired_waiters.discard(lid)
            m.stats["cancelled"] += 1
            expected = 1
        elif lid in m.holders:
            del m.holders[lid]
            m.stats["released"] += 1
            expected = 2
        else:
            expected = 0
        m.settle()
        assert outcome == expected

    @rule(data=st.data())
    def expire_holder(self, data: st.DataObject) -> None:
        live = [h for h, exp in self.m.holders.items() if not exp]
        if live:
            lid = data.draw(st.sampled_from(live))
            self.r.zadd(self.keys.holders, {lid: 1})
            self.m.holders[lid] = True

    @rule(data=st.data())
    def expire_waiter(self, data: st.DataObject) -> None:
        if self.m.queue:
            wid = data.draw(st.sampled_from(self.m.queue))
            self.r.zadd(self.keys.waiters, {wid: 1})
            self.m.expired_waiters.add(wid)

    @rule(value=st.integers(0, 10), step=st.integers(-1, 1))
    def set_target(self, value: int, step: int) -> None:
        epoch = self.epoch + step
        accepted = self.call("set_target", value, epoch, LONG_MS)[0]
        stored = self.m.target[1] if self.m.target else None
        if stored is not None and epoch < stored:
            assert accepted == 0
            return
        assert accepted == 1
        self.epoch = max(self.epoch, epoch)
        self.m.target = (value, epoch, False)
        self.m.settle()

    @rule()
    def expire_target(self) -> None:
        if self.m.target is not None:
            self.r.hset(self.keys.target, "expires_at", 1)
            self.m.target = (self.m.target[0], self.m.target[1], True)

    @rule()
    def sweep(self) -> None:
        self.call("heartbeat", "", 1000, 0, 0)
        self.m.settle()

    @invariant()
    def redis_agrees_with_model(self) -> None:
        m = self.m
        assert set(self.r.zrange(self.keys.holders, 0, -1)) == set(m.holders)
        assert self.r.zrange(self.keys.queue, 0, -1) == m.queue  # exact FIFO order
        assert set(self.r.zrange(self.keys.waiters, 0, -1)) == set(m.queue)  # no lost waiter
        stats = self.r.hgetall(self.keys.stats)
        for k, v in m.stats.items():
            assert int(stats.get(k, 0)) == v, k
        woken = [w for p in PODS for w in self.r.lrange(self.keys.wake(p), 0, -1)]
        assert sorted(woken) == sorted(m.woken)

    @invariant()
    def no_idle_slot_while_someone_waits(self) -> None:
        live = [h for h, exp in self.m.holders.items() if not exp]
        if self.m.queue and not self.m.expired_waiters:
            assert len(self.m.holders) >= self.m.limit() or len(live) < len(self.m.holders)

    def teardown(self) -> None:
        self.r.close()


def test_random_transitions_match_the_model(rut: RedisUnderTest) -> None:
    run_state_machine_as_test(
        lambda: GateMachine(rut.url),
        settings=settings(
            max_examples=100,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
