"""latency: the client-observed signal and its latency-gradient controller on a server without
metrics.

A vLLM simulator without ``/metrics`` (``--no-metrics``): a FIFO of ``--capacity`` slots, so the
latency grows with the queue beyond the capacity, and 429 once ``--max-waiting`` requests wait
(a hosted API's answer). 2 spawned worker processes x 200 closed-loop tasks do ``gate.permit()``
+ ``POST /v1/completions`` and report each call (``lease.report``: ok with its latency, or
overloaded; a refused caller backs off 0.2 s outside its permit). The gate has no metrics
source, so the coordinator (in-process, default poll interval 2 s, no jitter) drives it with
the latency-gradient controller on the fleet's reports alone.

1. **No-load latency**: the gate at its floor (4, far below the capacity) for a few seconds; the
   median latency the clients measure is the no-load latency.
2. **Adaptive**: the coordinator starts at the floor; ramp (15 polls) then steady state (30
   polls; quick: 10).

Figures, against their targets: polls until the target reaches 90 % of the capacity
(<= 15); over the steady polls, the clients' p50 latency / the no-load latency (<= 1.3) and the
overload responses / calls (<= 1 %). Also: goodput / the capacity's rate, the peak target.
Service time 2 s lognormal (as ``ramp``: the Python clients stay far from their CPU limit).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import Any

import httpx
import numpy as np

from fleetgate.coordinator.config import Config
from fleetgate.coordinator.daemon import Coordinator
from fleetgate.observed import classify_status

from ._common import Flavor, Headline, Options, figure, log, save, table
from ._server import PREFIX, configure_gate, private_redis, sync_client
from ._workers import Sync, Workers, cancel_until_done, worker_fleet
from .burst import ShardedHTTP, sim_process
from .ramp import first_poll, shown

NAME = "latency"
GATE = "bench-latency"
PROCS, TASKS = 2, 200
FLOOR, CEILING, SERVICE_MS = 4, 512, 2000.0
STOP_KEY = f"{PREFIX}:bench-latency-stop"
BACKOFF_S = 0.2


def closed_loop(sync: Sync, url: str, sim_url: str, n: int, flavor: Flavor) -> dict[str, Any]:
    """``n`` tasks looping permit + POST + report until STOP_KEY exists. Returns each call's
    (completion monotonic ns, latency s, status; 0 for a transport error)."""

    async def main() -> dict[str, Any]:
        calls: list[tuple[int, float, int]] = []
        stopping = False
        async with ShardedHTTP(sim_url, n // 8, 8) as http:
            await http.warm()
            async with worker_fleet(sync, url, flavor, connections=n, overdue_s=600) as run:
                gate = run.fleet.gate(GATE)
                body = {"model": "sim-model", "prompt": "hello", "max_tokens": 16}

                async def one() -> None:
                    while not stopping:
                        status = 0
                        try:
                            async with gate.permit(deadline=120) as lease:
                                t0 = time.monotonic()
                                try:
                                    resp = await http.post("/v1/completions", json=body)
                                    status = resp.status_code
                                except httpx.TimeoutException:
                                    lease.report("timeout")
                                    raise
                                latency = time.monotonic() - t0
                                outcome = classify_status(status)
                                lease.report(outcome, latency if outcome == "ok" else None)
                            calls.append((time.monotonic_ns(), latency, status))
                            if status != 200:
                                await asyncio.sleep(BACKOFF_S)
                        except asyncio.CancelledError:
                            raise
                        except Exception:
                            calls.append((time.monotonic_ns(), 0.0, 0))
                            await asyncio.sleep(BACKOFF_S)

                tasks = [asyncio.create_task(one()) for _ in range(n)]
                while not await run.fleet.redis.exists(STOP_KEY):
                    await asyncio.sleep(0.1)
                stopping = True
                await cancel_until_done(tasks)
                result = {"calls": calls, "events": run.events}
                sync.publish(result)
                return result

    return flavor.run(main())


def coordinator_config(url: str, poll: float) -> Config:
    """One gate without a metrics source: the latency controller drives it."""
    toml = f"""
[redis]
url = "{url}"
prefix = "{PREFIX}"

[coordinator]
poll_interval = {poll}
poll_jitter = 0.0
leader_ttl = 5.0
metrics_listen = "127.0.0.1:0"

[[gates]]
name = "{GATE}"
floor = {FLOOR}
ceiling = {CEILING}
max_queued = 10000
lease_ms = 10000
waiter_ms = 5000
"""
    return Config.from_toml_text(toml, env={})


async def adaptive(url: str, sim_url: str, poll: float, n_polls: int) -> list[dict[str, Any]]:
    """Run the coordinator for ``n_polls`` polls; one record per poll."""
    http = httpx.AsyncClient(base_url=sim_url, timeout=5)
    coord = Coordinator(coordinator_config(url, poll), coordinator_id="bench-latency")
    polls: list[dict[str, Any]] = []
    new_poll = asyncio.Event()
    original = coord.poll_once

    async def recorded() -> Any:
        t = time.monotonic_ns()
        pubs = await original()
        st = (await http.get("/admin/stats")).json()
        for p in pubs:
            d, snap = p.decision, p.snapshot()
            polls.append(
                {
                    "t_ns": t,
                    "target": d.target,
                    "reason": d.reason.value,
                    "in_flight": p.in_flight,
                    "p50": snap.latency_p50,
                    "no_load": snap.latency_no_load,
                    "obs_calls": snap.obs_calls,
                    "obs_overloaded": snap.obs_overloaded,
                    "sim_running": st["running"],
                    "sim_waiting": st["waiting"],
                }
            )
        new_poll.set()
        return pubs

    coord.poll_once = recorded  # type: ignore[method-assign]
    stop = asyncio.Event()
    task = asyncio.create_task(coord.run(stop))
    try:
        while len(polls) < n_polls:
            new_poll.clear()
            await asyncio.wait_for(new_poll.wait(), timeout=10 * poll + 10)
            if task.done():
                task.result()
            last = polls[-1]
            log(
                f"{NAME}: poll {len(polls)}: target {last['target']} ({last['reason']}), "
                f"p50 {last['p50']}, no-load {last['no_load']}, sim running "
                f"{last['sim_running']} waiting {last['sim_waiting']}"
            )
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await http.aclose()
    return polls


def run(opts: Options) -> list[Headline]:
    poll = 2.0
    cap = 256
    max_waiting = cap // 4
    ramp_polls, steady_polls = 15, opts.pick(30, 10)
    floor_s = opts.pick(8.0, 5.0)
    logging.getLogger("fleetgate.coordinator").setLevel(logging.WARNING)
    with (
        private_redis() as rp,
        sim_process(
            "vllm", "--no-metrics", "--capacity", str(cap), "--service-ms", f"{SERVICE_MS:g}",
            "--service-dist", "lognormal", "--seed", "1", "--max-waiting", str(max_waiting),
            "--overload-status", "429",
        ) as sim,
    ):  # fmt: skip
        url = rp.url
        configure_gate(
            url, GATE, floor=FLOOR, ceiling=CEILING, max_queued=10_000, lease_ms=10_000,
            waiter_ms=5_000,
        )  # fmt: skip
        r = sync_client(url)
        r.delete(STOP_KEY)
        with Workers(closed_loop, [(url, sim.url, TASKS, opts.flavor)] * PROCS) as w:
            w.go()
            log(f"{NAME}: {PROCS} x {TASKS} closed-loop callers, capacity {cap}, at the floor")
            floor_lo = time.monotonic_ns() + int(SERVICE_MS * 1e6)
            time.sleep(floor_s)
            floor_hi = time.monotonic_ns()
            polls = asyncio.run(adaptive(url, sim.url, poll, ramp_polls + steady_polls))
            r.set(STOP_KEY, 1)
            out = w.results(timeout=60)
        r.close()
        calls = np.array([c for o in out for c in o["calls"]], dtype=float).reshape(-1, 3)
        events = {k: sum(o["events"][k] for o in out) for k in out[0]["events"]}
        t_done, lat, status = calls[:, 0], calls[:, 1], calls[:, 2]

        def window(lo: float, hi: float) -> dict[str, float]:
            sel = (t_done >= lo) & (t_done < hi)
            ok = sel & (status == 200)
            n = int(sel.sum())
            return {
                "calls": n,
                "ok": int(ok.sum()),
                "overloaded": int((sel & ((status == 429) | (status == 503))).sum()),
                "errors": int((sel & (status == 0)).sum()),
                "p50_s": float(np.median(lat[ok])) if ok.any() else float("nan"),
                "goodput_per_s": float(ok.sum() / ((hi - lo) / 1e9)),
            }

        floor_w = window(floor_lo, floor_hi)
        no_load = floor_w["p50_s"]
        targets = [p["target"] for p in polls]
        steady = polls[-steady_polls:]
        steady_w = window(steady[0]["t_ns"], polls[-1]["t_ns"])
        ramp_w = window(polls[0]["t_ns"], steady[0]["t_ns"])
        figures = {
            "capacity": cap,
            "no_load_latency_s": no_load,
            "polls_to_90pct": first_poll(targets, lambda t: t >= 0.9 * cap),
            "peak_target_over_capacity": max(targets) / cap,
            "steady_p50_over_no_load": steady_w["p50_s"] / no_load,
            "steady_overload_share": steady_w["overloaded"] / max(1, steady_w["calls"]),
            "ramp_overload_share": ramp_w["overloaded"] / max(1, ramp_w["calls"]),
            "steady_goodput_vs_capacity_rate": steady_w["goodput_per_s"] / (cap / SERVICE_MS * 1e3),
            "steady_targets": [p["target"] for p in steady],
        }
        t0 = polls[0]["t_ns"]
        res = {
            "poll_interval_s": poll,
            "service_ms": SERVICE_MS,
            "callers": PROCS * TASKS,
            "floor": FLOOR,
            "ceiling": CEILING,
            "max_waiting": max_waiting,
            "figures": figures,
            "floor_window": floor_w,
            "ramp_window": ramp_w,
            "steady_window": steady_w,
            "client_warnings": events,
            "workers_stuck_in_close": len(w.stuck),
            "polls": [{**p, "t_s": (p["t_ns"] - t0) / 1e9} for p in polls],
        }
        trace = [
            (i + 1, f"{(p['t_ns'] - t0) / 1e9:.1f}", p["target"], p["reason"], p["in_flight"],
             p["p50"], p["no_load"], p["obs_calls"], p["obs_overloaded"], p["sim_running"],
             p["sim_waiting"])
            for i, p in enumerate(polls)
        ]  # fmt: skip
        text = table(
            ("poll", "t s", "target", "reason", "in flight", "p50 s", "no-load s", "calls",
             "overloaded", "sim running", "sim waiting"),
            trace,
        )  # fmt: skip
        rows = [(k, shown(v)) for k, v in figures.items() if k != "steady_targets"]
        text += "\n\n" + table(("figure", "value"), rows)
        fig, ax = figure(2)
        ts = [(p["t_ns"] - t0) / 1e9 for p in polls]
        a = ax[0][0]
        a.plot(ts, targets, label="target")
        in_sim = [p["sim_running"] + p["sim_waiting"] for p in polls]
        a.plot(ts, in_sim, lw=0.8, label="sim in flight")
        a.axhline(cap, color="black", ls="--", lw=0.8, label="capacity")
        a.axhline(cap + max_waiting, color="red", ls=":", lw=0.8, label="429 beyond")
        a.set_xlabel("s since the coordinator started")
        a.set_ylabel("permits")
        a.legend(fontsize=7)
        b = ax[0][1]
        b.plot(ts, [p["p50"] for p in polls], label="p50 (obs window)")
        b.plot(ts, [p["no_load"] for p in polls], label="no-load estimate")
        b.axhline(no_load, color="black", ls="--", lw=0.8, label="no-load (clients, at floor)")
        b.axhline(1.3 * no_load, color="red", ls=":", lw=0.8, label="1.3 x no-load")
        b.set_xlabel("s since the coordinator started")
        b.set_ylabel("seconds")
        b.legend(fontsize=7)
        fig.suptitle(
            f"latency: --no-metrics, capacity {cap}, 429 beyond {max_waiting} waiting, "
            f"floor {FLOOR}, poll {poll:g} s, {PROCS * TASKS} callers ({opts.flavor.label})"
        )
        save(NAME, opts, url, res, text, fig)
    p90, ratio = figures["polls_to_90pct"], figures["steady_p50_over_no_load"]
    share = figures["steady_overload_share"]
    return [
        Headline(NAME, "polls to 90 % of capacity", shown(p90), "<= 15",
                 p90 is not None and p90 <= 15),
        Headline(NAME, "steady p50 latency / no-load", shown(ratio), "<= 1.3", ratio <= 1.3),
        Headline(NAME, "steady overload responses / calls", shown(share), "<= 0.01",
                 share <= 0.01),
        Headline(NAME, "steady goodput / capacity rate",
                 shown(figures["steady_goodput_vs_capacity_rate"]), "-", None),
    ]  # fmt: skip


if __name__ == "__main__":
    from ._common import main

    sys.exit(main(only=[NAME]))
