"""Cancellation in one process, against a real redis-server: a caller cancelled while parked
consumes no permit; one cancelled inside its permit, or while its release is on the way, gives
the permit back; a cancellation racing a grant releases what the grant gave.

``lease.release()`` hands the release to the gate's batcher (it leaves with the gate's next
script call). A cancellation of the caller at any point -- before the batch leaves, while a batch
before it is in flight, while its own is in flight -- must not keep the slot.

Beside this file: the acquire script's round trip swept by cancellations
(``test_cancellation_round_trip.py``), callers on other threads and loops
(``test_cancellation_sync.py``); across processes under load: ``tests/chaos/test_cancel_ends.py``
and ``tests/chaos/test_cancellations.py``.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aredis

from fleetgate.client import Fleet


@pytest.mark.parametrize("iterations", range(1, 9))
async def test_cancelled_release_still_frees_the_slot(
    iterations: int, fleet: Fleet, async_redis: aredis.Redis
) -> None:
    gate = fleet.gate(f"release-cancel-{iterations}", floor=4, lease_ms=60_000)
    leases = [await gate.acquire(deadline=5.0) for _ in range(4)]
    # Two releases at once: the second waits in the batcher while the first is in flight.
    releasing = [asyncio.create_task(lease.release()) for lease in leases[:2]]
    for _ in range(iterations):  # 1: both started, neither sent yet
        await asyncio.sleep(0)
    for t in releasing:
        t.cancel()
    await asyncio.gather(*releasing, return_exceptions=True)
    await fleet.flush()
    holders = await async_redis.zrange(gate.keys.holders, 0, -1)
    assert sorted(holders) == sorted(lease.id for lease in leases[2:])
    assert set(gate.leases) == {lease.id for lease in leases[2:]}
    for lease in leases[2:]:
        await lease.release()
    await fleet.flush()
    assert await async_redis.zcard(gate.keys.holders) == 0


async def test_release_of_a_cancelled_permit_block(fleet: Fleet, async_redis: aredis.Redis) -> None:
    gate = fleet.gate("release-cancel-block", floor=1, lease_ms=60_000)
    entered = asyncio.Event()

    async def hold() -> None:
        async with gate.permit(deadline=5.0):
            entered.set()
            await asyncio.Event().wait()

    t = asyncio.create_task(hold())
    await entered.wait()
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t
    await fleet.flush()
    assert await async_redis.zcard(gate.keys.holders) == 0
    async with gate.permit(deadline=1.0):
        pass


async def test_cancel_while_parked_consumes_no_permit(
    fleet: Fleet, async_redis: aredis.Redis
) -> None:
    gate = fleet.gate("c", floor=1)
    held = await gate.acquire()
    task = asyncio.create_task(gate.acquire(deadline=10))
    await asyncio.sleep(0.1)
    assert await async_redis.zcard(gate.keys.waiters) == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await fleet.runtime.drain(timeout=5.0)  # the cancel leaves in the background (0.25 s wait)
    assert await async_redis.zcard(gate.keys.waiters) == 0
    await held.release()
    await fleet.flush()
    assert await async_redis.zcard(gate.keys.holders) == 0


async def test_cancelling_running_work_releases(fleet: Fleet, async_redis: aredis.Redis) -> None:
    gate = fleet.gate("run-cancel", floor=1)
    inside = asyncio.Event()

    async def work() -> None:
        async with gate.permit(deadline=None):
            inside.set()
            await asyncio.sleep(30)

    task = asyncio.create_task(work())
    await inside.wait()
    assert await async_redis.zcard(gate.keys.holders) == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await fleet.flush()
    assert await async_redis.zcard(gate.keys.holders) == 0


async def until(predicate, timeout: float = 5.0) -> float:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    while not await predicate():
        if time.monotonic() - start > timeout:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.005)
    return time.monotonic() - start


async def _eq(awaitable, value) -> bool:  # type: ignore[no-untyped-def]
    return bool(await awaitable == value)


async def test_cancel_racing_a_grant_releases_it(fleet: Fleet, async_redis: aredis.Redis) -> None:
    gate = fleet.gate("race", floor=1)
    for _ in range(20):
        held = await gate.acquire()
        task = asyncio.create_task(gate.acquire(deadline=10))
        await until(lambda: _eq(async_redis.zcard(gate.keys.waiters), 1))
        release = asyncio.create_task(held.release())
        await asyncio.sleep(0)
        task.cancel()
        await release
        try:
            lease = await task
        except asyncio.CancelledError:
            pass
        else:  # the grant won the race: we hold it legitimately
            await lease.release()
        await until(lambda: _eq(async_redis.zcard(gate.keys.holders), 0), 3)
        assert await async_redis.zcard(gate.keys.waiters) == 0
