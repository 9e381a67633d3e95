"""pod_cost: what one pod costs Redis as its number of gates grows.

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

Targets: connections at 100 gates <= the 1-gate count + 8; held <= 10 calls/s at 100
gates; idle <= 2 calls/s at 100 gates; hand-off no worse than before (see README for the before
figures, measured from main's code with the same file).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

import redis.asyncio as aredis

from fleetgate.client import Fleet
from fleetgate.errors import FleetgateError
from fleetgate.keys import GateKeys

from ._cluster import CLUSTER_MASTERS, MODES, Target, script_calls, target
from ._common import Headline, Options, figure, log, open_fleet, percentiles, save, table
from ._server import PREFIX
from ._workers import _EventCounter

NAME = "pod_cost"
GROUPED = "+group"  # the mode of Cluster rows whose gates share one group's slot
LABELS = (*MODES, f"cluster{GROUPED}")
POD_NAME = "fgb-measured"
PEER_NAME = "fgb-peer"


async def _counters(target: Target) -> dict[str, float]:
    """INFO commandstats and CPU summed over the target's masters (off the event loop)."""
    return await asyncio.to_thread(target.counters)


def _fleet(target: Target, opts: Options, name: str) -> Fleet:
    # On a Cluster every gate found without state is fenced for a registration period (no
    # server-wide "born" mark reaches every slot); the standalone server here is marked old
    # (private_redis), so both measure gates with state: the fence is off on the Cluster.
    fence = {"recovery_fence": 0.0} if target.cluster else {}
    f = open_fleet(target.url, opts.flavor, **fence)
    f.runtime.redis_options["client_name"] = name
    return f


async def _hold_all(fleet: Fleet, gates: list[str]) -> list[Any]:
    """Enter a permit on every gate; return the context managers (still held)."""
    cms = [fleet.gate(g, floor=1, ceiling=1).permit(deadline=60) for g in gates]
    await asyncio.gather(*(cm.__aenter__() for cm in cms))
    return cms


async def _all_parked(target: Target, gates: list[str]) -> None:
    """Wait until one acquire is parked on every gate (a pipeline of ZCARDs per node)."""
    by_node: dict[str, list[str]] = {}
    for g in gates:
        key = GateKeys.of(PREFIX, g).waiters
        by_node.setdefault(target.node_for(key), []).append(key)
    clients = [aredis.Redis.from_url(u, decode_responses=True) for u in by_node]
    try:
        for _ in range(2000):
            await asyncio.sleep(0.01)
            counts: list[int] = []
            for r, keys in zip(clients, by_node.values(), strict=True):
                pipe = r.pipeline(transaction=False)
                for key in keys:
                    pipe.zcard(key)
                counts += await pipe.execute()
            if all(n == 1 for n in counts):
                return
    finally:
        for r in clients:
            await r.aclose()


async def _handoffs(
    holder: Fleet,
    waiter: Fleet,
    gates: list[str],
    held: list[Any],
    target: Target,
    measure_conns: bool,
) -> tuple[list[float], list[Any], int]:
    """``holder`` holds every gate (``held``); ``waiter`` parks one acquire per gate, then the
    holder releases gate by gate. Returns latencies (ms), the waiter's held permits and the
    waiter's connection count (over every node) while all its acquires were parked."""
    granted = [asyncio.Event() for _ in gates]
    stamp = [0] * len(gates)
    cms = [waiter.gate(g, floor=1, ceiling=1).permit(deadline=120) for g in gates]

    failed: list[BaseException] = []

    async def wait(i: int) -> None:
        try:
            await cms[i].__aenter__()
        except BaseException as exc:
            failed.append(exc)
            raise
        finally:
            stamp[i] = time.monotonic_ns()
            granted[i].set()

    tasks = [asyncio.create_task(wait(i)) for i in range(len(gates))]
    await _all_parked(target, gates)
    await asyncio.sleep(0.2)
    name = waiter.runtime.redis_options["client_name"]
    conns = await asyncio.to_thread(target.connections, name) if measure_conns else 0
    lat: list[float] = []
    for i in range(len(gates)):
        t0 = time.monotonic_ns()
        await held[i].__aexit__(None, None, None)
        await granted[i].wait()
        if failed:
            raise HandoffFailed(f"hand-off {i + 1} of {len(gates)}: {failed[0]!r}")
        lat.append((stamp[i] - t0) / 1e6)
    await asyncio.gather(*tasks)
    return lat, cms, conns


async def _rate(target: Target, seconds: float) -> tuple[float, float, float]:
    """Script calls/s, server µs of scripts per second, and redis-server CPU µs per second
    (user + sys, all of it: network, parsing, scripts), summed over the masters, over
    ``seconds``."""
    c0, t0 = await _counters(target), time.monotonic()
    await asyncio.sleep(seconds)
    c1, t1 = await _counters(target), time.monotonic()
    dt = t1 - t0
    (n0, u0), (n1, u1) = script_calls(c0), script_calls(c1)
    return (n1 - n0) / dt, (u1 - u0) / dt, (c1["cpu:redis"] - c0["cpu:redis"]) * 1e6 / dt


class HandoffFailed(RuntimeError):
    """A parked acquire of the measured pod ended without its grant (its deadline passed)."""


async def _one(
    target: Target, opts: Options, n: int, window: float, grouped: bool
) -> dict[str, Any]:
    """One size measured, or why it did not get through (a hand-off whose acquire failed, a
    lease lost -- the process's loop too busy to renew it --, the size's time bound, grouped
    names refused): then the row has ``error`` and no figures.
    ``grouped``: the gates are named ``{pc<n>}pc<n>-<i>``, one group (one slot) for them all."""
    events = _EventCounter()
    logging.getLogger("fleetgate.client").addHandler(events)
    bound = 120.0 + 0.06 * n  # 180 s at 1,000 gates
    mode = f"{target.mode}{GROUPED if grouped else ''}"
    gates = [f"{{pc{n}}}pc{n}-{i}" if grouped else f"pc{n}-{i}" for i in range(n)]
    try:
        row = {"mode": mode, **await asyncio.wait_for(_measure(target, opts, gates, window), bound)}
    except (HandoffFailed, TimeoutError, FleetgateError) as exc:  # LeaseLost, ConfigError
        log(f"{NAME}: {mode}, {n} gates did not get through: {exc!r}")
        row = {"mode": mode, "gates": n, "error": repr(exc)}
    finally:
        logging.getLogger("fleetgate.client").removeHandler(events)
    return {**row, "client_warnings": dict(events.counts)}


async def _measure(
    target: Target, opts: Options, gates: list[str], window: float
) -> dict[str, Any]:
    pod = _fleet(target, opts, POD_NAME)
    peer = _fleet(target, opts, PEER_NAME)
    try:
        return await _size(target, pod, peer, gates, window)
    finally:  # a size that did not get through leaves nothing running
        for fleet in (peer, pod):
            if not fleet.runtime.closing:
                await fleet.close()


async def _size(
    target: Target, pod: Fleet, peer: Fleet, gates: list[str], window: float
) -> dict[str, Any]:
    n = len(gates)
    await pod.start()
    await peer.start()
    # 1,000 gates: one round (the peer to the pod), 1,000 hand-offs; they are the slow size
    # on a loaded machine (the pod's loop renews 1,000 gates while handing off).
    rounds = 1 if n >= 1000 else max(2, min(20, math.ceil(40 / n)))
    lat: list[float] = []
    conns = 0
    held = await _hold_all(peer, gates)
    holder, waiter = peer, pod
    for k in range(rounds):
        got, held, c = await _handoffs(
            holder, waiter, gates, held, target, measure_conns=waiter is pod and k == 0
        )
        lat += got
        if waiter is pod and k == 0:
            conns = c
        holder, waiter = waiter, holder
    # the pod must end up holding every gate
    if holder is not pod:
        got, held, _ = await _handoffs(holder, waiter, gates, held, target, measure_conns=False)
        lat += got
    await peer.close()
    await asyncio.sleep(1.0)  # let the first renewals after the hand-offs settle
    held_rate, held_usec, held_cpu = await _rate(target, window)
    for cm in held:
        await cm.__aexit__(None, None, None)
    await asyncio.sleep(1.0)
    idle_rate, idle_usec, idle_cpu = await _rate(target, window)
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


COLUMNS = (
    "mode",
    "gates",
    "connections",
    "handoff p50 ms",
    "p99 ms",
    "held calls/s",
    "held µs/s",
    "idle calls/s",
    "idle µs/s",
    "warnings",
)


def _row(x: dict[str, Any]) -> tuple[Any, ...]:
    if "error" in x:
        return (x["mode"], x["gates"], *(["-"] * (len(COLUMNS) - 3)), "did not get through")
    return (
        x["mode"],
        x["gates"],
        x["connections"],
        round(x["handoff_p50_ms"], 3),
        round(x["handoff_p99_ms"], 3),
        round(x["held_calls_per_s"], 1),
        round(x["held_script_usec_per_s"]),
        round(x["idle_calls_per_s"], 2),
        round(x["idle_script_usec_per_s"]),
        "/".join(str(v) for v in x["client_warnings"].values()),
    )


def _plot(rows: list[dict[str, Any]], opts: Options) -> Any:
    fig, ax = figure(3)
    panels = (
        ("connections", "connections per pod (all acquires parked)"),
        ("held_calls_per_s", "script calls/s, a lease on each gate"),
        ("handoff_p99_ms", "hand-off p99 (ms)"),
    )
    for (column, title), a in zip(panels, ax[0], strict=True):
        for mode in LABELS:
            xs = [x for x in rows if x["mode"] == mode and "error" not in x]
            if xs:
                a.plot([x["gates"] for x in xs], [x[column] for x in xs], "o-", label=mode)
        a.set_xscale("log")
        a.set_yscale("log")
        a.set_xlabel("gates in use")
        a.set_title(title, fontsize=9)
        a.legend()
    fig.suptitle(f"one pod's cost to Redis ({opts.flavor.label})")
    return fig


def _sizes(mode: str, opts: Options) -> list[tuple[int, bool]]:
    """(gates, grouped) of a run: on the Cluster plain names, then one group per size; the
    Cluster part of --quick stays short (CI runs it)."""
    if mode == "cluster":
        full = [(n, g) for g in (False, True) for n in (1, 10, 100, 1000)]
        return opts.pick(full, [(1, False), (10, False), (10, True)])
    return [(n, False) for n in opts.pick([1, 10, 100, 1000], [1, 10, 100])]


def run(opts: Options) -> list[Headline]:
    window = opts.pick(10.0, 4.0)
    rows: list[dict[str, Any]] = []
    for mode in MODES:  # the Cluster last: save() describes the machine from a live node
        with target(mode) as t:
            for n, grouped in _sizes(mode, opts):
                log(f"{NAME}: {mode}{GROUPED if grouped else ''}, {n} gates")
                rows.append(opts.flavor.run(_one(t, opts, n, window, grouped)))
            if mode == MODES[-1]:
                text = table(COLUMNS, [_row(x) for x in rows])
                text += "\nwarnings = client log lines fallback/requeue/lease-lost (0/0/0 = clean)"
                data = {"rows": rows, "window_s": window, "cluster_masters": CLUSTER_MASTERS}
                save(NAME, opts, t.nodes[0], data, text, _plot(rows, opts))
    return _headlines(rows)


def _headlines(rows: list[dict[str, Any]]) -> list[Headline]:
    heads: list[Headline] = []
    for mode in LABELS:
        if not any(x["mode"] == mode for x in rows):
            continue
        by = {x["gates"]: x for x in rows if x["mode"] == mode and "error" not in x}
        if not any(g <= 100 for g in by):
            heads.append(Headline(NAME, f"{mode}: sizes measured", "none", "1..100", False))
            continue
        top = by[max(g for g in by if g <= 100)]
        one = by.get(1, top)
        n = top["gates"]
        # the targets are set at 100 gates, on standalone and on Cluster
        targeted = n == 100
        cap = one["connections"] + 8 if mode == "standalone" else 30
        heads += [
            Headline(
                NAME,
                f"{mode}: connections at {n} gates",
                f"{top['connections']} (1 gate: {one['connections']})",
                f"<= {cap}" if targeted else "-",
                top["connections"] <= cap if targeted else None,
            ),
            Headline(
                NAME,
                f"{mode}: held: calls/s at {n} gates",
                f"{top['held_calls_per_s']:.1f}",
                "<= 10" if targeted else "-",
                top["held_calls_per_s"] <= 10 if targeted else None,
            ),
            Headline(
                NAME,
                f"{mode}: idle: calls/s at {n} gates",
                f"{top['idle_calls_per_s']:.2f}",
                "<= 2" if targeted else "-",
                top["idle_calls_per_s"] <= 2 if targeted else None,
            ),
            Headline(
                NAME,
                f"{mode}: hand-off p50/p99 at {n} gates",
                f"{top['handoff_p50_ms']:.2f}/{top['handoff_p99_ms']:.2f} ms",
                "no worse than before",
                None,
            ),
        ]
    return heads


if __name__ == "__main__":
    import sys

    from ._common import main

    sys.exit(main(only=[NAME]))
