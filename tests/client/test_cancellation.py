"""A release whose caller is cancelled still gives the permit back (against a real redis-server).

``lease.release()`` hands the release to the gate's batcher (it leaves with the gate's next
script call). A cancellation of the caller at any point -- before the batch leaves, while a batch
before it is in flight, while its own is in flight -- must not keep the slot.
"""

from __future__ import annotations

import asyncio

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
