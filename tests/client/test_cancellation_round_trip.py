"""A cancellation racing the acquire script's round trip is never lost.

redis-py 8.1 sends each command under ``asyncio.wait_for`` (a socket timeout is set), which on
Python 3.11 returns the result when the caller's cancellation races the send's completion. The
cancellation is sent here 0-12 event-loop iterations after the acquire starts -- sweeping the
pool checkout, the send, the read and the reply -- and every cancellation that reached a running
task must end it with CancelledError, leaving nothing held or queued. The other cancellations of
one process are in ``test_cancellation.py``; the multi-process version under load is
``tests/chaos/test_cancel_ends.py``.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aredis
from prometheus_client import CollectorRegistry

from fleetgate.client import Fleet

from ..conftest import RedisUnderTest

ROUNDS = 20


@pytest.fixture
async def fleet(rut: RedisUnderTest) -> AsyncIterator[Fleet]:
    async with Fleet(rut.url, prefix=rut.prefix, registry=CollectorRegistry()) as f:
        yield f


@pytest.mark.parametrize("api", ["permit", "acquire"])
@pytest.mark.parametrize("busy", [False, True], ids=["free", "parks"])
async def test_cancel_during_acquire_round_trip_is_never_lost(
    api: str, busy: bool, fleet: Fleet, async_redis: aredis.Redis
) -> None:
    gate = fleet.gate(f"race-{api}-{busy}".lower(), floor=1, lease_ms=60_000, waiter_ms=60_000)
    loop = asyncio.get_running_loop()
    held = await gate.acquire(deadline=5) if busy else None
    outcomes: Counter[str] = Counter()

    async def one() -> None:
        if api == "permit":
            async with gate.permit(deadline=None):
                await asyncio.Event().wait()  # only a cancellation ends it
        else:
            lease = await gate.acquire(deadline=None)
            try:
                await asyncio.Event().wait()
            finally:
                await lease.release()

    for k in range(13):
        if sum(outcomes.values()) - outcomes["cancelled"] >= 10:
            break  # failed already; each loss costs the 1 s wait below
        for _ in range(ROUNDS):
            task = asyncio.create_task(one())
            sent: list[bool] = []

            def after(n: int, t: asyncio.Task[None] = task, sent: list[bool] = sent) -> None:
                if n <= 0:
                    sent.append(t.cancel())
                else:
                    loop.call_soon(after, n - 1)

            after(k)
            try:
                # A lost cancellation leaves the task waiting forever (parked, or in its permit).
                await asyncio.wait_for(asyncio.shield(task), 1.0)
            except asyncio.CancelledError:
                outcomes["cancelled"] += 1
            except TimeoutError:
                outcomes[f"lost at {k}"] += 1
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            assert sent == [True]
    if held is not None:
        await held.release()
    while fleet.runtime.tasks:  # background cancels and releases
        await asyncio.sleep(0.01)
    assert outcomes == {"cancelled": 13 * ROUNDS}, outcomes
    assert gate.leases == {} and gate.waiters == {}
    assert await async_redis.zcard(gate.keys.holders) == 0
    assert await async_redis.zcard(gate.keys.waiters) == 0
