"""proxy_workers: ``fleetgate proxy --workers N`` against one worker and against direct calls, in
one run.

Every server is an OS process of its own: a private redis-server, the reranker simulator (answers
at once) and the vLLM simulator (streams its 20 tokens at once: the proxy's work per chunk, not
the simulator's timing, is what is measured), and, side by side, ``fleetgate proxy
--config`` with a route to each and ``--workers 1`` and ``--workers N`` (N = the machine's
cores, at least 2). The gate's limit is far above the load: every request takes and returns a
permit without waiting. For each proxy, and for the simulators directly (the baseline):

1. **added latency at light load**: one caller, one request at a time, alternately straight and
   through the proxy (:func:`.proxy.light_load`); streamed: the added time to first token
   (:func:`._proxy_stream.streaming`);
2. **throughput**: LOADERS load-generator processes x USERS closed-loop callers for a fixed time:
   req/s (streams/s), p50/p99 under that load, the proxy's CPU (parent and workers) per request
   and its req/s per core (requests per CPU-second of the proxy's processes). Rounds of direct,
   1 worker, N workers back to back (both proxies stay up, the idle one costs a heartbeat), so
   that load from outside the benchmark falls on all three alike; medians over the rounds, and
   the N / 1 ratio of each round.

The load generators, Redis, the simulators and the proxy's workers share the machine's cores:
on a 2-core machine a second worker can only take CPU the others leave; the figures say how much
of the machine was busy.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from fleetgate.tools.proxyproc import start_proxy_process, stop_process

from ._common import Headline, Options, figure, log, percentiles, save, table
from ._proxy_stream import streaming
from ._server import PREFIX, busy_fraction, configure_gate, machine_jiffies, private_redis
from .burst import ShardedHTTP, sim_process
from .proxy import BODY, GATE, ProxyProcess, light_load

NAME = "proxy_workers"
LOADERS, USERS = 2, 16
_CHAT = "/v1/chat/completions"
_STREAM = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "stream": True,
           "max_tokens": 20}  # fmt: skip
_RERANK_SIM = ("--concurrency", "100000", "--queue-size", "100000", "--request-timeout-ms", "0",
               "--base-ms", "0", "--per-passage-ms", "0")  # fmt: skip
_VLLM_SIM = ("--capacity", "100000", "--prefill-ms", "0", "--service-ms", "0")


# -- the load generators (spawned processes) ------------------------------------------------


def load_caller(base: str, users: int, seconds: float, start_at: float, stream: bool) -> Any:
    """``users`` closed-loop callers from ``start_at`` (wall clock) for ``seconds``: ok, failed,
    elapsed and each ok call's latency (s; a stream: to its last chunk)."""

    async def main() -> dict[str, Any]:
        ok = failed = 0
        lat: list[float] = []
        async with ShardedHTTP(base, 4, users // 4) as http:
            await http.warm()
            await asyncio.sleep(max(0.0, start_at - time.time()))
            end = time.monotonic() + seconds

            async def one() -> bool:
                if not stream:
                    return (await http.post("/v1/ranking", json=BODY)).status_code == 200
                async with http.pick().stream("POST", _CHAT, json=_STREAM) as r:
                    async for _ in r.aiter_raw():
                        pass
                    return r.status_code == 200

            async def user() -> None:
                nonlocal ok, failed
                while time.monotonic() < end:
                    t0 = time.perf_counter()
                    if await one():
                        ok += 1
                        lat.append(time.perf_counter() - t0)
                    else:
                        failed += 1

            t0 = time.monotonic()
            await asyncio.gather(*(user() for _ in range(users)))
            return {"ok": ok, "failed": failed, "elapsed": time.monotonic() - t0, "lat": lat}

    return asyncio.run(main())


def under_load(
    pool: Any, base: str, seconds: float, stream: bool, proxy: ProxyProcess | None
) -> dict[str, Any]:
    """LOADERS x USERS callers at ``base`` for ``seconds``; the proxy's CPU when given."""
    start_at = time.time() + 1.0  # the loaders' connections are warm by then
    args = [(base, USERS, seconds, start_at, stream)] * LOADERS
    pending = pool.starmap_async(load_caller, args)
    time.sleep(max(0.0, start_at - time.time()))
    cpu0, busy0 = (proxy.cpu() if proxy else 0.0), machine_jiffies()
    outs = pending.get(timeout=seconds + 60)
    cpu1, busy1 = (proxy.cpu() if proxy else 0.0), machine_jiffies()
    ok = sum(o["ok"] for o in outs)
    elapsed = max(o["elapsed"] for o in outs)
    lat = [x for o in outs for x in o["lat"]]
    res: dict[str, Any] = {
        "ok": ok,
        "failed": sum(o["failed"] for o in outs),
        "rps": ok / elapsed,
        "latency_ms": {p: v * 1000 for p, v in percentiles(lat, (50, 99)).items()},
        "machine_busy": busy_fraction(busy0, busy1),
    }
    if proxy is not None:
        cpu = cpu1 - cpu0
        res["proxy_cpu_us_per_request"] = cpu / max(1, ok) * 1e6
        res["rps_per_proxy_core"] = ok / cpu if cpu > 0 else float("nan")
        res["proxy_cores_busy"] = cpu / elapsed
    kind = "streams" if stream else "req"
    log(f"{NAME}: {'direct' if proxy is None else 'proxy'}: {res['rps']:,.0f} {kind}/s, "
        f"{res['failed']} failed, machine busy {res['machine_busy']}")  # fmt: skip
    return res


# -- the proxy under test -----------------------------------------------------------------


@contextlib.contextmanager
def proxy_with_workers(
    redis_url: str, rerank: str, vllm: str, workers: int, logdir: str
) -> Iterator[ProxyProcess]:
    """``fleetgate proxy --config`` (/v1/ranking -> the reranker, /v1 -> vLLM, both on GATE)
    with ``--workers WORKERS``."""
    toml = Path(logdir) / "proxy.toml"
    toml.write_text(
        '[proxy]\nlisten = "127.0.0.1:0"\n\n'
        f'[[routes]]\npath = "/v1/ranking"\nupstream = "{rerank}"\ngate = "{GATE}"\n\n'
        f'[[routes]]\npath = "/v1"\nupstream = "{vllm}"\ngate = "{GATE}"\n'
    )
    args = ["--config", str(toml), "--redis", redis_url, "--prefix", PREFIX]
    args += ["--workers", str(workers)]
    proc, url = start_proxy_process(args, str(Path(logdir) / f"proxy-{workers}.log"))
    try:
        log(f"{NAME}: proxy pid {proc.pid}, {workers} worker(s), on {url}")
        yield ProxyProcess(proc, url)
    finally:
        stop_process(proc, timeout=30)


def rounds(
    pool: Any, sims: dict[str, str], proxies: dict[int, ProxyProcess], count: int, seconds: float
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """``count`` rounds, each: plain then streamed, straight then through each proxy, back to
    back (a machine's other load hits every way alike): kind -> way -> [one result a round]."""
    out: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for r in range(count):
        log(f"{NAME}: round {r + 1} of {count}")
        for kind, sim in sims.items():
            ways = out.setdefault(kind, {})
            stream = kind == "stream"
            ways.setdefault("direct", []).append(under_load(pool, sim, seconds, stream, None))
            for n, p in proxies.items():
                ways.setdefault(str(n), []).append(under_load(pool, p.url, seconds, stream, p))
    return out


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The rounds of one way: the median of each figure (and each round's req/s)."""
    keys = [k for k, v in results[0].items() if isinstance(v, float)]
    med: dict[str, Any] = {k: float(np.median([r[k] for r in results])) for k in keys}
    med["latency_ms"] = {
        p: float(np.median([r["latency_ms"][p] for r in results])) for p in ("p50", "p99")
    }
    med["rps_rounds"] = [r["rps"] for r in results]
    med["failed"] = sum(r["failed"] for r in results)
    return med


# -- the run ----------------------------------------------------------------------------------


def _rows(
    direct: dict[str, Any], runs: dict[int, dict[str, Any]], n: int, ratios: dict[str, list[float]]
) -> list[tuple[str, str]]:
    one, many = runs[1], runs[n]
    rows: list[tuple[str, str]] = []
    for label, r in (("1 worker", one), (f"{n} workers", many)):
        add, ttft = r["light"]["added_ms"], r["stream_light"]["added_ttft_ms"]
        pl, st = r["plain"], r["stream"]
        rows += [
            (f"{label}: added p50 / p99 ms (light load)", f"{add['p50']:.2f} / {add['p99']:.2f}"),
            (f"{label}: stream added time to first token p50 / p99 ms",
             f"{ttft['p50']:.2f} / {ttft['p99']:.2f}"),
            (f"{label}: req/s ({LOADERS * USERS} callers; direct {direct['plain']['rps']:,.0f})",
             f"{pl['rps']:,.0f}"),
            (f"{label}: p50 / p99 ms under that load (direct "
             f"{direct['plain']['latency_ms']['p50']:.1f} / "
             f"{direct['plain']['latency_ms']['p99']:.1f})",
             f"{pl['latency_ms']['p50']:.1f} / {pl['latency_ms']['p99']:.1f}"),
            (f"{label}: proxy CPU µs per request; req/s per proxy core",
             f"{pl['proxy_cpu_us_per_request']:.0f}; {pl['rps_per_proxy_core']:,.0f}"),
            (f"{label}: streams/s (direct {direct['stream']['rps']:,.0f})", f"{st['rps']:,.0f}"),
            (f"{label}: proxy CPU µs per stream (20 chunks); streams/s per proxy core",
             f"{st['proxy_cpu_us_per_request']:.0f}; {st['rps_per_proxy_core']:,.0f}"),
            (f"{label}: proxy cores busy (plain / stream); machine busy",
             f"{pl['proxy_cores_busy']:.2f} / {st['proxy_cores_busy']:.2f}; "
             f"{pl['machine_busy'] or float('nan'):.2f}"),
        ]  # fmt: skip
    for kind, what in (("plain", "req/s"), ("stream", "streams/s")):
        each = ", ".join(f"{x:.2f}" for x in ratios[kind])
        rows.append((f"{what} {n} workers / 1 worker, each round", each))
    return rows


def _plot(direct: dict[str, Any], runs: dict[int, dict[str, Any]], opts: Options) -> Any:
    fig, ax = figure(2)
    labels = ["direct", *(f"{n} worker{'s' if n > 1 else ''}" for n in runs)]
    for col, kind in enumerate(("plain", "stream")):
        values = [direct[kind]["rps"], *(r[kind]["rps"] for r in runs.values())]
        ax[0][col].bar(labels, values, color=["grey", *["C0"] * len(runs)])
        ax[0][col].set_ylabel("streams/s" if kind == "stream" else "requests/s")
        ax[0][col].set_title(f"{kind}: {LOADERS * USERS} closed-loop callers", fontsize=9)
        for i, v in enumerate(values):
            ax[0][col].text(i, v, f"{v:,.0f}", ha="center", va="bottom", fontsize=8)
    cores = os.cpu_count()
    fig.suptitle(f"fleetgate proxy --workers ({cores} cores shared by all processes"
                 f"{', quick' if opts.quick else ''})")  # fmt: skip
    return fig


def run(opts: Options) -> list[Headline]:
    seconds, count = opts.pick(10.0, 2.5), opts.pick(3, 1)
    n = max(2, os.cpu_count() or 2)
    logdir = tempfile.mkdtemp(prefix="fleetgate-bench-workers-")
    ctx = mp.get_context("spawn")
    with (
        private_redis() as rp,
        sim_process("rerank", *_RERANK_SIM) as rerank,
        sim_process("vllm", *_VLLM_SIM) as vllm,
        ctx.Pool(LOADERS) as pool,
        proxy_with_workers(rp.url, rerank.url, vllm.url, 1, logdir) as p1,
        proxy_with_workers(rp.url, rerank.url, vllm.url, n, logdir) as pn,
    ):
        configure_gate(rp.url, GATE, floor=100_000, ceiling=100_000, max_queued=100_000,
                       lease_ms=10_000, waiter_ms=5_000)  # fmt: skip
        proxies = {1: p1, n: pn}
        runs: dict[int, dict[str, Any]] = {}
        for workers, p in proxies.items():
            log(f"{NAME}: light load, {workers} worker(s)")
            light = light_load(rerank.url, p.url, opts.pick(1000, 200))
            light.pop("samples")
            stream_light = streaming(vllm.url, p.url, opts.pick(200, 30))
            runs[workers] = {"light": light, "stream_light": stream_light}
        got = rounds(pool, {"plain": rerank.url, "stream": vllm.url}, proxies, count, seconds)
        direct = {kind: summary(ways["direct"]) for kind, ways in got.items()}
        for workers, r in runs.items():
            r.update({kind: summary(ways[str(workers)]) for kind, ways in got.items()})
        ratios = {
            kind: [b["rps"] / a["rps"] for a, b in zip(ways["1"], ways[str(n)], strict=True)]
            for kind, ways in got.items()
        }
        text = table(("figure", "value"), _rows(direct, runs, n, ratios))
        data = {"direct": direct, "workers": {str(k): v for k, v in runs.items()},
                "rounds": count, "seconds": seconds, "loaders": LOADERS,
                "users_per_loader": USERS, "cpus": os.cpu_count(),
                "ratio_rps_by_round": ratios, "all": got}  # fmt: skip
        save(NAME, opts, rp.url, data, text, _plot(direct, runs, opts))
    many, ratio = runs[n], float(np.median(ratios["plain"]))
    return [
        Headline(NAME, f"added p50 / p99, {n} workers (light load)",
                 f"{many['light']['added_ms']['p50']:.2f} / "
                 f"{many['light']['added_ms']['p99']:.2f} ms", "p50 <= 1 ms",
                 bool(many["light"]["added_ms"]["p50"] <= 1.0)),
        Headline(NAME, f"req/s {n} workers / 1 worker ({os.cpu_count()} shared cores)",
                 f"{ratio:.2f}", "-", None),
        Headline(NAME, "req/s per proxy core (1 worker)",
                 f"{runs[1]['plain']['rps_per_proxy_core']:,.0f}", ">= 1,500",
                 bool(runs[1]["plain"]["rps_per_proxy_core"] >= 1500)),
    ]  # fmt: skip


if __name__ == "__main__":
    from ._common import main as _main

    sys.exit(_main(only=[NAME]))
