"""Live limit changes, races and lost wake-ups, against a real redis-server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aredis
from prometheus_client import CollectorRegistry

from fleetgate.client import Fleet
from fleetgate.scripts import GateScripts

from ..conftest import RedisUnderTest


@pytest.fixture
async def fleet(rut: RedisUnderTest) -> AsyncIterator[Fleet]:
    async with Fleet(
        rut.url, prefix=rut.prefix, registry=CollectorRegistry(), heartbeat_interval=0.5
    ) as f:
        yield f


async def until(predicate, timeout: float = 5.0) -> float:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    while not await predicate():
        if time.monotonic() - start > timeout:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.005)
    return time.monotonic() - start


async def test_growth_wakes_parked_callers_at_once(fleet: Fleet, async_redis: aredis.Redis) -> None:
    gate = fleet.gate("grow", floor=1, ceiling=10)
    held = await gate.acquire()
    parked = [asyncio.create_task(gate.acquire(deadline=10)) for _ in range(3)]
    await until(lambda: _eq(async_redis.zcard(gate.keys.waiters), 3))
    t0 = time.monotonic()
    assert await GateScripts(async_redis).set_target(gate.keys, 4, epoch=1, ttl_ms=30_000)
    leases = await asyncio.gather(*parked)
    took = time.monotonic() - t0
    # Far below the heartbeat interval: the wake list delivered the grants.
    assert took < 0.25, took
    for lease in [held, *leases]:
        await lease.release()


async def test_shrink_never_revokes(fleet: Fleet, async_redis: aredis.Redis) -> None:
    gate = fleet.gate("shrink", floor=1, ceiling=10)
    scripts = GateScripts(async_redis)
    await scripts.set_target(gate.keys, 3, epoch=1, ttl_ms=30_000)
    held = [await gate.acquire() for _ in range(3)]
    await scripts.set_target(gate.keys, 1, epoch=1, ttl_ms=30_000)
    assert await async_redis.zcard(gate.keys.holders) == 3  # nobody revoked
    late = asyncio.create_task(gate.acquire(deadline=10))
    await until(lambda: _eq(async_redis.zcard(gate.keys.waiters), 1))
    await held[0].release()
    await held[1].release()
    await asyncio.sleep(0.2)
    assert not late.done()  # 1 holder, limit 1: still no room
    await held[2].release()
    lease = await asyncio.wait_for(late, 2)
    await lease.release()


async def test_killed_wake_connection_still_granted(
    rut: RedisUnderTest, async_redis: aredis.Redis
) -> None:
    interval = 0.5
    async with Fleet(
        rut.url, prefix=rut.prefix, registry=CollectorRegistry(), heartbeat_interval=interval
    ) as fleet:
        gate = fleet.gate("killwake", floor=1)
        held = await gate.acquire()
        task = asyncio.create_task(gate.acquire(deadline=10))
        await until(lambda: _eq(async_redis.zcard(gate.keys.waiters), 1))
        await asyncio.sleep(0.05)  # the listener is blocked in BLPOP now
        clients = await async_redis.client_list()
        blocked = [c for c in clients if c.get("cmd") == "blmpop"]
        assert blocked, "no wake listener connection found"
        for c in blocked:
            await async_redis.client_kill_filter(_id=c["id"])
        t0 = time.monotonic()
        await held.release()
        lease = await asyncio.wait_for(task, 5)
        took = time.monotonic() - t0
        await lease.release()
    print(f"grant after CLIENT KILL of the wake connection: {took * 1000:.0f} ms")
    assert took <= interval + 1.0


async def _eq(awaitable, value) -> bool:  # type: ignore[no-untyped-def]
    return bool(await awaitable == value)
