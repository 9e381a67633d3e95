"""A pod's cost to Redis does not grow with its gates (issue 11 item 2), against a real
redis-server: one wake connection per pod (standalone), a bounded pool, a gate added while the
blocking pop waits is woken at once."""

from __future__ import annotations

import asyncio
import time
import uuid

import redis.asyncio as aredis
from prometheus_client import CollectorRegistry

from fleetgate.client import Fleet

from .conftest import RedisUnderTest


def _fleet(rut: RedisUnderTest, name: str, **kw: object) -> Fleet:
    return Fleet(
        rut.url,
        prefix=rut.prefix,
        registry=CollectorRegistry(),
        redis_options={"client_name": name},
        **kw,  # type: ignore[arg-type]
    )


async def _conns(r: aredis.Redis, name: str) -> int:
    return sum(1 for c in await r.client_list() if c.get("name") == name)


async def _parked(r: aredis.Redis, keys: list[str]) -> bool:
    return all([await r.zcard(k) == 1 for k in keys])


async def test_one_wake_connection_for_many_gates(
    rut: RedisUnderTest, async_redis: aredis.Redis
) -> None:
    n = 30
    pod, peer = f"pod-{uuid.uuid4().hex[:6]}", f"peer-{uuid.uuid4().hex[:6]}"
    async with _fleet(rut, pod) as waiter, _fleet(rut, peer) as holder:
        names = [f"g{i}" for i in range(n)]
        held = [await holder.gate(g, floor=1, ceiling=1).acquire() for g in names]
        parked = [
            asyncio.create_task(waiter.gate(g, floor=1, ceiling=1).acquire(deadline=20))
            for g in names
        ]
        queues = [waiter.gate(g).keys.queue for g in names]
        for _ in range(500):
            if await _parked(async_redis, queues):
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        # pool (bounded) + ONE wake listener, whatever the number of gates
        assert await _conns(async_redis, pod) <= 8 + 1
        assert len(waiter._wakes.tasks) == 1
        for i, lease in enumerate(held):
            t0 = time.monotonic()
            await lease.release()
            got = await asyncio.wait_for(parked[i], 1.0)  # the wake list, not the heartbeat
            assert time.monotonic() - t0 < 0.5
            await got.release()


async def test_a_gate_added_while_the_pop_blocks_is_woken_at_once(rut: RedisUnderTest) -> None:
    # wake_block long and the heartbeat slow: only the re-armed pop can deliver in time
    async with (
        _fleet(rut, "w", wake_block=30.0, heartbeat_interval=5.0) as waiter,
        _fleet(rut, "h") as holder,
    ):
        for name in ("first", "second", "third"):
            held = await holder.gate(name, floor=1, ceiling=1).acquire()
            parked = asyncio.create_task(waiter.gate(name, floor=1, ceiling=1).acquire(deadline=20))
            await asyncio.sleep(0.1)  # parked, the pop blocked (with the earlier gates only)
            await held.release()
            lease = await asyncio.wait_for(parked, 1.0)
            await lease.release()
        assert len(waiter._wakes.tasks) == 1


async def test_a_busy_gate_does_not_starve_another_gates_wake(rut: RedisUnderTest) -> None:
    async with _fleet(rut, "w2") as waiter, _fleet(rut, "h2") as holder:
        busy = waiter.gate("busy", floor=1, ceiling=1)
        quiet_h = await holder.gate("quiet", floor=1, ceiling=1).acquire()
        stop = asyncio.Event()

        async def churn() -> None:
            while not stop.is_set():
                async with busy.permit(deadline=5):
                    await asyncio.sleep(0)

        churners = [asyncio.create_task(churn()) for _ in range(4)]
        parked = asyncio.create_task(waiter.gate("quiet", floor=1, ceiling=1).acquire(deadline=5))
        await asyncio.sleep(0.2)
        await quiet_h.release()
        lease = await asyncio.wait_for(parked, 1.0)
        await lease.release()
        stop.set()
        await asyncio.gather(*churners)
