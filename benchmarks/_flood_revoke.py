"""flood, the revocation part: interactive calls against a flood of long batch calls, in one run.

One gate of ``FLOOR`` units. A batch job (``gate.map`` of ``ITEMS`` calls at priority 0, each
holding its permit ``BATCH_HOLD_S`` -- a minute in the full run, ten seconds in the quick one --
at most ``FLOOR`` at once) keeps the gate full; ``INTERACTIVE`` closed-loop interactive callers
(priority 10) hold theirs a uniform 50-200 ms and think 0.1-0.3 s between calls. The same load,
one way after the other, each on its own gate (every fleet beats every ``HB`` s):

* **no flood**: the interactive callers alone (the baseline);
* **strict bands**: the interactive calls go first, but wait for a batch call to end;
* **strict + revocation**: ``revoke_after=REVOKE_AFTER``: an interactive head that waited that
  long gets a batch permit back (the batch item is cut and queued again);
* **headroom**: ``band_share={0: SHARE}`` keeps units free for the interactive calls (fewer
  than the interactive callers: at their peaks they wait for a batch call to end);
* **headroom + revocation**: and revocation takes a unit back when they need more than that.

Figures per way: the interactive calls' latency (wait + hold) p50/p99 over the window, against
the no-flood baseline, the revocations, and the batch: the share of its items that completed
(each batch job runs to its end after the window; a revoked item runs again). Goals: with
headroom and revocation, the interactive latency p99 at most 1.5x the no-flood baseline's, and
every batch item completes (>= 99 %).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

from ._common import (
    Flavor,
    Headline,
    Options,
    figure,
    latency_cdf,
    log,
    open_fleet,
    quantile,
    save,
    table,
)
from ._flood_bands import latency_headlines, over_baseline, p50_p99_ms
from ._server import private_redis

NAME = "flood_revoke"
FLOOR, INTERACTIVE = 8, 4
HOLD_S, THINK_S = (0.05, 0.2), (0.1, 0.3)
SHARE, REVOKE_AFTER, HB = 0.75, 0.2, 0.2
COMPLETE = 0.99


@dataclass
class Way:
    label: str
    batch: bool
    share: dict[int, float]
    revoke_after: float | None
    window: float = 0.0
    latencies: list[float] = field(default_factory=list)  # interactive: wait + hold
    items: int = 0
    completed: int = 0
    revoked: int = 0
    batch_s: float = 0.0  # how long the batch job took


async def _run_way(
    url: str, way: Way, warm: float, window: float, hold: tuple[float, float], flavor: Flavor
) -> None:
    rng = random.Random(20261205)
    async with open_fleet(url, flavor, heartbeat_interval=HB) as fleet:
        gate = fleet.gate(
            f"flood-revoke-{way.label.replace(' ', '-').replace('+', 'and')}",
            floor=FLOOR,
            max_queued=10_000,
            band_share=way.share,
            revoke_after=way.revoke_after,
        )
        t0 = time.monotonic()
        start, stop = t0 + warm, t0 + warm + window

        async def item(i: int) -> int:
            await asyncio.sleep(rng.uniform(*hold))
            return i

        async def batch() -> None:
            # enough items to keep the gate full through the window, then run to the end
            way.items = FLOOR * (1 + int((warm + window) / hold[0]))
            done = await gate.map(
                item, range(way.items), max_in_flight=FLOOR, deadline=None,
                return_exceptions=True,
            )  # fmt: skip
            way.completed = sum(1 for d in done if isinstance(d, int))
            way.batch_s = time.monotonic() - t0

        async def interactive() -> None:
            while time.monotonic() < stop:
                asked = time.monotonic()
                async with gate.permit(deadline=None, priority=10):
                    await asyncio.sleep(rng.uniform(*HOLD_S))
                if asked >= start:
                    way.latencies.append(time.monotonic() - asked)
                await asyncio.sleep(rng.uniform(*THINK_S))

        tasks = [interactive() for _ in range(INTERACTIVE)]
        if way.batch:
            tasks.append(batch())
        await asyncio.gather(*tasks)
        way.window = window
        way.revoked = (await gate.snapshot()).stat("revoked")


def run(opts: Options) -> list[Headline]:
    """The five ways, one after the other, on a private redis-server."""
    warm, window = opts.pick((8.0, 60.0), (3.0, 12.0))
    hold = opts.pick((45.0, 75.0), (8.0, 12.0))
    ways = [
        Way("no flood", False, {}, None),
        Way("strict bands", True, {}, None),
        Way("strict + revocation", True, {}, REVOKE_AFTER),
        Way("headroom", True, {0: SHARE}, None),
        Way("headroom + revocation", True, {0: SHARE}, REVOKE_AFTER),
    ]
    with private_redis() as rp:
        for way in ways:
            log(f"{NAME}: {way.label} ({warm:.0f} s warm-up, {window:.0f} s window, batch calls "
                f"of {hold[0]:.0f}-{hold[1]:.0f} s)")  # fmt: skip
            opts.flavor.run(_run_way(rp.url, way, warm, window, hold, opts.flavor))
        return _report(opts, rp.url, ways, hold)


def _report(opts: Options, url: str, ways: list[Way], hold: tuple[float, float]) -> list[Headline]:
    base, both = ways[0], ways[-1]
    rows = [
        (
            w.label,
            p50_p99_ms(w.latencies),
            f"{over_baseline(base, w):.2f}",
            len(w.latencies),
            w.revoked,
            f"{w.completed} / {w.items}" if w.items else "-",
            f"{w.batch_s:.0f}" if w.items else "-",
        )
        for w in ways
    ]
    text = table(
        (
            "way",
            "interactive latency p50/p99 ms",
            "p99 / no flood",
            "calls",
            "revoked",
            "batch items done",
            "batch job s",
        ),
        rows,
    )
    complete = both.completed / both.items if both.items else 0.0
    data: dict[str, Any] = {
        "floor": FLOOR,
        "interactive_callers": INTERACTIVE,
        "batch_hold_s": hold,
        "hold_s": HOLD_S,
        "think_s": THINK_S,
        "share": SHARE,
        "revoke_after_s": REVOKE_AFTER,
        "heartbeat_s": HB,
        "ways": [
            {
                "way": w.label,
                "band_share": {str(k): v for k, v in w.share.items()},
                "revoke_after_s": w.revoke_after,
                "window_s": w.window,
                "calls": len(w.latencies),
                "latency_p50_s": quantile(w.latencies, 0.5),
                "latency_p99_s": quantile(w.latencies, 0.99),
                "revoked": w.revoked,
                "batch_items": w.items,
                "batch_completed": w.completed,
                "batch_job_s": w.batch_s,
            }
            for w in ways
        ],
        "headroom_and_revocation_p99_over_no_flood": over_baseline(base, both),
        "headroom_and_revocation_batch_completed": complete,
    }
    fig, axes = figure(1)
    latency_cdf(
        axes[0][0],
        [(w.label, w.latencies) for w in ways],
        f"interactive latency, wait + hold (ms); batch calls of {hold[0]:.0f}-{hold[1]:.0f} s",
    )
    save(NAME, opts, url, data, text, fig)
    goal = "interactive latency p99 with headroom + revocation / no flood (long batch)"
    return [
        *latency_headlines(ways, goal),
        Headline(
            "flood",
            "batch items completed with headroom + revocation",
            f"{complete:.1%}",
            f">= {COMPLETE:.0%}",
            complete >= COMPLETE,
        ),
    ]
