"""Code run in child OS processes by the fleet tests (spawned, so importable by path)."""

from __future__ import annotations

import asyncio
import os
import time

import redis
from prometheus_client import CollectorRegistry

from fleetgate.client import Fleet


def hammer(url: str, prefix: str, gate: str, tasks: int, hold_s: float, probe: str) -> int:
    """Run ``tasks`` permits concurrently; return the highest concurrency seen by the probe.

    The probe is a plain Redis counter outside fleetgate: INCR on entry, DECR on exit.
    """

    async def main() -> int:
        peak = 0
        probe_client = redis.asyncio.Redis.from_url(url)
        async with Fleet(url, prefix=prefix, registry=CollectorRegistry()) as fleet:
            g = fleet.gate(gate, floor=4)

            async def one() -> None:
                nonlocal peak
                async with g.permit(deadline=60):
                    now = await probe_client.incr(probe)
                    peak = max(peak, now)
                    await asyncio.sleep(hold_s)
                    await probe_client.decr(probe)

            await asyncio.gather(*(one() for _ in range(tasks)))
        await probe_client.aclose()
        return peak

    return asyncio.run(main())


def park_and_record(url: str, prefix: str, gate: str, record: str, hold_s: float) -> None:
    """Acquire once (parking if needed) and append this process' pid to ``record`` on grant."""

    async def main() -> None:
        r = redis.asyncio.Redis.from_url(url)
        async with Fleet(url, prefix=prefix, registry=CollectorRegistry()) as fleet:
            async with fleet.gate(gate, floor=1).permit(deadline=60):
                await r.rpush(record, os.getpid())
                await asyncio.sleep(hold_s)
        await r.aclose()

    asyncio.run(main())


def hold_forever(
    url: str, prefix: str, gate: str, ready: str, lease_ms: int, waiter_ms: int
) -> None:
    """Acquire (or park) and then never finish; the test SIGKILLs this process."""

    async def main() -> None:
        r = redis.asyncio.Redis.from_url(url)
        async with Fleet(url, prefix=prefix, registry=CollectorRegistry()) as fleet:
            g = fleet.gate(gate, floor=1, lease_ms=lease_ms, waiter_ms=waiter_ms)
            task = asyncio.create_task(g.acquire(deadline=None))
            await r.rpush(ready, os.getpid())
            await task
            await asyncio.sleep(3600)

    asyncio.run(main())


def wait_for(predicate, timeout: float, interval: float = 0.01) -> float:  # type: ignore[no-untyped-def]
    """Poll ``predicate`` until true; return the seconds it took (raise on timeout)."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"condition not met within {timeout}s")
        time.sleep(interval)
    return time.monotonic() - start


def map_with_probe(url: str, prefix: str, gate: str, items: int, hold_s: float, probe: str) -> int:
    """One request: ``gate.map`` over ``items`` calls; return the peak concurrency seen by the
    shared probe counter (INCR/DECR outside fleetgate)."""

    async def main() -> int:
        peak = 0
        r = redis.asyncio.Redis.from_url(url)
        async with Fleet(url, prefix=prefix, registry=CollectorRegistry()) as fleet:
            g = fleet.gate(gate, floor=1)

            async def call(_: int) -> None:
                nonlocal peak
                peak = max(peak, await r.incr(probe))
                await asyncio.sleep(hold_s)
                await r.decr(probe)

            await g.map(call, range(items), max_in_flight=4, deadline=60)
        await r.aclose()
        return peak

    return asyncio.run(main())
