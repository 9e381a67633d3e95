"""Child-process code of tests/client/test_report.py (spawned, so importable by path)."""

from __future__ import annotations

import asyncio
import random

from prometheus_client import CollectorRegistry

from fleetgate.client import Fleet
from fleetgate.observed import OUTCOMES, encode_report, tally


def report_many(url: str, prefix: str, gate: str, calls: int, seed: int) -> dict[str, int]:
    """Run ``calls`` permits (up to 8 at once) each reporting a random outcome and latency;
    return what they reported, summed as the obs hash counts it."""
    rng = random.Random(seed)
    plan = [
        (rng.choice(OUTCOMES), rng.choice([None, rng.uniform(0.0005, 90.0)])) for _ in range(calls)
    ]

    async def main() -> None:
        async with Fleet(url, prefix=prefix, registry=CollectorRegistry()) as fleet:
            g = fleet.gate(gate, floor=8)

            async def one(outcome: str, latency: float | None) -> None:
                async with g.permit(deadline=60) as lease:
                    await asyncio.sleep(rng.uniform(0, 0.002))
                    lease.report(outcome, latency if latency is not None else 0.01)

            await asyncio.gather(*(one(o, lat) for o, lat in plan))

    asyncio.run(main())
    pairs = tally(encode_report(o, lat if lat is not None else 0.01) for o, lat in plan)
    return dict(zip(pairs[::2], pairs[1::2], strict=True))  # type: ignore[arg-type]
