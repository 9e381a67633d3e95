"""handoff: release in process A -> the head waiter in process B resumes (limit 1).

N+1 participants spread round-robin over several spawned processes loop on
``async with gate.permit(): pass`` against a gate of limit 1, so one holds and about N are parked
at any time. Each records ``time.monotonic_ns()`` when its block starts (grant observed) and just
before it leaves the block (release starts); CLOCK_MONOTONIC is system-wide on Linux, so stamps
from different processes compare. With limit 1 holds are strictly sequential: sorted by grant,
the hand-off latency of hold i+1 is ``grant[i+1] - release[i]`` (a negative value would be two
holders at once and is counted as a violation). Only cross-process hand-offs are reported; they
cover one script call, the wake (RPUSH -> BLPOP reply) and the woken event loop's scheduling.
Targets: p50 <= 1 ms, p99 <= 5 ms at every N.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from itertools import pairwise
from typing import Any

import numpy as np

from fleetgate.keys import GateKeys

from ._cluster import CLUSTER_MASTERS, MODES, Target, target
from ._common import (
    Flavor,
    Headline,
    Options,
    figure,
    log,
    percentiles,
    save,
    table,
)
from ._handoff_segments import SEGMENTS, install, segments
from ._server import (
    PREFIX,
    command_split,
    configure_gate,
    watch,
)
from ._workers import (
    Sync,
    Workers,
    worker_fleet,
)

NAME = "handoff"
P50_MS, P99_MS = 1.0, 5.0
# issue 25's goal for the release-to-start p50 (standalone, worst over the sizes)
RELEASE_TO_START_MS = 0.3
PCTS = ("p50", "p99", "p99.9", "max")
STAGGER_NS = 2_000_000  # first acquires 2 ms apart, alternating processes
HOLD_S = 0.001


def participants(
    sync: Sync, url: str, gate: str, slots: list[int], seconds: float, flavor: Flavor
) -> Any:
    """Worker: one task per global slot number, chaining permits until ``seconds`` after start.

    Task with slot i first asks at start + i * STAGGER, so the FIFO order alternates processes
    (and keeps doing so: each releaser re-parks at the tail before the next release)."""

    stamps = install()

    async def main() -> tuple[list[tuple[int, int, str]], dict[str, int], Any]:
        holds: list[tuple[int, int, str]] = []
        async with worker_fleet(
            sync, url, flavor, connections=min(len(slots), 64), overdue_s=seconds + 20
        ) as run:
            g = run.fleet.gate(gate)
            start = run.start
            stop = start + int(seconds * 1e9)

            async def one(slot: int) -> None:
                await asyncio.sleep((start + slot * STAGGER_NS - time.monotonic_ns()) / 1e9)
                while True:
                    async with g.permit(deadline=None) as lease:
                        granted = time.monotonic_ns()
                        if granted > stop:
                            return  # drain: the queue empties hand-off by hand-off
                        # A short hold lets the previous holder re-park before we release, so
                        # about N stay parked and every grant is a hand-off.
                        await asyncio.sleep(HOLD_S)
                        holds.append((granted, time.monotonic_ns(), lease.id))

            await asyncio.gather(*(one(s) for s in slots))
            out = (holds, run.events, stamps.as_dict())
            sync.publish(out)
            return out

    return flavor.run(main())


def _one_size(target: Target, opts: Options, n_waiters: int) -> dict[str, Any]:
    gate = f"bench-handoff-{n_waiters}"
    node = target.node_for(GateKeys.of(PREFIX, gate).base)  # every key of the gate is there
    # fence=0 marks the gate as one with state (lua/lib_cfg.lua: born), so the first grants
    # are not held behind the recovery fence of a gate found empty, which on a Cluster every
    # new gate pays (the standalone server is marked old instead: private_redis).
    keys = configure_gate(
        node,
        gate,
        floor=1,
        ceiling=1,
        max_queued=n_waiters + 100,
        lease_ms=10_000,
        waiter_ms=5_000,
        fence=0,
    )
    n_procs = 2 if n_waiters == 1 else 4
    total = n_waiters + 1
    slots = [list(range(p, total, n_procs)) for p in range(n_procs)]
    ramp = total * STAGGER_NS / 1e9
    warm, seconds = opts.pick((ramp + 1.0, 20.0), (ramp + 0.5, 2.5))
    args = [(target.url, gate, s, warm + seconds, opts.flavor) for s in slots]
    others = [u for u in target.nodes if u != node]
    with Workers(participants, args) as w:
        start = w.go()
        lo, hi = start + int(warm * 1e9), start + int((warm + seconds) * 1e9)
        win = watch(node, keys, lo, hi, others=others)
        out = w.results(timeout=120)
    results = [h for h, _, _ in out]
    events = {k: sum(e[k] for _, e, _ in out) for k in out[0][1]}
    stamps = [s for _, _, s in out]
    holds = sorted((g, r, p, i) for p, hs in enumerate(results) for g, r, i in hs)
    cross: list[float] = []
    same: list[float] = []
    steps: list[dict[str, int]] = []
    violations = 0
    for (g0, r0, p0, i0), (g1, _, p1, i1) in pairwise(holds):
        if g0 < lo or g1 > hi:
            continue
        if g1 < r0:
            violations += 1
            continue
        (cross if p0 != p1 else same).append((g1 - r0) / 1e6)
        if p0 != p1:
            step = {"release": r0, "start": g1}
            for k in ("sent", "written", "replied"):
                if i0 in stamps[p0][k]:
                    step[k] = stamps[p0][k][i0]
            for k in ("arrived", "woken"):
                if stamps[p1][k].get(i1, 0) > 0:
                    step[k] = stamps[p1][k][i1]
            steps.append(step)
    handoffs = len(cross) + len(same)
    split_cmds = command_split(win)
    evalsha = win.counters.get("calls:evalsha", 0.0) + win.counters.get("calls:fcall", 0.0)
    queued = [q for _, q in win.samples]
    return {
        "mode": target.mode,
        "waiters": n_waiters,
        "processes": n_procs,
        "tasks_per_process": [len(x) for x in slots],
        "mean_queue_sampled": float(np.mean(queued)) if queued else 0.0,
        "handoffs": handoffs,
        "handoffs_per_s": handoffs / win.seconds,
        "cross_process": len(cross),
        "latency_ms": {**percentiles(cross), "mean": float(np.mean(cross)), "max": max(cross)},
        "same_process_latency_ms": percentiles(same),
        "violations": violations,
        "client_warnings": events,
        "workers_stuck_in_close": len(w.stuck),
        "client_round_trips_per_handoff": split_cmds["client"] / max(1, handoffs),
        "script_internal_cmds_per_handoff": split_cmds["internal"] / max(1, handoffs),
        "lua_us_per_evalsha": (
            win.counters.get("usec:evalsha", 0.0) + win.counters.get("usec:fcall", 0.0)
        )
        / max(1.0, evalsha),
        "slow_scripts_us": {k: sorted(v)[-20:] for k, v in win.slow.items()},
        "slow_script_counts": {k: len(v) for k, v in win.slow.items()},
        "segments_us": segments(steps),
        "_cdf": sorted(cross),
    }


def _latency(p: str) -> Callable[[dict[str, Any]], Any]:
    return lambda r: r["latency_ms"][p]


COLUMNS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "mode": lambda r: r["mode"],
    "waiters": lambda r: r["waiters"],
    "queued": lambda r: r["mean_queue_sampled"],
    "procs": lambda r: r["processes"],
    "samples": lambda r: r["cross_process"],
    "handoffs/s": lambda r: r["handoffs_per_s"],
    **{f"{p} ms": _latency(p) for p in PCTS},
    "RTT/handoff": lambda r: r["client_round_trips_per_handoff"],
    "overlaps": lambda r: r["violations"],
    "warnings": lambda r: "/".join(
        map(str, [*r["client_warnings"].values(), r["workers_stuck_in_close"]])
    ),
    "scripts>0.5ms": lambda r: (
        ", ".join(f"{k}:{v}" for k, v in sorted(r["slow_script_counts"].items())) or "-"
    ),
}


def segment_table(res: list[dict[str, Any]]) -> str:
    """The segment breakdown (``_handoff_segments.py``): p50 / p99 µs of each, by mode and size."""
    rows = [
        [r["mode"], r["waiters"], int(r["segments_us"]["total"]["n"])]
        + [f"{r['segments_us'][k]['p50']:.0f} / {r['segments_us'][k]['p99']:.0f}" for k in SEGMENTS]
        for r in res
    ]
    text = table(["mode", "waiters", "n", *(f"{k} µs" for k in SEGMENTS)], rows)
    return text + (
        "\np50 / p99 per segment of each cross-process hand-off (release = the holder leaves its "
        "block, sent = its release's script call starts, replied = that call's reply decoded by "
        "the releaser, woken = the waiter's process dispatches the wake, start = the next "
        "holder's block runs)"
    )


def _sizes(mode: str, opts: Options) -> tuple[int, ...]:
    # The Cluster part of --quick stays short (CI runs it): a cluster start and two sizes.
    return (1, 10) if opts.quick and mode == "cluster" else (1, 10, 100, 1000)


def _plot(res: list[dict[str, Any]], opts: Options) -> Any:
    fig, ax = figure(3)
    for r in res:
        cdf = np.asarray(r.pop("_cdf"))
        style = "-" if r["mode"] == "standalone" else "--"
        label = f"{r['mode']}, {r['waiters']} waiters"
        ax[0][0].plot(cdf, np.linspace(0, 1, len(cdf)), style, label=label)
    ax[0][0].set_xscale("log")
    ax[0][0].set_xlabel("hand-off latency (ms, release start -> grant observed)")
    ax[0][0].set_ylabel("CDF")
    ax[0][0].axvline(P50_MS, color="grey", ls=":")
    ax[0][0].axvline(P99_MS, color="grey", ls="--")
    ax[0][0].legend(fontsize=7)
    for mode in MODES:
        rows = [r for r in res if r["mode"] == mode]
        for p, style in (("p50", "o"), ("p99", "s"), ("p99.9", "^")):
            line = "-" if mode == "standalone" else "--"
            xs, ys = [r["waiters"] for r in rows], [r["latency_ms"][p] for r in rows]
            ax[0][1].plot(xs, ys, style + line, label=f"{mode} {p}")
    ax[0][1].set_xscale("log")
    ax[0][1].set_yscale("log")
    ax[0][1].set_xlabel("parked waiters")
    ax[0][1].set_ylabel("ms")
    ax[0][1].legend(fontsize=7)
    names = [k for k in SEGMENTS if not k.startswith("(") and k != "total"]
    bottom = np.zeros(len(res))
    for k in names:
        vals = np.asarray([r["segments_us"][k]["p50"] for r in res])
        ax[0][2].bar(range(len(res)), vals, bottom=bottom, label=k)
        bottom += vals
    ax[0][2].set_xticks(range(len(res)), [f"{r['mode'][:4]} {r['waiters']}" for r in res])
    ax[0][2].set_ylabel("µs (p50 of each segment)")
    ax[0][2].axhline(RELEASE_TO_START_MS * 1000, color="grey", ls=":")
    ax[0][2].legend(fontsize=7)
    fig.suptitle(f"hand-off latency, limit 1, standalone and Cluster ({opts.flavor.label})")
    return fig


def run(opts: Options) -> list[Headline]:
    res: list[dict[str, Any]] = []
    for mode in MODES:  # the Cluster last: save() describes the machine from a live node
        with target(mode) as t:
            for n in _sizes(mode, opts):
                res.append(_one_size(t, opts, n))
                lat = res[-1]["latency_ms"]
                log(f"{NAME}: {mode}, {n} waiters: p50 {lat['p50']:.3f} ms p99 {lat['p99']:.3f} ms")
            if mode != MODES[-1]:
                continue
            text = table(list(COLUMNS), [[f(r) for f in COLUMNS.values()] for r in res])
            text += (
                "\nwarnings = client log lines fallback/requeue/lease-lost, then workers stuck in "
                "Fleet.close() (0/0/0/0 = clean)\n\n"
            ) + segment_table(res)
            fig = _plot(res, opts)
            targets = {"p50": P50_MS, "p99": P99_MS, "release_to_start_p50": RELEASE_TO_START_MS}
            data = {"sizes": res, "targets_ms": targets}
            save(NAME, opts, t.nodes[0], {**data, "cluster_masters": CLUSTER_MASTERS}, text, fig)
    heads: list[Headline] = []
    for mode in MODES:
        rows = [r for r in res if r["mode"] == mode]
        worst50 = max(r["latency_ms"]["p50"] for r in rows)
        worst99 = max(r["latency_ms"]["p99"] for r in rows)
        overlaps = sum(r["violations"] for r in rows)
        span = f"{rows[0]['waiters']}..{rows[-1]['waiters']}"
        heads += [
            Headline(
                NAME,
                f"{mode}: hand-off p50, worst over {span} waiters",
                f"{worst50:.3f} ms",
                f"<= {P50_MS} ms",
                worst50 <= P50_MS,
            ),
            Headline(
                NAME,
                f"{mode}: hand-off p99, worst over {span} waiters",
                f"{worst99:.3f} ms",
                f"<= {P99_MS} ms",
                worst99 <= P99_MS,
            ),
            Headline(
                NAME, f"{mode}: two holders at once (limit 1)", str(overlaps), "0", overlaps == 0
            ),
        ]
        if mode == "standalone":
            heads.append(
                Headline(
                    NAME,
                    f"{mode}: release-to-start p50, worst over {span} waiters (issue 25)",
                    f"{worst50:.3f} ms",
                    f"<= {RELEASE_TO_START_MS} ms",
                    worst50 <= RELEASE_TO_START_MS,
                )
            )
    return heads


if __name__ == "__main__":
    import sys

    from ._common import main

    sys.exit(main(only=[NAME]))
