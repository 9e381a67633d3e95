"""flood: deadline-aware admission against waiting deadlines out, (``_flood_bands.py``)
interactive calls against a batch flood with and without headroom between bands, and
(``_flood_revoke.py``) against long batch calls with revocation, in one run.

One gate of ``FLOOR`` units and ``CALLERS`` closed-loop callers from one client process, each
call holding its permit for a uniform 0.1-0.3 s (the gate drains ~20 calls/s) and asking with a
deadline from a mix: 30 % can wait ``LONG_DEADLINE`` s (they always make it), 70 % a uniform
0.2-3 s, about what the queue ahead costs (~36 callers waiting at ~20 grants/s: ~1.8 s), so
many of them cannot make it. Two ways, the same load, one after the other on their own gates:

* **off** (``deadline_admission=False``): every call that fits the queue waits; one whose
  deadline passes first gets ``DeadlineExceeded`` after waiting it out;
* **on** (the default): a call that would start after its deadline, by the gate's measured
  drain and the waiters ahead of it, gets ``DeadlineUnreachable`` at once.

A caller thinks 0-0.1 s after every outcome, so a refusal does not turn into a spin.

Then the returns: ``RETURN_CALLERS`` callers arrive at once at a gate whose wait list is full,
are refused with ``Overloaded`` and come back after its ``retry_after`` (the gate's estimate of
when a place frees for each of them, behind those refused before it). Goal: their returns
spread over at least ``SPREAD_S`` seconds, no 100 ms with more than ``BUCKET_SHARE`` of them.

Figures per way over a window after a warm-up: calls completed per second (granted in time);
calls that waited their deadline out and the seconds they wasted waiting (the figure admission
removes); calls refused at once; the wait of the calls granted (p50, p99). Goals (the on way):
no call waits its deadline out beyond 1 % of the calls, and false refusals -- here bounded by
the calls the off way completed in time that the on way did not, per call -- at most 1 %.
"""

from __future__ import annotations

import asyncio
import bisect
import random
import time
from dataclasses import dataclass, field
from typing import Any

from fleetgate.client import DeadlineExceeded, DeadlineUnreachable, Overloaded

from . import _flood_bands, _flood_revoke
from ._common import Flavor, Headline, Options, figure, log, open_fleet, quantile, save, table
from ._server import private_redis

NAME = "flood"
FLOOR, CALLERS = 4, 40
HOLD_S = (0.1, 0.3)
LONG_DEADLINE, SHORT_DEADLINE_S, SHORT_SHARE = 10.0, (0.2, 3.0), 0.7
THINK_S = 0.1
TARGET = 0.01
# the returns of callers refused together: how many, the wait list they find full, the goals
RETURN_CALLERS, RETURN_QUEUE = 100, 20
SPREAD_S, BUCKET_SHARE = 2.0, 0.2


@dataclass
class Way:
    label: str
    admission: bool
    window: float = 0.0
    granted_waits: list[float] = field(default_factory=list)
    #: (deadline, seconds waited) of the calls whose deadline passed while they waited
    expired: list[tuple[float, float]] = field(default_factory=list)
    #: (deadline, expected wait) of the calls refused at once
    refused: list[tuple[float, float]] = field(default_factory=list)
    overloaded: int = 0

    @property
    def calls(self) -> int:
        return len(self.granted_waits) + len(self.expired) + len(self.refused) + self.overloaded

    def per_s(self, n: int) -> float:
        return n / self.window if self.window else 0.0


async def _run_way(url: str, way: Way, warm: float, window: float, flavor: Flavor) -> None:
    """Drive the load through ``way``'s gate for ``warm + window`` s; record the window."""
    rng = random.Random(20261203)
    async with open_fleet(url, flavor) as fleet:
        gate = fleet.gate(
            f"flood-{way.label}", floor=FLOOR, max_queued=10_000, deadline_admission=way.admission
        )
        t0 = time.monotonic()
        start, stop = t0 + warm, t0 + warm + window

        async def caller() -> None:
            while time.monotonic() < stop:
                short = rng.random() < SHORT_SHARE
                deadline = rng.uniform(*SHORT_DEADLINE_S) if short else LONG_DEADLINE
                asked = time.monotonic()
                counted = asked >= start
                try:
                    async with gate.permit(deadline=deadline):
                        waited = time.monotonic() - asked
                        await asyncio.sleep(rng.uniform(*HOLD_S))
                    if counted:
                        way.granted_waits.append(waited)
                except DeadlineUnreachable as exc:
                    if counted:
                        way.refused.append((deadline, exc.expected_wait))
                except DeadlineExceeded:
                    if counted:
                        way.expired.append((deadline, time.monotonic() - asked))
                except Overloaded:
                    way.overloaded += counted
                await asyncio.sleep(rng.uniform(0, THINK_S))

        await asyncio.gather(*(caller() for _ in range(CALLERS)))
        way.window = window


async def _returns(url: str, flavor: Flavor, warm: float) -> list[float]:
    """The computed Retry-After: ``RETURN_CALLERS`` callers arrive at once at a gate whose wait
    list is full (``RETURN_QUEUE`` waiters behind ``FLOOR`` units, kept so by closed-loop callers
    of the deadline mix's calls), are refused with ``Overloaded``, wait its ``retry_after`` and
    come back: when each came back, in seconds after the burst."""
    rng = random.Random(3)
    async with open_fleet(url, flavor) as fleet:
        gate = fleet.gate("flood-returns", floor=FLOOR, max_queued=RETURN_QUEUE)
        stop = asyncio.Event()

        async def background() -> None:
            while not stop.is_set():
                try:
                    async with gate.permit(deadline=LONG_DEADLINE):
                        await asyncio.sleep(rng.uniform(*HOLD_S))
                except Overloaded:
                    await asyncio.sleep(rng.uniform(0, THINK_S))

        tasks = [asyncio.create_task(background()) for _ in range(FLOOR + RETURN_QUEUE)]
        await asyncio.sleep(warm)  # the drain is measured, the list full
        t0 = time.monotonic()

        async def comer() -> float | None:
            try:
                async with gate.permit(deadline=LONG_DEADLINE):
                    return None  # a place happened to be free
            except Overloaded as exc:
                await asyncio.sleep(exc.retry_after if exc.retry_after is not None else 1.0)
                return time.monotonic() - t0

        back = await asyncio.gather(*(comer() for _ in range(RETURN_CALLERS)))
        stop.set()
        await asyncio.gather(*tasks)
    return [b for b in back if b is not None]


def _spread(back: list[float]) -> tuple[float, float]:
    """(seconds between the first and the last return, the largest share of them in one
    100 ms bucket)."""
    if not back:
        return 0.0, 1.0
    buckets: dict[int, int] = {}
    for b in back:
        buckets[int(b * 10)] = buckets.get(int(b * 10), 0) + 1
    return max(back) - min(back), max(buckets.values()) / len(back)


def run(opts: Options) -> list[Headline]:
    """The deadline mix (two ways) and the returns of callers refused together, then the bands
    part (``benchmarks/_flood_bands.py``) and the revocation part (``_flood_revoke.py``)."""
    warm, window = opts.pick((10.0, 40.0), (5.0, 15.0))
    ways = [Way("off", False), Way("on", True)]
    with private_redis() as rp:
        for way in ways:
            log(f"{NAME}: admission {way.label} ({warm:.0f} s warm-up, {window:.0f} s window)")
            opts.flavor.run(_run_way(rp.url, way, warm, window, opts.flavor))
        log(f"{NAME}: {RETURN_CALLERS} callers refused at once by a full wait list")
        back = opts.flavor.run(_returns(rp.url, opts.flavor, warm))
        headlines = _report(opts, rp.url, ways, back)
    return headlines + _flood_bands.run(opts) + _flood_revoke.run(opts)


def _report(opts: Options, url: str, ways: list[Way], back: list[float]) -> list[Headline]:
    off, on = ways
    spread, bucket = _spread(back)
    rows = [
        (
            w.label,
            f"{w.per_s(len(w.granted_waits)):.1f}",
            len(w.expired),
            f"{sum(s for _, s in w.expired):.1f}",
            len(w.refused),
            f"{quantile(w.granted_waits, 0.5) * 1000:.0f} / "
            f"{quantile(w.granted_waits, 0.99) * 1000:.0f}",
            w.calls,
        )
        for w in ways
    ]
    text = table(
        ("admission", "granted/s", "waited out", "s wasted", "refused", "wait p50/p99 ms", "calls"),
        rows,
    )
    expired_share = len(on.expired) / on.calls if on.calls else 1.0
    # calls completed in time per second that the off way had and the on way lacked, per call of
    # the on way: every refusal that cost a completion is at most that
    lost = max(0.0, off.per_s(len(off.granted_waits)) - on.per_s(len(on.granted_waits)))
    false_share = lost * on.window / on.calls if on.calls else 1.0
    # and per refused call, the chance it would have started in time had it parked: the share of
    # the on way's granted calls that waited less than its deadline (a waiter's wait does not
    # depend on its own deadline), summed, per call
    waits = sorted(on.granted_waits)
    likely = sum(bisect.bisect_left(waits, d) / len(waits) for d, _ in on.refused) if waits else 0
    likely_share = likely / on.calls if on.calls else 1.0
    text += (
        f"\nadmission on: {expired_share:.2%} of the calls waited their deadline out "
        f"(off: {len(off.expired) / off.calls if off.calls else 0:.2%}, wasting "
        f"{sum(s for _, s in off.expired):.1f} s); false refusals at most {false_share:.2%} "
        f"(completions off {off.per_s(len(off.granted_waits)):.2f}/s, on "
        f"{on.per_s(len(on.granted_waits)):.2f}/s); refusals that would likely have started in "
        f"time by the on way's waits: {likely_share:.2%} of the calls\n"
        f"{len(back)} of {RETURN_CALLERS} callers refused at once by a full wait list came back "
        f"over {spread:.2f} s (Overloaded.retry_after), at most {bucket:.0%} of them in one "
        "100 ms"
    )
    data: dict[str, Any] = {
        "floor": FLOOR,
        "callers": CALLERS,
        "hold_s": HOLD_S,
        "long_deadline_s": LONG_DEADLINE,
        "short_deadline_s": SHORT_DEADLINE_S,
        "short_share": SHORT_SHARE,
        "ways": [
            {
                "admission": w.admission,
                "window_s": w.window,
                "granted": len(w.granted_waits),
                "granted_per_s": w.per_s(len(w.granted_waits)),
                "waited_out": len(w.expired),
                "seconds_wasted": sum(s for _, s in w.expired),
                "refused": len(w.refused),
                "overloaded": w.overloaded,
                "wait_p50_s": quantile(w.granted_waits, 0.5),
                "wait_p99_s": quantile(w.granted_waits, 0.99),
                "refused_samples": w.refused[:200],
                "expired_samples": w.expired[:200],
            }
            for w in ways
        ],
        "waited_out_share_on": expired_share,
        "false_refusals_at_most": false_share,
        "refusals_likely_in_time": likely_share,
        "returns": {
            "callers": RETURN_CALLERS,
            "refused": len(back),
            "back_after_s": sorted(back),
            "spread_s": spread,
            "largest_100ms_share": bucket,
        },
    }
    fig, axes = figure(3)
    ax = axes[0][2]
    ax.hist(back, bins=[i / 10 for i in range(int(max(back, default=1) * 10) + 2)])
    ax.set_xlabel("return after the refusal (s)")
    ax.set_ylabel(f"callers of {RETURN_CALLERS} refused at once (100 ms bins)")
    ax = axes[0][0]
    for w in ways:
        ax.hist(
            [x * 1000 for x in w.granted_waits], bins=40, alpha=0.6, label=f"admission {w.label}"
        )
    ax.set_xlabel("wait of the calls granted (ms)")
    ax.set_ylabel("calls")
    ax.legend()
    ax = axes[0][1]
    labels = ["granted", "waited out", "refused at once"]
    for i, w in enumerate(ways):
        counts = [len(w.granted_waits), len(w.expired), len(w.refused)]
        ax.bar([x + 0.4 * i for x in range(3)], counts, width=0.4, label=f"admission {w.label}")
    ax.set_xticks([x + 0.2 for x in range(3)], labels)
    ax.set_ylabel("calls in the window")
    ax.legend()
    save(NAME, opts, url, data, text, fig)
    return [
        Headline(
            NAME,
            "calls that waited their deadline out (admission on)",
            f"{expired_share:.2%}",
            f"<= {TARGET:.0%}",
            expired_share <= TARGET,
        ),
        Headline(
            NAME,
            "false refusals, at most (completions off - on, per call)",
            f"{false_share:.2%}",
            f"<= {TARGET:.0%}",
            false_share <= TARGET,
        ),
        Headline(
            NAME,
            "refusals likely in time (by the on way's waits), per call",
            f"{likely_share:.2%}",
            f"<= {TARGET:.0%}",
            likely_share <= TARGET,
        ),
        Headline(
            NAME,
            f"returns of {RETURN_CALLERS} callers refused at once: spread s; largest 100 ms",
            f"{spread:.2f}; {bucket:.0%}",
            f">= {SPREAD_S:.0f}; <= {BUCKET_SHARE:.0%}",
            spread >= SPREAD_S and bucket <= BUCKET_SHARE,
        ),
        Headline(
            NAME,
            "seconds wasted waiting deadlines out (off; on)",
            f"{sum(s for _, s in off.expired):.1f}; {sum(s for _, s in on.expired):.1f}",
            "-",
            None,
        ),
    ]
