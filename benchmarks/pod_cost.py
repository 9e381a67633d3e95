"""pod_cost: what one pod costs Redis as its number of gates grows (issue 11 item 2).

At 1 / 10 / 100 (/ 1,000 in full mode) gates of limit 1, against a private redis-server:

* **connections** of the measured pod (``CLIENT LIST``, by client name) while one acquire per
  gate is parked on every gate at once ("in use"), pool and wake listeners included;
* **hand-off** p50/p99: a second fleet (same process, its own connections) holds every gate;
  it releases them one at a time and the measured pod's parked acquire resumes; then the roles
  swap. Latency = release call start -> the woken block starts;
* **background script calls/s** (``INFO commandstats``: every EVAL/EVALSHA, so pipelined per-gate
  scripts each count) with the second fleet closed: "held" = the pod holds a lease on each gate
  and does nothing else; "idle" = the leases released, the gates still known to the pod (no lease,
  no waiter).

Targets (issue 11): connections at 100 gates <= the 1-gate count + 8; held <= 10 calls/s at 100
gates; idle <= 2 calls/s at 100 gates; hand-off no worse than before (see README for the before
figures, measured from main's code with the same file).
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import redis.asyncio as aredis

from fleetgate.client import Fleet
from fleetgate.keys import GateKeys

from ._common import Headline, Options, log, open_fleet, percentiles, save, table
from ._server import PREFIX, private_redis

NAME = "pod_cost"
POD_NAME = "fgb-measured"
PEER_NAME = "fgb-peer"


async def _script_calls(r: aredis.Redis) -> tuple[float, float]:
    """Script calls and their server µs so far (INFO commandstats: EVAL + EVALSHA)."""
    stats = await r.info("commandstats")
    scripts = [v for k, v in stats.items() if k.removeprefix("cmdstat_") in ("eval", "evalsha")]
    return float(sum(v["calls"] for v in scripts)), float(sum(v["usec"] for v in scripts))


async def _connections(r: aredis.Redis, name: str) -> int:
    clients = await r.client_list()
    return sum(1 for c in clients if c.get("name") == name)


def _fleet(url: str, opts: Options, name: str) -> Fleet:
    f = open_fleet(url, opts.flavor)
    f.runtime.redis_options["client_name"] = name
    return f


async def _hold_all(fleet: Fleet, gates: list[str]) -> list[Any]:
    """Enter a permit on every gate; return the context managers (still held)."""
    cms = [fleet.gate(g, floor=1, ceiling=1).permit(deadline=60) for g in gates]
    await asyncio.gather(*(cm.__aenter__() for cm in cms))
    return cms


async def _handoffs(
    holder: Fleet,
    waiter: Fleet,
    gates: list[str],
    held: list[Any],
    r: aredis.Redis,
    measure_conns: bool,
) -> tuple[list[float], list[Any], int]:
    """``holder`` holds every gate (``held``); ``waiter`` parks one acquire per gate, then the
    holder releases gate by gate. Returns latencies (ms), the waiter's held permits and the
    waiter's connection count while all its acquires were parked."""
    granted = [asyncio.Event() for _ in gates]
    stamp = [0] * len(gates)
    cms = [waiter.gate(g, floor=1, ceiling=1).permit(deadline=60) for g in gates]

    async def wait(i: int) -> None:
        await cms[i].__aenter__()
        stamp[i] = time.monotonic_ns()
        granted[i].set()

    tasks = [asyncio.create_task(wait(i)) for i in range(len(gates))]
    # every acquire parked (queue length 1 on each gate)
    for _ in range(2000):
        await asyncio.sleep(0.01)
        pipe = r.pipeline(transaction=False)
        for g in gates:
            pipe.zcard(GateKeys.of(PREFIX, g).waiters)
        if all(n == 1 for n in await pipe.execute()):
            break
    await asyncio.sleep(0.2)
    conns = (
        await _connections(r, waiter.runtime.redis_options["client_name"]) if measure_conns else 0
    )
    lat: list[float] = []
    for i in range(len(gates)):
        t0 = time.monotonic_ns()
        await held[i].__aexit__(None, None, None)
        await granted[i].wait()
        lat.append((stamp[i] - t0) / 1e6)
    await asyncio.gather(*tasks)
    return lat, cms, conns


async def _redis_cpu(r: aredis.Redis) -> float:
    """redis-server's CPU seconds so far (user + sys, all of it: network, parsing, scripts)."""
    cpu = await r.info("cpu")
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


async def _rate(r: aredis.Redis, seconds: float) -> tuple[float, float, float]:
    """Script calls/s, server µs of scripts per second, and redis-server CPU µs per second
    over ``seconds``."""
    (c0, u0), p0, t0 = await _script_calls(r), await _redis_cpu(r), time.monotonic()
    await asyncio.sleep(seconds)
    (c1, u1), p1, t1 = await _script_calls(r), await _redis_cpu(r), time.monotonic()
    dt = t1 - t0
    return (c1 - c0) / dt, (u1 - u0) / dt, (p1 - p0) * 1e6 / dt


async def _one(url: str, opts: Options, n: int, window: float) -> dict[str, Any]:
    gates = [f"pc{n}-{i}" for i in range(n)]
    r = aredis.Redis.from_url(url, decode_responses=True)
    pod = _fleet(url, opts, POD_NAME)
    peer = _fleet(url, opts, PEER_NAME)
    await pod.start()
    await peer.start()
    rounds = max(2, min(20, math.ceil(40 / n)))
    lat: list[float] = []
    conns = 0
    held = await _hold_all(peer, gates)
    holder, waiter = peer, pod
    for k in range(rounds):
        got, held, c = await _handoffs(holder, waiter, gates, held, r, measure_conns=waiter is pod)
        lat += got
        if waiter is pod and k == 0:
            conns = c
        holder, waiter = waiter, holder
    # the pod must end up holding every gate
    if holder is not pod:
        got, held, _ = await _handoffs(holder, waiter, gates, held, r, measure_conns=False)
        lat += got
    await peer.close()
    await asyncio.sleep(1.0)  # let the first renewals after the hand-offs settle
    held_rate, held_usec, held_cpu = await _rate(r, window)
    for cm in held:
        await cm.__aexit__(None, None, None)
    await asyncio.sleep(1.0)
    idle_rate, idle_usec, idle_cpu = await _rate(r, window)
    await pod.close()
    await r.aclose()
    p = percentiles(lat, (50, 99))
    return {
        "gates": n,
        "connections": conns,
        "handoff_p50_ms": p["p50"],
        "handoff_p99_ms": p["p99"],
        "handoffs": len(lat),
        "held_calls_per_s": held_rate,
        "held_script_usec_per_s": held_usec,
        "held_redis_cpu_usec_per_s": held_cpu,
        "idle_calls_per_s": idle_rate,
        "idle_script_usec_per_s": idle_usec,
        "idle_redis_cpu_usec_per_s": idle_cpu,
    }


def run(opts: Options) -> list[Headline]:
    sizes = opts.pick([1, 10, 100, 1000], [1, 10, 100])
    window = opts.pick(10.0, 4.0)
    rows = []
    with private_redis() as proc:
        url = proc.url
        for n in sizes:
            log(f"{NAME}: {n} gates")
            rows.append(opts.flavor.run(_one(url, opts, n, window)))
        text = table(
            (
                "gates",
                "connections",
                "handoff p50 ms",
                "p99 ms",
                "held calls/s",
                "held µs/s",
                "idle calls/s",
                "idle µs/s",
            ),
            [
                (
                    x["gates"],
                    x["connections"],
                    round(x["handoff_p50_ms"], 3),
                    round(x["handoff_p99_ms"], 3),
                    round(x["held_calls_per_s"], 1),
                    round(x["held_script_usec_per_s"]),
                    round(x["idle_calls_per_s"], 2),
                    round(x["idle_script_usec_per_s"]),
                )
                for x in rows
            ],
        )
        save(NAME, opts, url, {"rows": rows, "window_s": window}, text)
    by = {x["gates"]: x for x in rows}
    one, hundred = by[1], by[100]
    return [
        Headline(
            NAME,
            "connections at 100 gates",
            f"{hundred['connections']} (1 gate: {one['connections']})",
            f"<= {one['connections'] + 8}",
            hundred["connections"] <= one["connections"] + 8,
        ),
        Headline(
            NAME,
            "held: calls/s at 100 gates",
            f"{hundred['held_calls_per_s']:.1f}",
            "<= 10",
            hundred["held_calls_per_s"] <= 10,
        ),
        Headline(
            NAME,
            "idle: calls/s at 100 gates",
            f"{hundred['idle_calls_per_s']:.2f}",
            "<= 2",
            hundred["idle_calls_per_s"] <= 2,
        ),
        Headline(
            NAME,
            "hand-off p50/p99 at 100 gates",
            f"{hundred['handoff_p50_ms']:.2f}/{hundred['handoff_p99_ms']:.2f} ms",
            "no worse than before",
            None,
        ),
    ]
