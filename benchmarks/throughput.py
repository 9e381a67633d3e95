"""throughput: 4 processes x 250 concurrent acquirers, limit 32, 20 ms hold, fixed duration.

Each acquirer loops ``async with gate.permit(): await asyncio.sleep(0.020)`` and records when it
asked, when its block started and when it left. Over the measured window (after a warm-up):

* grants/s vs the ideal limit / hold = 1600/s;
* utilisation, two ways: client-observed (time spent inside blocks / (limit x window): what the
  model server would see) and Redis-side (ZCARD holders sampled at 100 Hz / limit; a hand-off
  counts in Redis before the woken pod knows, so this one reads high by construction);
* wait p50/p99 vs the FIFO ideal (mean sampled queue length / ideal rate);
* Redis commands per grant from INFO commandstats deltas, split into client round trips
  (evalsha, blpop, ...) and commands run inside scripts (counted separately by commandstats);
* Lua µs per grant (``cmdstat_evalsha`` usec / grants; includes heartbeats).
Targets: utilisation >= 0.98, <= 4 client round trips per grant.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import numpy as np

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
from ._server import (
    CLIENT_COMMANDS,
    command_split,
    configure_gate,
    private_redis,
    watch,
)
from ._workers import (
    Sync,
    Workers,
    cpu_during,
    worker_fleet,
)

NAME = "throughput"
GATE = "bench-throughput"
PROCS, TASKS, LIMIT, HOLD_S = 4, 250, 32, 0.020
UTIL_TARGET, RTT_TARGET = 0.98, 4.0


def acquirers(
    sync: Sync, url: str, gate: str, n: int, warm: float, seconds: float, flavor: Flavor
) -> Any:
    """Worker: ``n`` tasks looping acquire / hold / release until warm + seconds after the start.

    Returns (asked, granted, left, token) per hold, the CPU seconds used in the window and the
    counts of client warnings (fallback, requeue, lease lost)."""

    async def main() -> tuple[list[tuple[int, int, int, int]], float, dict[str, int]]:
        recs: list[tuple[int, int, int, int]] = []
        async with worker_fleet(
            sync, url, flavor, connections=n, overdue_s=warm + seconds + 20
        ) as run:
            g = run.fleet.gate(gate)
            start = run.start
            stop = start + int((warm + seconds) * 1e9)
            cpu = asyncio.create_task(cpu_during(start + int(warm * 1e9), stop))

            async def one() -> None:
                while (asked := time.monotonic_ns()) < stop:
                    async with g.permit(deadline=60.0) as lease:
                        granted = time.monotonic_ns()
                        if granted < stop:
                            await asyncio.sleep(HOLD_S)
                        recs.append((asked, granted, time.monotonic_ns(), lease.token))

            await asyncio.gather(*(one() for _ in range(n)))
            result = (recs, await cpu, run.events)
            sync.publish(result)
            return result

    return flavor.run(main())


def handoff_gaps(recs: np.ndarray, lo: int, hi: int) -> dict[str, float]:
    """Release start -> grant observed, pairing releases with hand-off grants.

    While the queue never empties, every release hands its slot to the head waiter inside the
    release script, and heads are served in token (FIFO) order: the k-th release in time order
    grants the k-th waiter in token order after the first LIMIT immediate grants. Releases a few
    µs apart may pair crosswise; percentiles are unaffected at the ms scale."""
    releases = np.sort(recs[:, 2])
    grants = recs[np.argsort(recs[:, 3]), 1][LIMIT:]
    n = min(len(releases), len(grants))
    releases, grants = releases[:n], grants[:n]
    keep = (releases >= lo) & (grants < hi)
    return percentiles((grants[keep] - releases[keep]) / 1e6)


def configure_workload(url: str, gate: str) -> Any:
    """The workload's gate: a fixed limit of LIMIT, room in the queue for every task (also used
    by the peers benchmark, which runs the same workload)."""
    return configure_gate(
        url,
        gate,
        floor=LIMIT,
        ceiling=LIMIT,
        max_queued=2 * PROCS * TASKS,
        lease_ms=10_000,
        waiter_ms=5_000,
    )


def run(opts: Options) -> list[Headline]:
    warm, seconds = opts.pick((2.0, 10.0), (1.5, 3.0))
    ideal = LIMIT / HOLD_S
    with private_redis() as rp:
        keys = configure_workload(rp.url, GATE)
        args = [(rp.url, GATE, TASKS, warm, seconds, opts.flavor)] * PROCS
        with Workers(acquirers, args) as w:
            start = w.go()
            lo, hi = start + int(warm * 1e9), start + int((warm + seconds) * 1e9)
            log(f"{NAME}: {PROCS}x{TASKS} acquirers, measuring {seconds:.0f} s after {warm} s")
            win = watch(rp.url, keys, lo, hi)
            out = w.results(timeout=120)
        recs = np.array([r for rs, _, _ in out for r in rs], dtype=np.int64)
        client_cpu = sum(c for _, c, _ in out)
        events = {k: sum(e[k] for _, _, e in out) for k in out[0][2]}
        asked, granted, left = recs[:, 0], recs[:, 1], recs[:, 2]
        gap = handoff_gaps(recs, lo, hi)
        in_win = (granted >= lo) & (granted < hi)
        busy = np.clip(np.minimum(left, hi) - np.maximum(granted, lo), 0, None).sum() / 1e9
        util_client = busy / (LIMIT * win.seconds)
        holders = np.array([h for h, _ in win.samples])
        queued = np.array([q for _, q in win.samples])
        util_redis = float(holders.mean()) / LIMIT
        grants_redis = win.counters.get("stat:granted", 0.0)
        rate = in_win.sum() / win.seconds
        waits = (granted[in_win] - asked[in_win]) / 1e6
        wait = percentiles(waits)
        fifo_ideal_ms = float(queued.mean()) / ideal * 1000
        cmds = command_split(win)
        per = max(1.0, grants_redis)
        res = {
            "window_s": win.seconds,
            "grants": int(in_win.sum()),
            "grants_per_s": rate,
            "ideal_grants_per_s": ideal,
            "rate_vs_ideal": rate / ideal,
            "grants_redis_stats": grants_redis,
            "utilisation_client": util_client,
            "utilisation_redis_sampled": util_redis,
            "mean_queue": float(queued.mean()),
            "handoff_gap_ms": gap,
            "wait_ms": {**wait, "mean": float(waits.mean())},
            "fifo_ideal_wait_ms": fifo_ideal_ms,
            "wait_p50_vs_ideal": wait["p50"] / fifo_ideal_ms,
            "wait_p99_vs_ideal": wait["p99"] / fifo_ideal_ms,
            # FIFO at the rate actually reached (Little): isolates fairness from the rate.
            "fifo_wait_at_measured_rate_ms": float(queued.mean()) / rate * 1000,
            "wait_p99_vs_p50": wait["p99"] / wait["p50"],
            "client_round_trips_per_grant": cmds["client"] / per,
            "round_trips": {
                c: win.counters.get(f"calls:{c}", 0.0) / per for c in ("evalsha", "blpop")
            },
            "script_internal_cmds_per_grant": cmds["internal"] / per,
            "all_cmds_per_grant": (cmds["client"] + cmds["internal"]) / per,
            "lua_us_per_grant": _lua_usec(win.counters) / per,
            "lua_us_per_evalsha": _lua_usec(win.counters)
            / max(
                1.0, win.counters.get("calls:evalsha", 0.0) + win.counters.get("calls:fcall", 0.0)
            ),
            # Server time in commands clients sent (script-internal time is inside evalsha's).
            "redis_busy_fraction": sum(win.counters.get(f"usec:{c}", 0.0) for c in CLIENT_COMMANDS)
            / 1e6
            / win.seconds,
            "client_cpu_fraction_of_machine": client_cpu / win.seconds / (os.cpu_count() or 1),
            "client_cpu_us_per_grant": client_cpu / per * 1e6,
            "redis_cpu_us_per_grant": win.counters.get("cpu:redis", 0.0) / per * 1e6,
            "machine_cpu_busy": (client_cpu + win.counters.get("cpu:redis", 0.0))
            / win.seconds
            / (os.cpu_count() or 1),
            "machine_cpu_busy_all_processes": win.machine_busy,
            "client_warnings": events,
            "workers_stuck_in_close": len(w.stuck),
            "slow_script_counts": {k: len(v) for k, v in win.slow.items()},
            "slow_scripts_us": {k: sorted(v)[-20:] for k, v in win.slow.items()},
        }
        rows = [
            ("grants/s", rate, f"ideal {ideal:.0f}", rate / ideal),
            ("utilisation (client blocks)", util_client, f">= {UTIL_TARGET}", None),
            ("utilisation (Redis ZCARD)", util_redis, "-", None),
            (
                "wait p50 ms",
                wait["p50"],
                f"FIFO ideal {fifo_ideal_ms:.0f}",
                res["wait_p50_vs_ideal"],
            ),
            (
                "wait p99 ms",
                wait["p99"],
                f"FIFO ideal {fifo_ideal_ms:.0f}",
                res["wait_p99_vs_ideal"],
            ),
            (
                "wait p50 ms vs queue / measured rate",
                wait["p50"],
                f"{res['fifo_wait_at_measured_rate_ms']:.0f}",
                wait["p50"] / res["fifo_wait_at_measured_rate_ms"],
            ),
            ("hand-off gap p50 ms", gap["p50"], "-", None),
            ("hand-off gap p99 ms", gap["p99"], "-", None),
            (
                "client round trips / grant",
                res["client_round_trips_per_grant"],
                f"<= {RTT_TARGET}",
                None,
            ),
            ("  evalsha / grant", res["round_trips"]["evalsha"], "-", None),
            ("  blpop / grant", res["round_trips"]["blpop"], "-", None),
            ("script-internal cmds / grant", res["script_internal_cmds_per_grant"], "-", None),
            ("Lua µs / grant", res["lua_us_per_grant"], "-", None),
            ("client CPU µs / grant", res["client_cpu_us_per_grant"], "-", None),
            ("redis-server CPU µs / grant", res["redis_cpu_us_per_grant"], "-", None),
            ("CPU busy: bench (all cores)", res["machine_cpu_busy"], "-", None),
            ("CPU busy: whole machine", win.machine_busy or float("nan"), "-", None),
            (
                "client warnings fallback/requeue/lost/stuck",
                "/".join(map(str, [*events.values(), len(w.stuck)])),
                "0",
                None,
            ),
        ]
        text = table(
            ("figure", "value", "target / baseline", "ratio"),
            [(a, b, c, "-" if d is None else d) for a, b, c, d in rows],
        )
        fig, ax = figure(2)
        t = (granted[in_win] - lo) / 1e9
        counts, edges = np.histogram(t, bins=np.arange(0, seconds + 1e-9, 0.1))
        ax[0][0].plot(edges[:-1], counts / 0.1, label="grants/s (100 ms bins)")
        ax[0][0].axhline(ideal, color="grey", ls="--", label=f"ideal {ideal:.0f}/s")
        ax[0][0].set_xlabel("s into the window")
        ax[0][0].set_ylim(0, ideal * 1.3)
        ax[0][0].legend(loc="lower right")
        ax[0][1].plot(np.sort(waits), np.linspace(0, 1, len(waits)), label="measured")
        ax[0][1].axvline(fifo_ideal_ms, color="grey", ls="--", label="FIFO ideal")
        ax[0][1].set_xlabel("wait before grant (ms)")
        ax[0][1].set_ylabel("CDF")
        ax[0][1].legend()
        fig.suptitle(
            f"{PROCS}x{TASKS} acquirers, limit {LIMIT}, hold {HOLD_S * 1000:.0f} ms "
            f"({opts.flavor.label})"
        )
        save(NAME, opts, rp.url, res, text, fig)
    rtt = res["client_round_trips_per_grant"]
    return [
        Headline(NAME, "grants/s vs ideal 1600/s", f"{rate / ideal:.3f}", "-", None),
        Headline(
            NAME,
            "utilisation (client-observed)",
            f"{util_client:.3f}",
            f">= {UTIL_TARGET}",
            util_client >= UTIL_TARGET,
        ),
        Headline(
            NAME,
            "client round trips per grant",
            f"{rtt:.2f}",
            f"<= {RTT_TARGET}",
            rtt <= RTT_TARGET,
        ),
        Headline(NAME, "wait p99 vs FIFO ideal", f"{res['wait_p99_vs_ideal']:.2f}", "-", None),
    ]


if __name__ == "__main__":
    import sys

    from ._common import main

    sys.exit(main(only=[NAME]))


def _lua_usec(c: dict[str, float]) -> float:
    """Server time of the script calls (EVALSHA, and FCALL of the gate library)."""
    return c.get("usec:evalsha", 0.0) + c.get("usec:fcall", 0.0)
