"""Code run in child OS processes by tests/client/test_band_share.py (spawned, so importable by
path): callers of one priority on a gate with (or without) band shares."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import redis.asyncio
from prometheus_client import CollectorRegistry

from fleetgate.client import Fleet


def band_calls(
    url: str,
    prefix: str,
    gate: str,
    *,
    priority: int,
    tasks: int,
    loops: int,
    hold_s: float,
    probe: str,
    floor: int,
    band_share: Mapping[int, float],
    start: str,
) -> tuple[int, int]:
    """``tasks`` tasks each take ``loops`` permits of ``priority`` in turn, holding each
    ``hold_s``, once the key ``start`` exists. The probe (INCR on entry, DECR on exit) counts
    this band's permits in use across processes. Returns (the probe's highest reading, how many
    of this process's grants parked first: the wait histogram counts only those)."""

    async def main() -> tuple[int, int]:
        peak = 0
        registry = CollectorRegistry()
        probe_client = redis.asyncio.Redis.from_url(url)
        async with Fleet(url, prefix=prefix, registry=registry) as fleet:
            g = fleet.gate(gate, floor=floor, band_share=band_share, shed_below=-100)
            while not await probe_client.exists(start):
                await asyncio.sleep(0.005)

            async def one() -> None:
                nonlocal peak
                for _ in range(loops):
                    async with g.permit(deadline=60, priority=priority):
                        peak = max(peak, await probe_client.incr(probe))
                        await asyncio.sleep(hold_s)
                        await probe_client.decr(probe)

            await asyncio.gather(*(one() for _ in range(tasks)))
        await probe_client.aclose()
        labels = {"gate": gate, "priority": str(priority), "tenant": ""}
        parked = registry.get_sample_value("fleetgate_client_wait_seconds_count", labels)
        return peak, int(parked or 0)

    return asyncio.run(main())
