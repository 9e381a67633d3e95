"""ramp: the adaptive gate against a vLLM simulator, from the floor to the capacity and back,
today's controller and the frozen baseline side by side in one run.

A vLLM simulator runs as its own process (``python -m fleetgate.tools.sim.vllm --service-ms 2000``);
2 spawned worker processes x 200 closed-loop tasks do ``gate.permit()`` + ``POST
/v1/completions`` for the whole run (400 concurrent callers: always more demand than capacity).
One set of workers serves every phase; the parent changes only the gate and the simulator's
capacity. For each capacity C in 256 and 200 (quick: 200 only) -- x2 from floor 4 lands on 256
exactly, so 200 tests the overshoot honestly:

1. **Static sweep** (no coordinator): floor = ceiling = L for L in 0.5, 0.75, 1, 1.25 x C
   (quick: 1, 1.25 x C); goodput = completed requests/s over a window after a warm-up. The best
   static L is the oracle.
2. **Adaptive**, once with the baseline (:mod:`._aimd_baseline`, the rule as of commit ee27f4f) and
   once with the current controller: floor 4, ceiling 512; once the fleet has drained to 4
   in flight, a coordinator (``fleetgate.coordinator.daemon.Coordinator``, an in-process task,
   poll interval 1 s, quick 0.5 s, no jitter; the baseline swapped in for
   ``controller.step``) starts. Ramp + steady state (10 + 30 polls; quick 10 + 10), then the
   capacity is halved (6 polls; quick 4) and restored (8 polls; quick 6). Every poll records
   the decision and the signals as scraped; a 10 Hz sampler records the limit clients see and
   the fleet in-flight.

Figures, each against its target: polls until the target reaches 90 % of C; peak fleet
in-flight / C during ramp + steady state (and the peak target / C); over the last 30 polls before
the halving: the targets' coefficient of variation, the share of polls with capacity-waiting > 0
and goodput / best static; polls until the target is at or below C/2 after the halving, and at
90 % of C after the restore.

The service time is 2 s (lognormal, sigma 0.5, so the closed loop does not run in lock-step
waves that make short goodput windows jump): at capacity 256 that is 128 requests/s. Shorter
service times need more requests/s through Python httpx clients (~1 ms of CPU per request even
with small pools, see :class:`~benchmarks.burst.ShardedHTTP`), fleetgate and a uvicorn simulator
on 2 shared cores: the clients become the bottleneck (the server runs far fewer than the fleet
holds), and the benchmark would measure the CPU, not the controller.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable
from typing import Any
from unittest import mock

import httpx
import numpy as np
import redis.asyncio as aredis

from fleetgate.coordinator import controller
from fleetgate.coordinator.config import Config
from fleetgate.coordinator.controller import (
    ControllerParams,
    ControllerState,
    Decision,
    Observation,
    Reason,
)
from fleetgate.coordinator.daemon import Coordinator
from fleetgate.keys import GateKeys

from . import _aimd_baseline as base
from ._common import Flavor, Headline, Options, figure, log, save, table
from ._server import PREFIX, configure_gate, private_redis, sync_client
from ._workers import Sync, Workers, cancel_until_done, worker_fleet
from .burst import ShardedHTTP, sim_process

NAME = "ramp"
GATE = "bench-ramp"
PROCS, TASKS = 2, 200
FLOOR, CEILING, SERVICE_MS = 4, 512, 2000.0
STOP_KEY = f"{PREFIX}:bench-ramp-stop"


# -- the worker ------------------------------------------------------------------------------


def closed_loop(sync: Sync, url: str, sim_url: str, n: int, flavor: Flavor) -> dict[str, Any]:
    """``n`` tasks looping permit + POST /v1/completions until STOP_KEY exists.

    Returns the completion instants (monotonic ns) of successful calls and the error count."""

    async def main() -> dict[str, Any]:
        done: list[int] = []
        errors = 0
        stopping = False
        async with ShardedHTTP(sim_url, n // 8, 8) as http:
            await http.warm()
            async with worker_fleet(sync, url, flavor, connections=n, overdue_s=600) as run:
                gate = run.fleet.gate(GATE)
                body = {"model": "sim-model", "prompt": "hello", "max_tokens": 16}

                async def one() -> None:
                    nonlocal errors
                    while not stopping:
                        try:
                            async with gate.permit(deadline=120):
                                resp = await http.post("/v1/completions", json=body)
                            if resp.status_code == 200:
                                done.append(time.monotonic_ns())
                            else:
                                errors += 1
                        except asyncio.CancelledError:
                            raise
                        except Exception:
                            errors += 1
                            await asyncio.sleep(0.05)

                tasks = [asyncio.create_task(one()) for _ in range(n)]
                while not await run.fleet.redis.exists(STOP_KEY):
                    await asyncio.sleep(0.1)
                stopping = True
                await cancel_until_done(tasks)
                result = {"done": done, "errors": errors, "events": run.events}
                sync.publish(result)
                return result

    return flavor.run(main())


# -- the adaptive phase ----------------------------------------------------------------------


def coordinator_config(url: str, sim_url: str, poll: float) -> Config:
    """One adaptive gate on the simulator; ``scrape_timeout`` left to follow the poll."""
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
base_url = "{sim_url}/v1"
server = "vllm"
floor = {FLOOR}
ceiling = {CEILING}
max_queued = 10000
lease_ms = 10000
waiter_ms = 5000
"""
    return Config.from_toml_text(toml, env={})


StepFn = Callable[[ControllerState, "Observation | None", ControllerParams, float], Decision]


def baseline_step() -> StepFn:
    """Today's frozen rule (:mod:`._aimd_baseline`) behind the current ``step``'s signature.

    The baseline keeps its own state (one gate); the daemon stores a current-format state with
    the same target, so publishing and the snapshot work unchanged."""
    states: dict[tuple[int, int], base.ControllerState] = {}

    def adapted(
        state: ControllerState, obs: Observation | None, params: ControllerParams, now: float
    ) -> Decision:
        bp = base.ControllerParams(
            floor=params.floor,
            ceiling=params.ceiling,
            adaptive=params.adaptive,
            poll_interval=params.poll_interval,
            unknown_reset_polls=params.unknown_reset_polls,
        )
        key = (params.floor, params.ceiling)
        bs = states.get(key) or base.ControllerState.initial(bp)
        bobs = (
            None
            if obs is None
            else base.Observation(obs.running, obs.waiting_capacity, obs.in_flight, obs.ok)
        )
        d = base.step(bs, bobs, bp, now)
        states[key] = d.state
        return Decision(
            ControllerState(target=d.target), d.target, Reason(d.reason.value), d.publish,
            d.saturated,
        )  # fmt: skip

    return adapted


async def adaptive(
    url: str, sim_url: str, poll: float, phases: list[tuple[int, int]], step_fn: StepFn
) -> tuple[
    list[dict[str, Any]], list[tuple[float, int, int, int, int | None]], list[tuple[int, int, int]]
]:
    """Run the coordinator with ``step_fn``; ``phases`` = [(capacity, polls), ...] in turn.

    Returns the per-poll records, the 10 Hz samples (t_ns, limit, in_flight, queued, target) and
    the capacity changes (poll index, t_ns, capacity)."""
    keys = GateKeys.of(PREFIX, GATE)
    r = aredis.Redis.from_url(url, decode_responses=True)
    http = httpx.AsyncClient(base_url=sim_url, timeout=5)
    coord = Coordinator(coordinator_config(url, sim_url, poll), coordinator_id="bench-ramp")
    polls: list[dict[str, Any]] = []
    new_poll = asyncio.Event()
    original = coord.poll_once

    async def recorded() -> Any:
        t = time.monotonic_ns()
        pubs = await original()
        st = (await http.get("/admin/stats")).json()
        for p in pubs:
            s = p.signals
            polls.append(
                {
                    "t_ns": t,
                    "target": p.decision.target,
                    "reason": p.decision.reason.value,
                    "publish": p.decision.publish,
                    "in_flight": p.in_flight,
                    "running": None if s is None else s.running,
                    "waiting_capacity": None if s is None else s.waiting_capacity,
                    "kv_cache_usage": None if s is None else s.kv_cache_usage,
                    "sim_running": st["running"],
                    "sim_waiting": st["waiting"],
                    "capacity": st["capacity"],
                }
            )
        new_poll.set()
        return pubs

    coord.poll_once = recorded  # type: ignore[method-assign]
    samples: list[tuple[float, int, int, int, int | None]] = []

    async def sampler() -> None:
        while True:
            async with r.pipeline(transaction=False) as p:
                p.hgetall(keys.target)
                p.zcard(keys.holders)
                p.zcard(keys.waiters)
                p.time()
                tgt, holders, queued, now = await p.execute()
            now_ms = now[0] * 1000 + now[1] // 1000
            value = None
            limit = FLOOR
            if tgt and "value" in tgt and int(float(tgt.get("expires_at", 0))) > now_ms:
                value = int(float(tgt["value"]))
                limit = max(FLOOR, min(CEILING, value))
            samples.append((time.monotonic_ns(), limit, int(holders), int(queued), value))
            await asyncio.sleep(0.1)

    changes: list[tuple[int, int, int]] = []
    stop = asyncio.Event()
    samp = asyncio.create_task(sampler())
    with mock.patch.object(controller, "step", step_fn):
        task = asyncio.create_task(coord.run(stop))
        try:
            for i, (cap, n) in enumerate(phases):
                if i > 0:
                    await http.post("/admin/capacity", json={"capacity": cap})
                    changes.append((len(polls), time.monotonic_ns(), cap))
                    log(f"{NAME}: capacity -> {cap} after poll {len(polls)}")
                else:
                    changes.append((0, time.monotonic_ns(), cap))
                goal = len(polls) + n
                while len(polls) < goal:
                    new_poll.clear()
                    await asyncio.wait_for(new_poll.wait(), timeout=10 * poll + 10)
                    if task.done():
                        task.result()
                last = polls[-1]
                log(
                    f"{NAME}: poll {len(polls)}: target {last['target']} ({last['reason']}), "
                    f"in flight {last['in_flight']}, running {last['running']}, "
                    f"waiting {last['waiting_capacity']}"
                )
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)
            samp.cancel()
            await asyncio.gather(samp, return_exceptions=True)
            await http.aclose()
            await r.aclose()
    return polls, samples, changes


# -- figures -----------------------------------------------------------------------------------


def rate(done: np.ndarray, lo: int, hi: int) -> float:
    return float(((done >= lo) & (done < hi)).sum() / ((hi - lo) / 1e9))


def first_poll(targets: list[int], ok: Callable[[int], bool]) -> int | None:
    """1-based index of the first poll whose target satisfies ``ok``."""
    return next((k + 1 for k, t in enumerate(targets) if ok(t)), None)


def cv(values: list[int]) -> float:
    """Coefficient of variation (population standard deviation / mean)."""
    arr = np.array(values, dtype=float)
    return float(arr.std() / arr.mean()) if len(arr) and arr.mean() > 0 else float("nan")


def figures(
    cap: int,
    polls: list[dict[str, Any]],
    samples: list[tuple[float, int, int, int, int | None]],
    changes: list[tuple[int, int, int]],
    done: np.ndarray,
    oracle: float,
    steady_polls: int,
) -> dict[str, Any]:
    """The target figures of one adaptive run on capacity ``cap``."""
    targets = [p["target"] for p in polls]
    i_half, i_double = changes[1][0], changes[2][0]
    ramp_t = targets[:i_half]
    ramp_samples = [s for s in samples if s[0] < changes[1][1]]
    steady = polls[i_half - steady_polls : i_half]
    steady_t = [p["target"] for p in steady]
    goodput = rate(done, steady[0]["t_ns"], changes[1][1])
    waiting_polls = sum(1 for p in steady if (p["waiting_capacity"] or 0) > 0)
    return {
        "capacity": cap,
        "polls_to_90pct": first_poll(ramp_t, lambda t: t >= 0.9 * cap),
        "peak_target_over_capacity": max(ramp_t) / cap,
        "peak_in_flight_over_capacity": max(s[2] for s in ramp_samples) / cap,
        "steady_polls": len(steady),
        "steady_target_cv": cv(steady_t),
        "steady_waiting_poll_share": waiting_polls / len(steady),
        "steady_goodput_per_s": goodput,
        "steady_goodput_vs_best_static": goodput / oracle,
        "steady_targets": steady_t,
        "polls_to_halved": first_poll(targets[i_half:i_double], lambda t: t <= cap // 2),
        "polls_to_90pct_after_doubling": first_poll(targets[i_double:], lambda t: t >= 0.9 * cap),
    }


CRITERIA: list[tuple[str, str, str, Callable[[Any], bool]]] = [
    ("polls to 90 % of capacity", "polls_to_90pct", "<= 8", lambda v: v is not None and v <= 8),
    ("peak fleet in-flight / capacity (ramp)", "peak_in_flight_over_capacity", "<= 1.10",
     lambda v: v <= 1.10),
    ("peak target / capacity (ramp)", "peak_target_over_capacity", "-", lambda v: True),
    ("steady target CV", "steady_target_cv", "<= 0.05", lambda v: v <= 0.05),
    ("steady polls with capacity-waiting > 0", "steady_waiting_poll_share", "<= 0.10",
     lambda v: v <= 0.10),
    ("steady goodput / best static", "steady_goodput_vs_best_static", ">= 0.97",
     lambda v: v >= 0.97),
    ("polls to <= C/2 after halving", "polls_to_halved", "<= 2",
     lambda v: v is not None and v <= 2),
    ("polls to 90 % after doubling", "polls_to_90pct_after_doubling", "<= 6",
     lambda v: v is not None and v <= 6),
]  # fmt: skip


def shown(v: Any) -> str:
    if v is None:
        return "never"
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def run(opts: Options) -> list[Headline]:
    poll = opts.pick(1.0, 0.5)
    capacities = opts.pick((256, 200), (200,))
    sweep_fractions = opts.pick((0.5, 0.75, 1.0, 1.25), (1.0, 1.25))
    warm, measure = opts.pick((3.0, 6.0), (1.5, 3.0))
    ramp_polls, steady_polls, half_polls, double_polls = opts.pick((10, 30, 6, 8), (10, 10, 4, 6))
    logging.getLogger("fleetgate.coordinator").setLevel(logging.WARNING)
    controllers: list[tuple[str, Callable[[], StepFn]]] = [
        ("baseline", baseline_step),
        ("current", lambda: controller.step),
    ]
    with (
        private_redis() as rp,
        sim_process(
            "vllm",
            "--capacity",
            str(capacities[0]),
            "--service-ms",
            f"{SERVICE_MS:g}",
            "--service-dist",
            "lognormal",
            "--seed",
            "1",
        ) as sim,
    ):
        url = rp.url
        keys = configure_gate(
            url, GATE, floor=FLOOR, ceiling=FLOOR, max_queued=10_000, lease_ms=10_000,
            waiter_ms=5_000,
        )  # fmt: skip
        r = sync_client(url)
        r.delete(STOP_KEY)
        windows: dict[int, list[dict[str, Any]]] = {}
        runs: list[dict[str, Any]] = []

        def to_floor() -> None:
            """Back to the floor; wait for the fleet to drain to it."""
            r.delete(keys.target, keys.util)
            r.hset(keys.cfg, mapping={"floor": FLOOR, "ceiling": CEILING})
            t0 = time.monotonic()
            while r.zcard(keys.holders) > FLOOR and time.monotonic() - t0 < 10:
                time.sleep(0.05)
            time.sleep(SERVICE_MS / 1000)

        with Workers(closed_loop, [(url, sim.url, TASKS, opts.flavor)] * PROCS) as w:
            w.go()
            log(f"{NAME}: {PROCS} x {TASKS} closed-loop callers, service {SERVICE_MS:g} ms")
            for cap in capacities:
                httpx.post(f"{sim.url}/admin/capacity", json={"capacity": cap}, timeout=5)
                windows[cap] = []
                for frac in sweep_fractions:
                    lim = round(frac * cap)
                    r.hset(keys.cfg, mapping={"floor": lim, "ceiling": lim})
                    time.sleep(warm)
                    lo = time.monotonic_ns()
                    time.sleep(measure)
                    hi = time.monotonic_ns()
                    st = sim.stats()
                    windows[cap].append(
                        {"limit": lim, "lo": lo, "hi": hi, "sim_running": st["running"],
                         "sim_waiting": st["waiting"]}
                    )  # fmt: skip
                    log(f"{NAME}: capacity {cap}, static {lim}: window done")
                for label, make in controllers:
                    to_floor()
                    log(f"{NAME}: capacity {cap}, {label} controller starts")
                    phases = [(cap, ramp_polls + steady_polls), (cap // 2, half_polls),
                              (cap, double_polls)]  # fmt: skip
                    polls, samples, changes = asyncio.run(
                        adaptive(url, sim.url, poll, phases, make())
                    )
                    runs.append({"capacity": cap, "controller": label, "polls": polls,
                                 "samples": samples, "changes": changes})  # fmt: skip
            r.set(STOP_KEY, 1)
            out = w.results(timeout=60)
        r.close()
        done = np.sort(np.array([t for o in out for t in o["done"]], dtype=np.int64))
        errors = sum(o["errors"] for o in out)
        events = {k: sum(o["events"][k] for o in out) for k in out[0]["events"]}
        oracle: dict[int, tuple[int, float]] = {}
        for cap, sweep in windows.items():
            for s in sweep:
                s["goodput"] = rate(done, s.pop("lo"), s.pop("hi"))
            best = max(sweep, key=lambda s: s["goodput"])
            oracle[cap] = (best["limit"], best["goodput"])
        results: dict[tuple[int, str], dict[str, Any]] = {}
        for run_ in runs:
            cap = run_["capacity"]
            results[(cap, run_["controller"])] = figures(
                cap, run_["polls"], run_["samples"], run_["changes"], done, oracle[cap][1],
                steady_polls,
            )  # fmt: skip
        t_ref = {id(run_): run_["polls"][0]["t_ns"] for run_ in runs}
        res = {
            "poll_interval_s": poll,
            "service_ms": SERVICE_MS,
            "callers": PROCS * TASKS,
            "floor": FLOOR,
            "ceiling": CEILING,
            "static_sweep": {str(c): s for c, s in windows.items()},
            "best_static": {
                str(c): {"limit": lim, "goodput_per_s": g} for c, (lim, g) in oracle.items()
            },
            "figures": {f"{c}/{label}": f for (c, label), f in results.items()},
            "errors": errors,
            "client_warnings": events,
            "workers_stuck_in_close": len(w.stuck),
            "runs": [
                {
                    "capacity": run_["capacity"],
                    "controller": run_["controller"],
                    "polls": [
                        {**p, "t_s": (p["t_ns"] - t_ref[id(run_)]) / 1e9} for p in run_["polls"]
                    ],
                    "capacity_changes": [
                        (i, (t - t_ref[id(run_)]) / 1e9, c) for i, t, c in run_["changes"]
                    ],
                }
                for run_ in runs
            ],
        }
        text = ""
        for cap, sweep in windows.items():
            rows = [(f"static {s['limit']}", s["goodput"], s["sim_running"], s["sim_waiting"])
                    for s in sweep]  # fmt: skip
            text += table((f"capacity {cap}", "goodput req/s", "sim running", "sim waiting"), rows)
            text += "\n\n"
        for run_ in runs:
            tr = t_ref[id(run_)]
            trace = [
                (i + 1, f"{(p['t_ns'] - tr) / 1e9:.1f}", p["capacity"], p["target"], p["reason"],
                 p["in_flight"], p["running"], p["waiting_capacity"])
                for i, p in enumerate(run_["polls"])
            ]  # fmt: skip
            text += f"{run_['controller']} controller, capacity {run_['capacity']}:\n"
            text += table(
                ("poll", "t s", "capacity", "target", "reason", "in flight", "running", "waiting"),
                trace,
            )
            text += "\n\n"
        fig_rows = []
        for cap in capacities:
            for title, key, goal, _ in CRITERIA:
                fig_rows.append(
                    (f"C={cap}: {title}", shown(results[(cap, "baseline")][key]),
                     shown(results[(cap, "current")][key]), goal)
                )  # fmt: skip
            fig_rows.append((f"C={cap}: best static limit (goodput req/s)",
                             f"{oracle[cap][0]} ({oracle[cap][1]:.0f})", "", "-"))  # fmt: skip
        fig_rows.append(("errors / client warnings", "", f"{errors} / {sum(events.values())}",
                         "0"))  # fmt: skip
        text += table(("figure", "baseline", "current", "target"), fig_rows)
        fig, ax = figure(len(capacities))
        for col, cap in enumerate(capacities):
            a = ax[0][col]
            for run_ in (x for x in runs if x["capacity"] == cap):
                tr = t_ref[id(run_)]
                ts = [(s[0] - tr) / 1e9 for s in run_["samples"]]
                ls = "-" if run_["controller"] == "current" else ":"
                a.plot(ts, [s[1] for s in run_["samples"]], ls=ls, lw=1.2,
                       label=f"{run_['controller']}: limit")  # fmt: skip
                a.plot(ts, [s[2] for s in run_["samples"]], ls=ls, lw=0.8, alpha=0.7,
                       label=f"{run_['controller']}: fleet in-flight")  # fmt: skip
            ch = next(x for x in runs if x["capacity"] == cap)
            tr = t_ref[id(ch)]
            cap_t = [(t - tr) / 1e9 for _, t, _ in ch["changes"]]
            cap_t.append((ch["polls"][-1]["t_ns"] - tr) / 1e9)
            cap_v = [c for _, _, c in ch["changes"]] + [ch["changes"][-1][2]]
            a.step(cap_t, cap_v, where="post", color="black", ls="--", label="capacity")
            a.set_xlabel("s since the coordinator started")
            a.set_ylabel("permits")
            a.set_title(f"capacity {cap}")
            a.legend(loc="upper left", fontsize=7)
        fig.suptitle(
            f"ramp: floor {FLOOR}, ceiling {CEILING}, poll {poll:g} s, {PROCS * TASKS} callers, "
            f"service {SERVICE_MS:g} ms ({opts.flavor.label}); dotted = baseline"
        )
        save(NAME, opts, url, res, text, fig)
    heads = []
    for cap in capacities:
        for title, key, goal, ok in CRITERIA:
            cur, old = results[(cap, "current")][key], results[(cap, "baseline")][key]
            heads.append(
                Headline(NAME, f"C={cap}: {title} (baseline {shown(old)})", shown(cur), goal,
                         None if goal == "-" else bool(cur is not None and ok(cur)))
            )  # fmt: skip
    return heads


if __name__ == "__main__":
    from ._common import main

    sys.exit(main(only=[NAME]))
