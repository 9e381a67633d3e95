"""ramp: the adaptive gate against a vLLM simulator, from the floor to the capacity and back.

A vLLM simulator runs as its own process (``python -m fleetgate.tools.sim.vllm --capacity 256
--service-ms 1000``); 2 spawned worker processes x 200 closed-loop tasks do ``gate.permit()`` +
``POST /v1/completions`` for the whole run (400 concurrent callers: always more demand than
capacity). One set of workers serves every phase; the parent changes only the gate:

1. **Static sweep** (no coordinator): the gate's floor = ceiling = L for L in 128, 192, 256, 320
   (quick: 256, 320); goodput = completed requests/s over a window after a warm-up. The oracle
   is the best static L.
2. **Adaptive**: floor 4, ceiling 512; once the fleet has drained to 4 in flight, a coordinator
   (``fleetgate.coordinator.daemon.Coordinator``, an in-process task, poll interval 1 s, quick
   0.5 s, no jitter) starts. Every poll records the controller's decision, the published target,
   the fleet in-flight and the simulator's running/waiting (from its /metrics, as scraped); a
   10 Hz sampler records the limit clients see (live target clamped to [floor, ceiling], else
   the floor), fleet in-flight and queue. After the ramp the capacity is halved
   (``POST /admin/capacity``), then doubled back.

Figures: polls until the target reaches 90 % of the capacity, peak overshoot (max published target
/ capacity during the ramp; also max fleet in-flight / capacity), steady-state goodput over the
last polls of the ramp phase vs the oracle, and polls to settle after each capacity change
(settled = from that poll on, every target in [0.9 C, 1.25 C]; 1.25 C is the controller's own
+25 % probe). Targets: <= 8 polls to 90 %, overshoot <= 1.10, goodput >= 0.95 x oracle.

The service time is 1 s (lognormal, sigma 0.5, so the closed loop does not run in lock-step
waves that make short goodput windows jump), not ~100 ms: at capacity 256 that is 256
requests/s. At 100 ms the fleet would need 2560 requests/s through Python httpx clients (~1 ms
of CPU per request even with small pools, see :class:`~benchmarks.burst.ShardedHTTP`), fleetgate
and a uvicorn simulator on 2 cores: the CPU cannot deliver that, the simulator would never reach
its capacity and the benchmark would measure the CPU, not the controller.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import Any

import httpx
import numpy as np
import redis.asyncio as aredis

from fleetgate.coordinator.config import Config
from fleetgate.coordinator.daemon import Coordinator
from fleetgate.keys import GateKeys

from ._common import Flavor, Headline, Options, figure, log, save, table
from ._server import PREFIX, configure_gate, private_redis, sync_client
from ._workers import Sync, Workers, worker_fleet
from .burst import ShardedHTTP, sim_process

NAME = "ramp"
GATE = "bench-ramp"
PROCS, TASKS = 2, 200
CAPACITY, FLOOR, CEILING, SERVICE_MS = 256, 4, 512, 1000.0
POLLS_TARGET, OVERSHOOT_TARGET, GOODPUT_TARGET = 8, 1.10, 0.95
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
                # Stop by flag and by cancellation, re-sent until every task has ended: on
                # Python 3.11 a cancellation racing redis-py's internal wait_for can be lost.
                stopping = True
                pending: set[asyncio.Task[None]] = set(tasks)
                while pending:
                    for t in pending:
                        t.cancel()
                    _, pending = await asyncio.wait(pending, timeout=1.0)
                result = {"done": done, "errors": errors, "events": run.events}
                sync.publish(result)
                return result

    return flavor.run(main())


# -- the adaptive phase ----------------------------------------------------------------------


def coordinator_config(url: str, sim_url: str, poll: float) -> Config:
    toml = f"""
[redis]
url = "{url}"
prefix = "{PREFIX}"

[coordinator]
poll_interval = {poll}
poll_jitter = 0.0
leader_ttl = 5.0
metrics_listen = "127.0.0.1:0"
scrape_timeout = {min(2.0, poll):g}

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


async def adaptive(
    url: str, sim_url: str, poll: float, phases: list[tuple[int, int]]
) -> tuple[
    list[dict[str, Any]], list[tuple[float, int, int, int, int | None]], list[tuple[int, int, int]]
]:
    """Run the coordinator; ``phases`` = [(capacity, polls), ...] applied in turn.

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
                p.zcard(keys.queue)
                p.time()
                tgt, holders, queued, now = await p.execute()
            now_ms = now[0] * 1000 + now[1] // 1000
            value = None
            limit = FLOOR
            if tgt and int(float(tgt.get("expires_at", 0))) > now_ms:
                value = int(float(tgt["value"]))
                limit = max(FLOOR, min(CEILING, value))
            samples.append((time.monotonic_ns(), limit, int(holders), int(queued), value))
            await asyncio.sleep(0.1)

    changes: list[tuple[int, int, int]] = []
    stop = asyncio.Event()
    samp = asyncio.create_task(sampler())
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


def polls_to_settle(targets: list[int], cap: int) -> int | None:
    """1-based index of the first poll from which every target lies in [0.9 C, 1.25 C]."""
    lo, hi = 0.9 * cap, 1.25 * cap
    for k in range(len(targets)):
        if all(lo <= t <= hi for t in targets[k:]):
            return k + 1
    return None


def run(opts: Options) -> list[Headline]:
    poll = opts.pick(1.0, 0.5)
    sweep_limits = opts.pick((128, 192, 256, 320), (256, 320))
    warm, measure = opts.pick((3.0, 6.0), (1.5, 3.0))
    ramp_polls, half_polls, double_polls = opts.pick((18, 12, 14), (15, 6, 8))
    steady_polls = opts.pick(8, 6)
    logging.getLogger("fleetgate.coordinator").setLevel(logging.WARNING)
    with (
        private_redis() as rp,
        sim_process(
            "vllm",
            "--capacity",
            str(CAPACITY),
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
            url, GATE, floor=sweep_limits[0], ceiling=sweep_limits[0], max_queued=10_000,
            lease_ms=10_000, waiter_ms=5_000,
        )  # fmt: skip
        r = sync_client(url)
        r.delete(STOP_KEY)
        with Workers(closed_loop, [(url, sim.url, TASKS, opts.flavor)] * PROCS) as w:
            start = w.go()
            log(f"{NAME}: {PROCS} x {TASKS} closed-loop callers, service {SERVICE_MS:g} ms")
            sweep: list[dict[str, Any]] = []
            for lim in sweep_limits:
                r.hset(keys.cfg, mapping={"floor": lim, "ceiling": lim})
                time.sleep(warm)
                lo = time.monotonic_ns()
                time.sleep(measure)
                hi = time.monotonic_ns()
                st = sim.stats()
                sweep.append(
                    {"limit": lim, "lo": lo, "hi": hi, "in_flight": r.zcard(keys.holders),
                     "sim_running": st["running"], "sim_waiting": st["waiting"]}
                )  # fmt: skip
                log(f"{NAME}: static {lim}: window done (running {st['running']}, "
                    f"waiting {st['waiting']})")  # fmt: skip
            # Back to the floor; wait for the fleet to drain to it before the coordinator starts.
            r.delete(keys.target, keys.util)
            r.hset(keys.cfg, mapping={"floor": FLOOR, "ceiling": CEILING})
            t0 = time.monotonic()
            while r.zcard(keys.holders) > FLOOR and time.monotonic() - t0 < 10:
                time.sleep(0.05)
            time.sleep(SERVICE_MS / 1000)
            log(f"{NAME}: drained to {r.zcard(keys.holders)} in flight; coordinator starts")
            phases = [(CAPACITY, ramp_polls), (CAPACITY // 2, half_polls), (CAPACITY, double_polls)]
            polls, samples, changes = asyncio.run(adaptive(url, sim.url, poll, phases))
            r.set(STOP_KEY, 1)
            out = w.results(timeout=60)
        r.close()
        done = np.sort(np.array([t for o in out for t in o["done"]], dtype=np.int64))
        errors = sum(o["errors"] for o in out)
        events = {k: sum(o["events"][k] for o in out) for k in out[0]["events"]}
        for s in sweep:
            s["goodput"] = rate(done, s.pop("lo"), s.pop("hi"))
        best = max(sweep, key=lambda s: s["goodput"])
        oracle = best["goodput"]
        # Ramp phase.
        targets = [p["target"] for p in polls]
        i_half, i_double = changes[1][0], changes[2][0]
        ramp_t = targets[:i_half]
        reach = next((i + 1 for i, t in enumerate(ramp_t) if t >= 0.9 * CAPACITY), None)
        overshoot = max(ramp_t) / CAPACITY
        t_start = polls[0]["t_ns"]
        ramp_samples = [s for s in samples if s[0] < changes[1][1]]
        inflight_overshoot = max(s[2] for s in ramp_samples) / CAPACITY
        steady_lo = polls[max(0, i_half - steady_polls)]["t_ns"]
        steady_hi = changes[1][1]
        goodput = rate(done, steady_lo, steady_hi)
        steady_targets = targets[max(0, i_half - steady_polls) : i_half]
        settle_half = polls_to_settle(targets[i_half:i_double], CAPACITY // 2)
        settle_double = polls_to_settle(targets[i_double:], CAPACITY)
        half_overshoot = max(targets[i_half:i_double]) / (CAPACITY // 2)
        # Goodput while halved / doubled (after settling), against the capacity / service time.
        res = {
            "poll_interval_s": poll,
            "service_ms": SERVICE_MS,
            "callers": PROCS * TASKS,
            "static_sweep": sweep,
            "oracle_goodput_per_s": oracle,
            "oracle_limit": best["limit"],
            "ideal_goodput_per_s": CAPACITY / (SERVICE_MS / 1000),
            "polls_to_90pct": reach,
            "seconds_to_90pct": None
            if reach is None
            else (polls[reach - 1]["t_ns"] - t_start) / 1e9,
            "peak_overshoot_target": overshoot,
            "peak_overshoot_in_flight": inflight_overshoot,
            "steady_goodput_per_s": goodput,
            "steady_goodput_vs_oracle": goodput / oracle,
            "steady_window_targets": steady_targets,
            "polls_to_settle_after_halving": settle_half,
            "overshoot_after_halving": half_overshoot,
            "polls_to_settle_after_doubling": settle_double,
            "goodput_halved_per_s": rate(
                done, polls[min(len(polls) - 1, i_half + 3)]["t_ns"], changes[2][1]
            ),
            "goodput_doubled_end_per_s": rate(
                done, polls[max(i_double, len(polls) - 5)]["t_ns"], polls[-1]["t_ns"]
            ),
            "errors": errors,
            "client_warnings": events,
            "workers_stuck_in_close": len(w.stuck),
            "polls": [{**p, "t_s": (p.pop("t_ns") - t_start) / 1e9} for p in polls],
            "capacity_changes": [(i, (t - t_start) / 1e9, c) for i, t, c in changes],
        }
        _ = start
        rows_sweep = [
            (f"static limit {s['limit']}", s["goodput"], s["sim_running"], s["sim_waiting"])
            for s in sweep
        ]
        text = table(("static sweep", "goodput req/s", "sim running", "sim waiting"), rows_sweep)
        trace = [
            (i + 1, f"{p['t_s']:.1f}", p["capacity"], p["target"], p["reason"], p["in_flight"],
             p["running"], p["waiting_capacity"])
            for i, p in enumerate(res["polls"])
        ]  # fmt: skip
        text += "\n\n" + table(
            ("poll", "t s", "capacity", "target", "reason", "in flight", "running", "waiting"),
            trace,
        )
        ideal = res["ideal_goodput_per_s"]
        fig_rows = [
            ("polls to 90 % of 256", reach, f"<= {POLLS_TARGET}"),
            ("peak overshoot (max target / capacity)", overshoot, f"<= {OVERSHOOT_TARGET}"),
            ("peak fleet in-flight / capacity", inflight_overshoot, "-"),
            ("steady goodput req/s", goodput, f"oracle {oracle:.0f} (static {best['limit']})"),
            ("steady goodput / oracle", goodput / oracle, f">= {GOODPUT_TARGET}"),
            ("steady goodput / ideal (capacity / service)", goodput / ideal, "-"),
            ("steady window: targets", " ".join(map(str, steady_targets)), "-"),
            ("polls to settle after 256 -> 128", settle_half, "-"),
            ("max target / 128 after halving", half_overshoot, "-"),
            ("polls to settle after 128 -> 256", settle_double, "-"),
            ("goodput while halved req/s", res["goodput_halved_per_s"], f"ideal {ideal / 2:.0f}"),
            ("goodput at the end req/s", res["goodput_doubled_end_per_s"], f"ideal {ideal:.0f}"),
            ("errors / client warnings", f"{errors} / {sum(events.values())}", "0"),
        ]  # fmt: skip
        text += "\n\n" + table(("figure", "value", "target / baseline"), fig_rows)
        fig, ax = figure(1)
        a = ax[0][0]
        ts = np.array([(s[0] - t_start) / 1e9 for s in samples])
        a.plot(ts, [s[1] for s in samples], label="limit clients see", lw=1.2)
        a.plot(ts, [s[2] for s in samples], label="fleet in-flight", lw=1, alpha=0.8)
        pt = [p["t_s"] for p in res["polls"]]
        a.plot(pt, targets, "o", ms=3, label="published target (per poll)")
        cap_t = [(t - t_start) / 1e9 for _, t, _ in changes] + [max(ts[-1], pt[-1])]
        cap_v = [c for _, _, c in changes] + [changes[-1][2]]
        a.step(cap_t, cap_v, where="post", color="black", ls="--", label="capacity")
        a.set_xlabel("s since the coordinator started")
        a.set_ylabel("permits")
        a.set_xlim(left=-0.5)
        a.legend(loc="upper left", fontsize=8)
        fig.suptitle(
            f"ramp: floor {FLOOR}, ceiling {CEILING}, poll {poll:g} s, {PROCS * TASKS} callers, "
            f"service {SERVICE_MS:g} ms ({opts.flavor.label})"
        )
        save(NAME, opts, url, res, text, fig)
    return [
        Headline(NAME, "polls to 90 % of capacity", str(reach), f"<= {POLLS_TARGET}",
                 reach is not None and reach <= POLLS_TARGET),
        Headline(NAME, "peak overshoot (target / capacity)", f"{overshoot:.2f}",
                 f"<= {OVERSHOOT_TARGET}", overshoot <= OVERSHOOT_TARGET),
        Headline(NAME, "steady goodput / best static", f"{goodput / oracle:.3f}",
                 f">= {GOODPUT_TARGET}", goodput / oracle >= GOODPUT_TARGET),
        Headline(NAME, "polls to settle: halved / doubled", f"{settle_half} / {settle_double}",
                 "-", None),
    ]  # fmt: skip


if __name__ == "__main__":
    from ._common import main

    sys.exit(main(only=[NAME]))
