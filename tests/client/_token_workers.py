"""Code run in child OS processes by the token-budget tests (spawned, so importable by path)."""

from __future__ import annotations

import asyncio
import random

import redis
from prometheus_client import CollectorRegistry

from fleetgate.client import Fleet

#: the gate the workers share: 8 units and 1,000 tokens held at once
FLOOR, TOKEN_LIMIT = 8, 1000


def token_hammer(
    url: str, prefix: str, gate: str, calls: int, seed: int, probe: str
) -> dict[str, int]:
    """Run ``calls`` permits, 6 at a time, of random tokens (some shrink half-way, some try to
    grow); return the peaks of units and tokens the probe saw at once across the fleet.

    The probe is two plain Redis counters outside fleetgate, moved so that they never
    undercount what the callers use: tokens are added after a grant or a growth succeeds, and
    taken away before a release or a shrink is sent.
    """
    rng = random.Random(seed)

    async def main() -> dict[str, int]:
        r = redis.asyncio.Redis.from_url(url)
        peaks = {"units": 0, "tokens": 0}
        units_key, tokens_key = f"{probe}:units", f"{probe}:tokens"
        async with Fleet(url, prefix=prefix, registry=CollectorRegistry()) as fleet:
            g = fleet.gate(gate, floor=FLOOR, token_limit=TOKEN_LIMIT, max_queued=10_000)

            async def note(tokens: int, units: int = 0) -> None:
                async with r.pipeline(transaction=True) as p:
                    p.incrby(units_key, units).incrby(tokens_key, tokens)
                    u, t = await p.execute()
                peaks["units"] = max(peaks["units"], u)
                peaks["tokens"] = max(peaks["tokens"], t)

            async def one(tokens: int, plan: str) -> None:
                async with g.permit(deadline=120, tokens=tokens) as lease:
                    await note(tokens, 1)
                    await asyncio.sleep(rng.uniform(0.001, 0.01))
                    if plan == "shrink":
                        smaller = tokens // 3
                        await note(smaller - tokens)
                        assert await lease.resize(smaller) == smaller
                    elif plan == "grow":
                        bigger = min(TOKEN_LIMIT, tokens * 2)
                        held = await lease.resize(bigger)
                        await note(held - tokens)
                    await asyncio.sleep(rng.uniform(0.001, 0.01))
                    await note(-lease.tokens, -1)

            sem = asyncio.Semaphore(6)

            async def capped(tokens: int, plan: str) -> None:
                async with sem:
                    await one(tokens, plan)

            plans = [
                (rng.choice([20, 50, 120, 300, 600]), rng.choice(["keep", "shrink", "grow"]))
                for _ in range(calls)
            ]
            await asyncio.gather(*(capped(t, p) for t, p in plans))
        await r.aclose()
        return peaks

    return asyncio.run(main())
