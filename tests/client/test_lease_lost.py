"""LeaseLost: leaving a permit block whose lease was lost raises it (against a real redis-server).

A lease is lost when the heartbeat finds it gone from the gate's holders and cannot count it
again: it expired (the process stalled past the lease TTL), or its entry was removed while the
pod had not seen it renewed (a hand-off granted through the wake list). The heartbeat marks it
(``lease.lost`` / ``lease.is_lost``); leaving ``permit()`` then raises :class:`LeaseLost`,
unless the block raised an exception of its own, which wins. ``gate.map`` keeps the call's
result (the loss is counted and logged) and ``lease.release()`` never raises.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aredis
from prometheus_client import CollectorRegistry

from fleetgate.client import Fleet, Lease, LeaseLost, SyncFleet

from ..conftest import RedisUnderTest


def lost_total(registry: CollectorRegistry, gate: str) -> float:
    return registry.get_sample_value("fleetgate_client_lease_lost_total", {"gate": gate}) or 0.0


def in_flight(registry: CollectorRegistry, gate: str) -> float:
    labels = {"gate": gate, "priority": "0", "tenant": ""}  # the default class
    return registry.get_sample_value("fleetgate_client_in_flight", labels) or 0.0


async def stall_past_ttl(lease: Lease, seconds: float = 0.5) -> None:
    """Block the whole loop past the lease TTL (a GC pause, a frozen VM), then wait for the
    heartbeat to report the lease lost."""
    time.sleep(seconds)
    await asyncio.wait_for(lease.lost.wait(), 3)


async def test_expired_lease_raises_on_leaving_permit(
    fleet: Fleet, registry: CollectorRegistry, async_redis: aredis.Redis
) -> None:
    gate = fleet.gate("expired", floor=1, lease_ms=300)
    reached_end = False
    with pytest.raises(LeaseLost) as caught:
        async with gate.permit() as lease:
            await stall_past_ttl(lease)
            assert lease.is_lost
            reached_end = True
    assert reached_end  # the block ran to its end; the error comes on leaving it
    assert "gate 'expired'" in str(caught.value) and lease.id in str(caught.value)
    assert await async_redis.zscore(gate.keys.holders, lease.id) is None
    assert lost_total(registry, "expired") == 1 and in_flight(registry, "expired") == 0
    async with gate.permit():  # the gate goes on granting
        pass


async def test_removed_holder_entry_raises_on_leaving_permit(
    rut: RedisUnderTest, registry: CollectorRegistry, async_redis: aredis.Redis
) -> None:
    # A heartbeat every second: the hand-off below is delivered by the wake list well before
    # the next renewal, so the pod has never seen the lease renewed (expires_at 0), and an
    # entry removed now is lost, not counted again (see lua/heartbeat.lua).
    async with Fleet(rut.url, prefix=rut.prefix, registry=registry, heartbeat_interval=1.0) as f:
        gate = f.gate("removed", floor=1)
        held = await gate.acquire()
        granted: asyncio.Future[Lease] = asyncio.get_running_loop().create_future()
        reached_end = False

        async def second() -> None:
            nonlocal reached_end
            async with gate.permit(deadline=10) as lease:
                granted.set_result(lease)
                await asyncio.wait_for(lease.lost.wait(), 5)
                reached_end = True

        task = asyncio.create_task(second())
        while await async_redis.zcard(gate.keys.waiters) == 0:
            await asyncio.sleep(0.005)
        await held.release()  # hands the slot to the parked caller
        lease = await asyncio.wait_for(granted, 2)
        assert lease.expires_at == 0, "granted through the wake list, not seen by a heartbeat"
        assert await async_redis.zrem(gate.keys.holders, lease.id) == 1
        with pytest.raises(LeaseLost):
            await task
        assert reached_end and lease.is_lost
        assert lost_total(registry, "removed") == 1 and in_flight(registry, "removed") == 0


async def test_the_blocks_own_error_wins(fleet: Fleet, registry: CollectorRegistry) -> None:
    gate = fleet.gate("own-error", floor=1, lease_ms=300)
    with pytest.raises(RuntimeError, match="the block's own"):
        async with gate.permit() as lease:
            await stall_past_ttl(lease)
            raise RuntimeError("the block's own error")
    assert lease.is_lost and lost_total(registry, "own-error") == 1


async def test_acquire_release_and_map_do_not_raise(
    fleet: Fleet, registry: CollectorRegistry
) -> None:
    gate = fleet.gate("quiet", floor=1, lease_ms=300)
    lease = await gate.acquire()
    await stall_past_ttl(lease)
    await lease.release()  # never raises: the caller who took the lease reads lease.is_lost

    async def call(x: int) -> int:
        time.sleep(0.5)  # stalls the loop past the TTL under this call's permit
        await asyncio.sleep(0.8)  # the heartbeat runs and reports the lease lost
        return x * 2

    assert await gate.map(call, [21], retry=False) == [42]  # the result stands
    assert lost_total(registry, "quiet") == 2 and in_flight(registry, "quiet") == 0


def test_sync_permit_raises_on_leaving(rut: RedisUnderTest, registry: CollectorRegistry) -> None:
    with SyncFleet(rut.url, prefix=rut.prefix, registry=registry, heartbeat_interval=0.2) as fleet:
        gate = fleet.gate("sync-lost", floor=1, lease_ms=300)
        with pytest.raises(LeaseLost), gate.permit() as lease:
            # Stall the fleet's loop (the thread that renews) past the lease TTL.
            fleet.portal.loop.call_soon_threadsafe(time.sleep, 0.5)
            end = time.monotonic() + 3
            while not lease.is_lost and time.monotonic() < end:
                time.sleep(0.01)
            assert lease.is_lost
        with gate.permit() as again:  # a healthy lease leaves quietly
            assert not again.is_lost
    assert lost_total(registry, "sync-lost") == 1
