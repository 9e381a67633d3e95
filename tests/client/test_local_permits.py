"""LocalPermits: the fallback's local bound over units, by priority, with no passing.

Pure asyncio, no Redis, except the last test (the gate's fallback path on a server we kill).
"""

from __future__ import annotations

import asyncio
import random

import pytest
from prometheus_client import CollectorRegistry

from fleetgate.ask import Ask
from fleetgate.client import Fleet
from fleetgate.client._local import LocalPermits, _Waiter
from fleetgate.errors import Overloaded
from fleetgate.tools.redisproc import RedisProcess


async def settle() -> None:
    """Let every ready callback and task run."""
    for _ in range(5):
        await asyncio.sleep(0)


class Budget:
    """A budget the test can change."""

    def __init__(self, units: int) -> None:
        self.units = units

    def __call__(self) -> int:
        return self.units


def start(
    permits: LocalPermits, weight: int, priority: int, log: list[str], name: str
) -> asyncio.Task[bool]:
    """A task that acquires and then appends ``name`` to ``log``."""

    async def run() -> bool:
        ok = await permits.acquire(weight, priority)
        log.append(name)
        return ok

    return asyncio.create_task(run(), name=name)


async def test_too_heavy_is_overloaded_at_once() -> None:
    permits = LocalPermits(Budget(4), gate="g")
    with pytest.raises(Overloaded, match=r"gate 'g' is overloaded: a weight of 5 units exceeds"):
        await permits.acquire(5)
    assert permits.held == 0 and permits.waiting == 0
    # Also while others wait, and with nothing to wait for.
    assert await permits.acquire(4)
    blocked = asyncio.create_task(permits.acquire(1))
    await settle()
    with pytest.raises(Overloaded):
        await permits.acquire(5, priority=100)
    assert permits.waiting == 1
    permits.release(4)
    assert await blocked
    permits.release(1)
    assert permits.held == 0


async def test_bad_weight() -> None:
    permits = LocalPermits(Budget(4))
    with pytest.raises(ValueError, match="weight"):
        await permits.acquire(0)
    with pytest.raises(ValueError, match="release"):
        permits.release(1)


async def test_strict_priority_fifo_within_priority() -> None:
    permits = LocalPermits(Budget(1))
    assert await permits.acquire(1)
    log: list[str] = []
    tasks = [
        start(permits, 1, 0, log, "low-a"),
        start(permits, 1, 5, log, "high-a"),
        start(permits, 1, 1, log, "mid"),
        start(permits, 1, 5, log, "high-b"),
        start(permits, 1, 0, log, "low-b"),
    ]
    await settle()
    assert log == [] and permits.waiting == 5
    for expected in ["high-a", "high-b", "mid", "low-a", "low-b"]:
        permits.release(1)
        await settle()
        assert log[-1] == expected and permits.held == 1
    permits.release(1)
    assert all(t.result() for t in tasks) and permits.held == 0


async def test_heavy_head_not_starved_by_light_arrivals() -> None:
    permits = LocalPermits(Budget(4))
    for _ in range(3):
        assert await permits.acquire(1)
    log: list[str] = []
    heavy = start(permits, 4, 0, log, "heavy")
    await settle()
    lights = [start(permits, 1, 0, log, f"light{i}") for i in range(5)]
    await settle()
    # One unit is free, but it is kept for the head: no light call passes it.
    assert log == [] and permits.held == 3
    for _ in range(3):
        permits.release(1)
        await settle()
    assert log == ["heavy"] and permits.held == 4
    permits.release(4)
    await settle()
    assert log[1:] == [f"light{i}" for i in range(4)] and permits.held == 4
    for _ in range(4):
        permits.release(1)
    await settle()
    assert log[-1] == "light4"
    permits.release(1)
    assert heavy.result() and all(t.result() for t in lights) and permits.held == 0


async def test_higher_priority_arrival_goes_ahead_of_blocked_head() -> None:
    permits = LocalPermits(Budget(4))
    assert await permits.acquire(3)
    log: list[str] = []
    heavy = start(permits, 4, 0, log, "heavy")
    same = start(permits, 1, 0, log, "same-priority")
    await settle()
    # A higher band precedes the head's reservation: granted at once since it fits.
    assert await permits.acquire(1, priority=1)
    assert permits.held == 4 and log == []
    permits.release(1)
    permits.release(3)
    await settle()
    assert log == ["heavy"]
    permits.release(4)
    await settle()
    assert log == ["heavy", "same-priority"]
    permits.release(1)
    assert heavy.result() and same.result()


async def test_budget_shrinks_and_grows() -> None:
    budget = Budget(4)
    permits = LocalPermits(budget)
    assert await permits.acquire(4)
    log: list[str] = []
    three = start(permits, 3, 0, log, "three")
    one = start(permits, 1, 0, log, "one")
    await settle()
    budget.units = 2  # the head can never fit now: Overloaded; the one behind it waits
    permits.release(4)
    await settle()
    with pytest.raises(Overloaded, match="weight of 3 units"):
        three.result()
    assert log == ["one"] and one.result() and permits.held == 1
    assert await permits.acquire(1)
    blocked = start(permits, 1, 0, log, "blocked")
    await settle()
    assert permits.held == 2 and not blocked.done()
    budget.units = 1  # shrinking never revokes; it only stops grants
    permits.release(1)
    await settle()
    assert not blocked.done() and permits.held == 1
    budget.units = 3
    permits.notify()  # growth is looked at on notify
    await settle()
    assert blocked.result() and permits.held == 2
    permits.release(1)
    permits.release(1)
    assert permits.held == 0


async def test_in_use_counts_against_budget() -> None:
    outside = Budget(3)
    permits = LocalPermits(Budget(4), in_use=outside)
    assert await permits.acquire(1)
    task = asyncio.create_task(permits.acquire(1))
    await settle()
    assert not task.done()
    outside.units = 2
    permits.notify()
    await settle()
    assert task.result() and permits.held == 2


async def test_allowed_gates_grants() -> None:
    allowed = True
    permits = LocalPermits(Budget(2), allowed=lambda: allowed)
    allowed = False
    task = asyncio.create_task(permits.acquire(1))
    await settle()
    assert not task.done() and permits.held == 0
    allowed = True
    permits.notify()
    await settle()
    assert task.result() and permits.held == 1


async def test_inactive_returns_false_for_everyone() -> None:
    active = True
    permits = LocalPermits(Budget(2), active=lambda: active)
    assert await permits.acquire(2)
    tasks = [asyncio.create_task(permits.acquire(1, p)) for p in (0, 3, -2, 0)]
    await settle()
    active = False
    permits.notify()
    await settle()
    assert [t.result() for t in tasks] == [False] * 4
    assert permits.waiting == 0
    assert await permits.acquire(1) is False  # at once, without waiting
    permits.release(2)
    assert permits.held == 0


async def test_cancelled_waiter_holds_nothing_and_unblocks_others() -> None:
    permits = LocalPermits(Budget(4))
    assert await permits.acquire(2)
    log: list[str] = []
    heavy = start(permits, 4, 0, log, "heavy")
    light = start(permits, 2, 0, log, "light")
    await settle()
    assert log == []
    heavy.cancel()  # the blocking head leaves: the light one fits now
    await settle()
    assert heavy.cancelled() and light.result() and log == ["light"] and permits.held == 4
    permits.release(2)
    permits.release(2)
    assert permits.held == 0 and permits.waiting == 0


async def test_grant_racing_cancellation_is_given_back() -> None:
    permits = LocalPermits(Budget(2))
    assert await permits.acquire(2)
    first = asyncio.create_task(permits.acquire(2))
    second = asyncio.create_task(permits.acquire(1))
    await settle()
    permits.release(2)  # grants `first` (its task has not run yet) ...
    assert permits.held == 2
    first.cancel()  # ... and cancels it before it sees the grant
    await settle()
    assert first.cancelled()
    assert second.result() and permits.held == 1  # the units went to the next waiter
    permits.release(1)
    assert permits.held == 0


async def test_timeout_while_waiting() -> None:
    permits = LocalPermits(Budget(1))
    assert await permits.acquire(1)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await permits.acquire(1)
    assert permits.waiting == 0
    permits.release(1)
    assert permits.held == 0


async def test_many_cancellations_behind_blocked_head_are_compacted() -> None:
    permits = LocalPermits(Budget(1))
    assert await permits.acquire(1)
    tasks = [asyncio.create_task(permits.acquire(1)) for _ in range(500)]
    await settle()
    for task in tasks[:-1]:
        task.cancel()
    await settle()
    assert permits.waiting == 1 and len(permits._heap) < 200
    permits.release(1)
    await settle()
    assert tasks[-1].result() and permits.held == 1


class CheckedPermits(LocalPermits):
    """Checks the bound after every dispatch that granted: held ≤ budget at that instant."""

    violations: list[str]
    given_back = 0  # grants that raced their caller's cancellation

    def _dispatch(self) -> None:
        before = self.held
        super()._dispatch()
        if self.held > before and self.held > self._budget():
            self.violations.append(f"held {self.held} > budget {self._budget()}")

    def _abandon(self, waiter: _Waiter) -> None:
        future = waiter.future
        if future.done() and not future.cancelled() and future.result() is True:
            self.given_back += 1
        super()._abandon(waiter)


@pytest.mark.parametrize("seed", range(5))
async def test_random_weights_priorities_and_cancels_never_exceed_budget(seed: int) -> None:
    rnd = random.Random(seed)
    budget = Budget(8)
    permits = CheckedPermits(budget)
    permits.violations = []
    running = peak = granted = overloaded = 0

    async def call(weight: int, priority: int) -> None:
        nonlocal running, peak, granted, overloaded
        try:
            ok = await permits.acquire(weight, priority)
        except Overloaded:
            overloaded += 1
            return
        assert ok
        try:
            running += weight
            peak = max(peak, running)
            assert running <= permits.held
            granted += 1
            await asyncio.sleep(rnd.random() * 0.003)
        finally:
            running -= weight
            permits.release(weight)

    async def chaos(tasks: list[asyncio.Task[None]]) -> None:
        for _ in range(60):
            await asyncio.sleep(rnd.random() * 0.002)
            rnd.choice(tasks).cancel()
            if rnd.random() < 0.2:
                budget.units = rnd.choice([6, 8, 10])
                permits.notify()

    tasks = [asyncio.create_task(call(rnd.randint(1, 9), rnd.randint(-2, 2))) for _ in range(400)]
    outcomes = await asyncio.gather(chaos(tasks), *tasks, return_exceptions=True)
    assert not [o for o in outcomes if isinstance(o, Exception)]  # cancels are BaseException
    assert not permits.violations
    assert peak <= 10 and granted > 100 and overloaded > 0
    assert permits.held == 0 and permits.waiting == 0 and running == 0


async def test_tokens_bound_grants_and_resizes_with_no_passing() -> None:
    permits = LocalPermits(Budget(8), token_budget=lambda: 100, tokens_in_use=lambda: 10)
    with pytest.raises(Overloaded, match="101 tokens exceed the local fair-share bound of 100"):
        await permits.acquire(1, tokens=101)
    assert await permits.acquire(1, tokens=60)  # 10 in use outside + 60
    log: list[str] = []
    big = start_tokens(permits, 40, log, "big")  # 110 > 100: waits, units are free
    small = start_tokens(permits, 5, log, "small")  # would fit, but may not pass the head
    await settle()
    assert log == [] and permits.waiting == 2
    assert not permits.resize(60, 61)  # someone waits: no growth
    assert permits.resize(60, 40)  # a shrink frees 20: the head fits now, then the next
    await settle()
    assert log == ["big", "small"] and permits.tokens == 85
    assert not permits.resize(40, 46)  # 10 + 85 + 6 > 100
    assert permits.resize(40, 45) and permits.tokens == 90
    permits.release(1, 45)
    permits.release(1, 40)
    permits.release(1, 5)
    assert (permits.held, permits.tokens) == (0, 0)
    assert await big and await small


def start_tokens(
    permits: LocalPermits, tokens: int, log: list[str], name: str
) -> asyncio.Task[bool]:
    """A task that acquires ``tokens`` (1 unit, priority 0) and then logs ``name``."""

    async def run() -> bool:
        ok = await permits.acquire(1, 0, tokens)
        log.append(name)
        return ok

    return asyncio.create_task(run(), name=name)


async def test_random_cancel_right_after_grant() -> None:
    """Right after each release some waiters are granted but their tasks have not run yet;
    cancelling a random waiter then often hits such a grant: nothing may leak."""
    rnd = random.Random(42)
    permits = CheckedPermits(Budget(5))
    permits.violations = []
    weights: dict[asyncio.Task[bool], int] = {}
    order: dict[asyncio.Task[bool], tuple[int, int]] = {}  # the heap's order: the next heads
    for i in range(300):
        weight, priority = rnd.randint(1, 5), rnd.randint(0, 3)
        task = asyncio.create_task(permits.acquire(weight, priority))
        weights[task], order[task] = weight, (-priority, i)
    pending = set(weights)
    held: list[asyncio.Task[bool]] = []
    while pending or held:
        await settle()
        for task in [t for t in pending if t.done()]:
            pending.discard(task)
            if not task.cancelled():
                assert task.result()
                held.append(task)
        if held:
            task = held.pop(rnd.randrange(len(held)))
            permits.release(weights[task])  # grants the next heads; their tasks have not run
        heads = sorted((t for t in pending if not t.done()), key=order.__getitem__)[:3]
        if heads and rnd.random() < 0.5:
            rnd.choice(heads).cancel()
    assert not permits.violations
    # The race was hit often, and the held units and waiters below show nothing leaked.
    assert permits.given_back > 10
    assert permits.held == 0 and permits.waiting == 0


async def test_gate_fallback_counts_units(own_redis: RedisProcess) -> None:
    async with Fleet(
        own_redis.url, prefix="fg", registry=CollectorRegistry(), heartbeat_interval=0.2
    ) as fleet:
        gate = fleet.gate("units", floor=4)
        async with gate.permit():
            pass
        end = asyncio.get_running_loop().time() + 3
        while gate.last_live_pods != 1:
            assert asyncio.get_running_loop().time() < end
            await asyncio.sleep(0.02)
        own_redis.kill()
        async with gate.permit(deadline=10) as first:  # enters the fallback
            assert first.local and fleet.fallback_active
        assert gate.fair_share() == 4
        with pytest.raises(Overloaded, match="local fair-share bound of 4 units"):
            await gate._acquire_local(Ask(weight=5))
        heavy = await gate._acquire_local(Ask(weight=3))
        assert heavy is not None and heavy.weight == 3 and heavy.id.endswith("w3")
        assert gate._local.held == 3
        light = await gate._acquire_local(Ask(weight=1))
        assert light is not None and light.weight == 1 and not light.id.endswith("w1")
        blocked = asyncio.create_task(gate._acquire_local(Ask(weight=2, priority=1)))
        await settle()
        assert not blocked.done()
        await heavy.release()
        lease = await blocked
        assert lease is not None and gate._local.held == 3
        await lease.release()
        await light.release()
        assert gate._local.held == 0 and not gate.local_leases
