"""Code run in child OS processes by tests/lua/test_admission.py (spawned, so importable by path).

Each worker opens its own Fleet, runs permits with the weights, priorities and tenants it is
given, and reports what it saw as plain data (the test process checks the claims).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import redis
from prometheus_client import CollectorRegistry

from fleetgate.client import Fleet
from fleetgate.errors import ConfigError, DeadlineExceeded, Overloaded

T = TypeVar("T")


async def _uncancellable(aw: Awaitable[T]) -> T:
    """Await ``aw`` to its end even if the caller is cancelled meanwhile (re-raised after)."""
    task = asyncio.ensure_future(aw)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return result


@contextlib.asynccontextmanager
async def counted(r: redis.asyncio.Redis, probe: str, w: int) -> AsyncIterator[int]:
    """Add ``w`` to the external counter ``probe`` for the block (yields the new total); the
    entry and the exit run to their end even when the block is cancelled, so the counter is
    exactly the units of the blocks running, as seen from outside fleetgate."""
    incr = asyncio.ensure_future(r.incrby(probe, w))

    async def undo() -> None:
        await incr
        await r.decrby(probe, w)

    try:
        yield int(await _uncancellable(incr))
    finally:  # also when cancelled after the increment landed, before the block began
        await _uncancellable(undo())


def random_weights(
    url: str,
    prefix: str,
    gate: str,
    limit: int,
    tasks: int,
    rounds: int,
    probe: str,
    seed: int,
) -> dict[str, Any]:
    """``tasks`` loops of ``rounds`` permits each, random weight 1..8, priority, tenant and
    hold; around its work each permit adds its weight to the external counter ``probe``
    (INCRBY/DECRBY), whose highest value seen is returned with the outcome counts. Some calls
    are cancelled or given short deadlines mid-way."""
    rng = random.Random(seed)

    async def main() -> dict[str, Any]:
        r = redis.asyncio.Redis.from_url(url)
        peak, granted, cancelled, timed_out, overloaded = 0, 0, 0, 0, 0
        async with Fleet(
            url, prefix=prefix, registry=CollectorRegistry(), heartbeat_interval=0.2
        ) as fleet:
            g = fleet.gate(gate, floor=limit, ceiling=limit, max_queued=10_000)

            async def one() -> None:
                nonlocal peak, granted
                w = rng.randint(1, 8)
                prio = rng.choice((0, 0, 5, -1))  # -1: sheddable, never parks
                tenant = rng.choice((None, "a", "b"))
                async with g.permit(deadline=30, weight=w, priority=prio, tenant=tenant):
                    granted += 1
                    async with counted(r, probe, w) as now:
                        peak = max(peak, now)
                        await asyncio.sleep(rng.uniform(0.0, 0.01))

            async def loop() -> None:
                nonlocal cancelled, timed_out, overloaded
                for _ in range(rounds):
                    kind = rng.random()
                    try:
                        if kind < 0.1:
                            task = asyncio.create_task(one())
                            await asyncio.sleep(rng.uniform(0, 0.01))
                            task.cancel()
                            try:
                                await task
                            except asyncio.CancelledError:
                                cancelled += 1
                        elif kind < 0.2:
                            await asyncio.wait_for(one(), rng.uniform(0.001, 0.02))
                        else:
                            await one()
                    except (asyncio.TimeoutError, DeadlineExceeded):
                        timed_out += 1
                    except Overloaded:
                        overloaded += 1

            await asyncio.gather(*(loop() for _ in range(tasks)))
        await r.aclose()
        return {
            "peak": peak,
            "granted": granted,
            "cancelled": cancelled,
            "timed_out": timed_out,
            "overloaded": overloaded,
        }

    return asyncio.run(main())


def tenant_load(
    url: str,
    prefix: str,
    gate: str,
    limit: int,
    tenant: str,
    outstanding: int,
    total: int,
    hold_s: float,
    weight: int = 1,
    priority: int = 0,
) -> list[tuple[float, int]]:
    """Keep ``outstanding`` calls of ``tenant`` in flight or parked until ``total`` have been
    granted; returns (wall time of the grant, weight) per grant."""

    async def main() -> list[tuple[float, int]]:
        grants: list[tuple[float, int]] = []
        async with Fleet(
            url, prefix=prefix, registry=CollectorRegistry(), heartbeat_interval=0.2
        ) as fleet:
            g = fleet.gate(gate, floor=limit, ceiling=limit, max_queued=10_000)
            left = total

            async def worker() -> None:
                nonlocal left
                while left > 0:
                    left -= 1
                    async with g.permit(deadline=120, weight=weight, priority=priority,
                                        tenant=tenant):  # fmt: skip
                        grants.append((time.time(), weight))
                        await asyncio.sleep(hold_s)

            await asyncio.gather(*(worker() for _ in range(outstanding)))
        return grants

    return asyncio.run(main())


def flood(
    url: str,
    prefix: str,
    gate: str,
    limit: int,
    calls: int,
    hold_s: float,
    priority: int,
    tenant: str | None,
    max_queued: int = 10_000,
) -> dict[str, Any]:
    """``calls`` permits at once; returns the grants' tokens and the outcome counts."""

    async def main() -> dict[str, Any]:
        tokens: list[int] = []
        overloaded = 0
        async with Fleet(
            url, prefix=prefix, registry=CollectorRegistry(), heartbeat_interval=0.2
        ) as fleet:
            g = fleet.gate(gate, floor=limit, ceiling=limit, max_queued=max_queued)

            async def one() -> None:
                nonlocal overloaded
                try:
                    async with g.permit(deadline=120, priority=priority, tenant=tenant) as lease:
                        tokens.append(lease.token)
                        await asyncio.sleep(hold_s)
                except Overloaded:
                    overloaded += 1

            await asyncio.gather(*(one() for _ in range(calls)))
        return {"tokens": tokens, "overloaded": overloaded}

    return asyncio.run(main())


def park_heavy(
    url: str, prefix: str, gate: str, limit: int, weight: int, wait_s: float
) -> dict[str, Any]:
    """One call of ``weight`` with no deadline on a gate of floor = ceiling = ``limit``; returns
    how it ended (``error``: the exception's type name, '' when granted; ``message``) and the
    wall time it ended at. Gives up (``error`` 'still parked') after ``wait_s``, so a call that
    would park for ever cannot hang the test."""

    async def main() -> dict[str, Any]:
        async with Fleet(
            url, prefix=prefix, registry=CollectorRegistry(), heartbeat_interval=0.2
        ) as fleet:
            g = fleet.gate(gate, floor=limit, ceiling=limit)
            error, message = "", ""
            try:
                lease = await asyncio.wait_for(g.acquire(deadline=None, weight=weight), wait_s)
                await lease.release()
            except asyncio.TimeoutError:
                error = "still parked"
            except (ConfigError, Overloaded, DeadlineExceeded) as exc:
                error, message = type(exc).__name__, str(exc)
            return {"error": error, "message": message, "at": time.time()}

    return asyncio.run(main())
