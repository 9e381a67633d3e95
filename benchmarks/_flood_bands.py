"""flood, the bands part: interactive calls against a batch flood, four ways in one run.

One gate of ``FLOOR`` units. ``BATCH`` closed-loop batch callers hold their permit a uniform
1-3 s each (calls of seconds), enough to keep the gate full; ``INTERACTIVE`` closed-loop
interactive callers hold theirs a uniform 50-200 ms and think 0.1-0.3 s between calls. The
same load, one way after the other, each on its own gate:

* **no flood**: the interactive callers alone (the baseline);
* **no bands**: both at priority 0: an interactive call queues behind the batch backlog;
* **strict bands**: interactive at priority 10: it goes first, but waits for a batch call to
  end, since the batch fills every unit;
* **headroom**: strict bands and ``band_share={0: SHARE}``: the batch band may hold
  ``SHARE`` of the gate, the rest stays free for the interactive calls.

Figures per way over a window after a warm-up: the interactive calls' wait and latency (wait +
hold: what a user sees as time to first token) p50/p99, and the batch calls completed per
second (what the headroom costs the batch). Goal: with headroom, the interactive latency p99 at
most 1.5x the no-flood baseline's. (Their wait p99 is reported too: both ways it is a Redis round
trip, about a millisecond, so its ratio measures the noise of the machine, not the gate.)
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

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
from ._server import private_redis

NAME = "flood_bands"
FLOOR, BATCH, INTERACTIVE = 8, 16, 4
BATCH_HOLD_S, HOLD_S, THINK_S = (1.0, 3.0), (0.05, 0.2), (0.1, 0.3)
SHARE = 0.625
TARGET = 1.5


@dataclass
class Way:
    label: str
    batch: bool  # a batch flood runs
    priority: int  # the interactive calls'
    share: dict[int, float]
    window: float = 0.0
    waits: list[float] = field(default_factory=list)  # interactive
    latencies: list[float] = field(default_factory=list)  # interactive: wait + hold
    batch_done: int = 0


class Interactive(Protocol):
    """A way of a flood part: its label and its interactive calls' latencies (s)."""

    label: str
    latencies: list[float]


def over_baseline(base: Interactive, way: Interactive) -> float:
    """``way``'s interactive latency p99 over ``base``'s (the no-flood baseline); inf without a
    baseline."""
    base_p99 = quantile(base.latencies, 0.99)
    return quantile(way.latencies, 0.99) / base_p99 if base_p99 else float("inf")


def p50_p99_ms(xs: Sequence[float], digits: int = 0) -> str:
    """The p50 and p99 of ``xs`` (s) as 'p50 / p99' in ms, with ``digits`` decimals."""
    return f"{quantile(xs, 0.5) * 1000:.{digits}f} / {quantile(xs, 0.99) * 1000:.{digits}f}"


def latency_headlines(ways: Sequence[Interactive], goal: str) -> list[Headline]:
    """A flood part's headlines on its interactive latency: the last way's p99 over the first's
    (the no-flood baseline) against ``TARGET`` (the figure named ``goal``), and every flooded
    way's p99 in ms."""
    ratio = over_baseline(ways[0], ways[-1])
    return [
        Headline("flood", goal, f"{ratio:.2f}", f"<= {TARGET}", ratio <= TARGET),
        Headline(
            "flood",
            f"interactive latency p99 ({'; '.join(w.label for w in ways[1:])}), ms",
            "; ".join(f"{quantile(w.latencies, 0.99) * 1000:.0f}" for w in ways[1:]),
            "-",
            None,
        ),
    ]


async def _run_way(url: str, way: Way, warm: float, window: float, flavor: Flavor) -> None:
    rng = random.Random(20261203)
    async with open_fleet(url, flavor) as fleet:
        gate = fleet.gate(
            f"flood-bands-{way.label.replace(' ', '-')}",
            floor=FLOOR,
            max_queued=10_000,
            band_share=way.share,
        )
        t0 = time.monotonic()
        start, stop = t0 + warm, t0 + warm + window

        async def batch() -> None:
            while time.monotonic() < stop:
                async with gate.permit(deadline=None):
                    await asyncio.sleep(rng.uniform(*BATCH_HOLD_S))
                if time.monotonic() >= start:
                    way.batch_done += 1

        async def interactive() -> None:
            while time.monotonic() < stop:
                asked = time.monotonic()
                async with gate.permit(deadline=30, priority=way.priority):
                    waited = time.monotonic() - asked
                    await asyncio.sleep(rng.uniform(*HOLD_S))
                if asked >= start:
                    way.waits.append(waited)
                    way.latencies.append(time.monotonic() - asked)
                await asyncio.sleep(rng.uniform(*THINK_S))

        callers = [interactive() for _ in range(INTERACTIVE)]
        if way.batch:
            callers += [batch() for _ in range(BATCH)]
        await asyncio.gather(*callers)
        way.window = window


def run(opts: Options) -> list[Headline]:
    """The four ways, one after the other, on a private redis-server."""
    warm, window = opts.pick((8.0, 40.0), (4.0, 14.0))
    ways = [
        Way("no flood", False, 10, {}),
        Way("no bands", True, 0, {}),
        Way("strict bands", True, 10, {}),
        Way("headroom", True, 10, {0: SHARE}),
    ]
    with private_redis() as rp:
        for way in ways:
            log(f"{NAME}: {way.label} ({warm:.0f} s warm-up, {window:.0f} s window)")
            opts.flavor.run(_run_way(rp.url, way, warm, window, opts.flavor))
        return _report(opts, rp.url, ways)


def _report(opts: Options, url: str, ways: list[Way]) -> list[Headline]:
    base = ways[0]
    rows = [
        (
            w.label,
            p50_p99_ms(w.waits, 1),
            p50_p99_ms(w.latencies),
            f"{over_baseline(base, w):.2f}",
            len(w.latencies),
            f"{w.batch_done / w.window:.2f}" if w.window else "-",
        )
        for w in ways
    ]
    text = table(
        (
            "way",
            "interactive wait p50/p99 ms",
            "latency p50/p99 ms",
            "p99 / no flood",
            "calls",
            "batch done/s",
        ),
        rows,
    )
    data: dict[str, Any] = {
        "floor": FLOOR,
        "batch_callers": BATCH,
        "interactive_callers": INTERACTIVE,
        "batch_hold_s": BATCH_HOLD_S,
        "hold_s": HOLD_S,
        "think_s": THINK_S,
        "share": SHARE,
        "ways": [
            {
                "way": w.label,
                "interactive_priority": w.priority,
                "band_share": {str(k): v for k, v in w.share.items()},
                "window_s": w.window,
                "calls": len(w.latencies),
                "wait_p50_s": quantile(w.waits, 0.5),
                "wait_p99_s": quantile(w.waits, 0.99),
                "latency_p50_s": quantile(w.latencies, 0.5),
                "latency_p99_s": quantile(w.latencies, 0.99),
                "batch_done_per_s": w.batch_done / w.window if w.window else 0.0,
            }
            for w in ways
        ],
        "headroom_p99_over_no_flood": over_baseline(base, ways[-1]),
    }
    fig, axes = figure(2)
    curves = [(w.label, w.latencies) for w in ways]
    latency_cdf(axes[0][0], curves, "interactive latency, wait + hold (ms)")
    ax = axes[0][1]
    ax.bar([w.label for w in ways], [w.batch_done / w.window if w.window else 0 for w in ways])
    ax.set_ylabel("batch calls done per second")
    save(NAME, opts, url, data, text, fig)
    return latency_headlines(ways, "interactive latency p99 with headroom / no flood")
