"""Code run in child OS processes by tests/client/test_revocation.py (spawned, so importable by
path): batch holders of a gate with revocation, as permit blocks and as ``gate.map``."""

from __future__ import annotations

import asyncio
import os
import time

import redis.asyncio
from prometheus_client import CollectorRegistry

from fleetgate.client import Fleet, LeaseLost, LeaseRevoked

HB = 0.2


def hold_until_revoked(
    url: str,
    prefix: str,
    gate: str,
    *,
    floor: int,
    revoke_after: float,
    lease_ms: int,
    probe: str,
    log: str,
    stop: str,
    release_delay: float,
) -> int:
    """``floor`` permit blocks of priority 0, each held until its lease is revoked (then
    ``release_delay`` more: a revoked lease still holds its unit) or the key ``stop`` exists.
    The probe counts the blocks running across processes; ``log`` gets
    ``<event> <lease id> <unix time>`` for 'held', 'revoked', 'released' and 'LeaseRevoked'
    (raised on leaving a revoked block) or 'LeaseLost' (after a freeze past the lease's TTL).
    Returns how many blocks were revoked."""

    async def main() -> int:
        r = redis.asyncio.Redis.from_url(url, decode_responses=True)
        await r.set(f"{log}:pid", os.getpid())
        async with Fleet(
            url, prefix=prefix, registry=CollectorRegistry(), heartbeat_interval=HB
        ) as fleet:
            g = fleet.gate(gate, floor=floor, revoke_after=revoke_after, lease_ms=lease_ms)
            revoked = 0

            async def one() -> None:
                nonlocal revoked
                try:
                    async with g.permit(deadline=None) as lease:
                        await r.incr(probe)
                        await r.rpush(log, f"held {lease.id} {time.time()}")
                        while not lease.is_revoked and not await r.exists(stop):
                            try:
                                await asyncio.wait_for(lease.revoked.wait(), 0.05)
                            except TimeoutError:
                                pass
                        if lease.is_revoked:
                            revoked += 1
                            await r.rpush(log, f"revoked {lease.id} {time.time()}")
                            await asyncio.sleep(release_delay)
                        await r.decr(probe)
                        await r.rpush(log, f"released {lease.id} {time.time()}")
                except (LeaseRevoked, LeaseLost) as exc:  # LeaseLost: a holder frozen too long
                    await r.rpush(log, f"{type(exc).__name__} {lease.id} {time.time()}")

            await asyncio.gather(*(one() for _ in range(floor)))
        await r.aclose()
        return revoked

    return asyncio.run(main())


def map_batch(
    url: str,
    prefix: str,
    gate: str,
    *,
    floor: int,
    revoke_after: float,
    items: int,
    hold_s: float,
    probe: str,
    started: str,
) -> tuple[list[int], int]:
    """``gate.map`` of ``items`` batch calls (priority 0), each holding ``hold_s``, at most
    ``floor`` at once; the probe counts the calls running across processes, ``started`` gets
    one entry per call started. Returns the results (in order) and the revocations counted."""

    async def main() -> tuple[list[int], int]:
        r = redis.asyncio.Redis.from_url(url, decode_responses=True)
        registry = CollectorRegistry()
        async with Fleet(url, prefix=prefix, registry=registry, heartbeat_interval=HB) as fleet:
            g = fleet.gate(gate, floor=floor, revoke_after=revoke_after)

            async def call(item: int) -> int:
                await r.incr(probe)
                await r.rpush(started, item)
                try:
                    await asyncio.sleep(hold_s)
                finally:
                    await r.decr(probe)
                return item * 10

            results = await g.map(call, range(items), max_in_flight=floor, deadline=120)
        await r.aclose()
        labels = {"gate": gate, "priority": "0", "tenant": ""}
        return results, int(
            registry.get_sample_value("fleetgate_client_revoked_total", labels) or 0
        )

    return asyncio.run(main())
