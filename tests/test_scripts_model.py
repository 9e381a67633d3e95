"""Property-based test: random sequences of transitions against the real scripts.

A plain-Python model of the semantics (DESIGN.md) predicts the exact holders, the exact FIFO
queue and every counter after each step; the real scripts on a real redis-server must agree, and
the invariants (cap, FIFO, no idle slot while someone waits, no lost waiter) must hold.
"""

from __future__ import annotations

import itertools
import uuid

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

    def reap(self) -> None:
        for hid in [h for h, exp in self.holders.items() if exp]:
            del self.holders[hid]
            self.stats["expired_leases"] += 1
        for wid in [w for w in self.queue if w in self.expired_waiters]:
            self.queue.remove(wid)
            self.stats["abandoned_waiters"] += 1
        self.expired_waiters.clear()

    def handoff(self) -> None:
        while self.queue and len(self.holders) < self.limit():
            wid = self.queue.pop(0)
            self.holders[wid] = False
            self.stats["granted"] += 1
            self.woken.append(wid)

    def settle(self) -> None:
        self.reap()
        self.handoff()


class GateMachine(RuleBasedStateMachine):
    def __init__(self, url: str) -> None:
        super().__init__()
        self.r = redis.Redis.from_url(url, decode_responses=True)
        self.keys = GateKeys.of(f"h{uuid.uuid4().hex[:8]}", "model")
        self.scripts = {n: self.r.register_script(script_source(n)) for n in SCRIPT_NAMES}
        self.m = GateModel()
        self.ids = itertools.count(1)
        self.epoch = 0

    def call(self, name: str, *args: object) -> list[object]:
        return self.scripts[name](keys=self.keys.script_keys(), args=list(args))  # type: ignore[no-any-return]

    @rule(pod=st.sampled_from(PODS))
    def acquire(self, pod: str) -> None:
        lid = f"{pod}:{next(self.ids)}"
        status = self.call("acquire", lid, LONG_MS, FLOOR, CEILING, MAX_QUEUED, LONG_MS, LONG_MS)[0]
        m = self.m
        m.settle()
        if not m.queue and len(m.holders) < m.limit():
            m.holders[lid] = False
            m.stats["granted"] += 1
            expected = 1
        elif len(m.queue) >= MAX_QUEUED:
            m.stats["rejected"] += 1
            expected = 0
        else:
            m.queue.append(lid)
            expected = 2
        assert status == expected

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        choices = [*self.m.holders, "nobody:0"]
        lid = data.draw(st.sampled_from(choices))
        released = self.call("release", lid)[0]
        expected = 1 if lid in self.m.holders else 0
        if expected:
            del self.m.holders[lid]
            self.m.stats["released"] += 1
        self.m.settle()
        assert released == expected

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
