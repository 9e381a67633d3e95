"""Code run in child OS processes by the token-budget tests (spawned, so importable by path)."""

from __future__ import annotations

import asyncio
import random

import redis
from prometheus_client import CollectorRegistry

from fleetgate.client import Fleet

#: the gate the workers share: 8 units and 1,000 tokens held at once
FLOOR, TOKEN_LIMIT = 8, 1000


class Probe:
    """Two plain Redis counters outside fleetgate, the units and tokens the callers use across
    the fleet, and the peaks this process saw of them. Moved so that they never undercount:
    add after a grant or a growth succeeds, take away before a release or a shrink is sent."""

    def __init__(self, r: redis.asyncio.Redis, probe: str) -> None:
        self.r = r
        self.units_key, self.tokens_key = f"{probe}:units", f"{probe}:tokens"
        self.peaks = {"units": 0, "tokens": 0}

    async def note(self, tokens: int, units: int = 0) -> None:
        async with self.r.pipeline(transaction=True) as p:
            p.incrby(self.units_key, units).incrby(self.tokens_key, tokens)
            u, t = await p.execute()
        self.peaks["units"] = max(self.peaks["units"], u)
        self.peaks["tokens"] = max(self.peaks["tokens"], t)


def token_hammer(
    url: str, prefix: str, gate: str, calls: int, seed: int, probe: str
) -> dict[str, int]:
    """Run ``calls`` permits, 6 at a time, of random tokens (some shrink half-way, some try to
    grow); return the peaks of units and tokens the probe (:class:`Probe`) saw at once across
    the fleet."""
    rng = random.Random(seed)

    async def main() -> dict[str, int]:
        r = redis.asyncio.Redis.from_url(url)
        seen = Probe(r, probe)
        note = seen.note
        async with Fleet(url, prefix=prefix, registry=CollectorRegistry()) as fleet:
            g = fleet.gate(gate, floor=FLOOR, token_limit=TOKEN_LIMIT, max_queued=10_000)

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
        return seen.peaks

    return asyncio.run(main())


def steady_calls(
    url: str, prefix: str, gate: str, token_limit: int, calls: int, probe: str
) -> dict[str, int]:
    """Run ``calls`` permits of 60 tokens, 2 at a time, each held a few ms, on a gate this
    process gives ``floor=16, token_limit=token_limit`` (what applies is the gate's stored
    configuration); return the peaks of units and tokens the probe saw at once across the
    fleet."""

    async def main() -> dict[str, int]:
        r = redis.asyncio.Redis.from_url(url)
        probe_ = Probe(r, probe)
        async with Fleet(url, prefix=prefix, registry=CollectorRegistry()) as fleet:
            g = fleet.gate(gate, floor=16, token_limit=token_limit, max_queued=10_000)

            async def caller(n: int) -> None:
                for _ in range(n):
                    async with g.permit(deadline=60, tokens=60):
                        await probe_.note(60, 1)
                        await asyncio.sleep(0.005)
                        await probe_.note(-60, -1)

            await asyncio.gather(caller(calls // 2), caller(calls - calls // 2))
        await r.aclose()
        return probe_.peaks

    return asyncio.run(main())
