"""proxy: what ``fleetgate proxy`` costs and what it holds, against baselines of the same run.

Every server is an OS process of its own: a private redis-server, the reranker simulator
(``python -m fleetgate.tools.sim.rerank``) and ``fleetgate proxy`` processes (``--upstream
SIM --gate G``, access log on as deployed, to a file). Four parts:

1. **added latency at light load**: one caller, one request at a time (10 passages), alternately
   straight to the simulator (``--base-ms 0``) and through the proxy; p50/p99 of both, the
   difference and the ratio;
2. **requests/s per proxy process with the gate in the path**: 16 closed-loop callers for a fixed
   time, straight vs through one proxy (the gate's limit far above the load, so every request
   takes and returns a permit without waiting); the ratio, and the proxy's CPU per request;
3. **``burst``'s rerank burst through two proxies**: R requests (1000; ``--quick`` 200), each
   10 rerank calls at most 8 at once, all fired at one instant from two caller processes (one per
   proxy, each with a pool of 256 connections as a Java service would have) at a reranker of
   capacity 32 with a queue of 64 and a 5 s timeout (503/504 beyond: ``burst``'s server), the
   gate's limit 32. Failed calls must be 0; makespan vs the oracle = calls x 20 ms / 32. As in
   ``burst``, the same burst against a simulator that answers at once and never rejects gives
   the CPU floor of the path (2 cores shared by callers, proxies, simulator and Redis);
4. **streaming**: streamed chat completions from the vLLM simulator (``--prefill-ms 20``, 20
   tokens over 100 ms), one at a time, alternately straight and through a proxy: the proxy's added
   time to first token and the chunks' spread (they pass one by one, :mod:`._proxy_stream`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from fleetgate.tools.proxyproc import start_proxy_process, stop_process

from ._common import Headline, Options, figure, log, percentiles, save, table
from ._proxy_stream import SIM_ARGS, streaming
from ._server import PREFIX, busy_fraction, configure_gate, machine_jiffies, private_redis
from ._workers import Sync, Workers, cpu_seconds
from .burst import ShardedHTTP, SimProcess, sim_process

NAME = "proxy"
GATE = "bench-proxy"
CALLS, CAP, SERVICE_MS, FAN = 10, 32, 20.0, 8
MAKESPAN_TARGET = 1.05
BODY = {"query": {"text": "q"}, "passages": [{"text": f"passage {i}"} for i in range(10)]}


@dataclass
class ProxyProcess:
    proc: subprocess.Popen[bytes]
    url: str

    def pids(self) -> list[int]:
        """The proxy's process and, with ``--workers``, its worker processes (Linux /proc)."""
        try:
            with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
                return [self.proc.pid, *(int(p) for p in f.read().split())]
        except OSError:
            return [self.proc.pid]

    def cpu(self) -> float:
        """CPU seconds the proxy has used: its process and its workers (user + system)."""
        return sum(_cpu_of(pid) for pid in self.pids())


def _cpu_of(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


@contextlib.contextmanager
def proxy_process(
    redis_url: str, upstream: str, logdir: str, workers: int = 1
) -> Iterator[ProxyProcess]:
    """``fleetgate proxy --upstream UPSTREAM --gate GATE [--workers N]`` on a free port until
    the block ends."""
    args = ["--upstream", upstream, "--gate", GATE, "--redis", redis_url, "--prefix", PREFIX]
    if workers > 1:
        args += ["--workers", str(workers)]
    with tempfile.NamedTemporaryFile(dir=logdir, suffix=".log", delete=False) as logfile:
        log_path = logfile.name
    proc, url = start_proxy_process(args, log_path)
    try:
        log(f"proxy pid {proc.pid} ({workers} worker(s)) on {url} -> {upstream}")
        yield ProxyProcess(proc, url)
    finally:
        stop_process(proc, timeout=30)


# -- 1. added latency -------------------------------------------------------------------------


def light_load(direct: str, proxied: str, n: int) -> dict[str, Any]:
    """``n`` sequential requests each way, alternating (drift hits both alike)."""
    lat: dict[str, list[float]] = {"direct": [], "proxy": []}
    with httpx.Client(timeout=30) as http:
        for base in (direct, proxied):  # warm: connections, the gate's first registration
            for _ in range(20):
                http.post(base + "/v1/ranking", json=BODY).raise_for_status()
        for _ in range(n):
            for label, base in (("direct", direct), ("proxy", proxied)):
                t0 = time.perf_counter()
                http.post(base + "/v1/ranking", json=BODY).raise_for_status()
                lat[label].append(time.perf_counter() - t0)
    out: dict[str, Any] = {
        k: {p: v * 1000 for p, v in percentiles(vs, (50, 99)).items()} for k, vs in lat.items()
    }
    out["added_ms"] = {p: out["proxy"][p] - out["direct"][p] for p in ("p50", "p99")}
    out["ratio"] = {p: out["proxy"][p] / out["direct"][p] for p in ("p50", "p99")}
    out["samples"] = {k: sorted(v) for k, v in lat.items()}
    return out


# -- 2. throughput ----------------------------------------------------------------------------


async def _closed_loop(base: str, users: int, seconds: float) -> tuple[int, int, float]:
    """``users`` callers back to back for ``seconds``: (ok, failed, elapsed)."""
    ok = failed = 0
    async with ShardedHTTP(base, 4, users // 4) as http:
        await http.warm()
        end = time.monotonic() + seconds

        async def user() -> None:
            nonlocal ok, failed
            while time.monotonic() < end:
                r = await http.post("/v1/ranking", json=BODY)
                if r.status_code == 200:
                    ok += 1
                else:
                    failed += 1

        t0 = time.monotonic()
        await asyncio.gather(*(user() for _ in range(users)))
        return ok, failed, time.monotonic() - t0


def throughput(direct: str, proxy: ProxyProcess, seconds: float, users: int = 16) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, base in (("direct", direct), ("proxy", proxy.url)):
        cpu0, busy0 = proxy.cpu(), machine_jiffies()
        ok, failed, elapsed = asyncio.run(_closed_loop(base, users, seconds))
        cpu1, busy1 = proxy.cpu(), machine_jiffies()
        busy = busy_fraction(busy0, busy1)
        out[label] = {"ok": ok, "failed": failed, "rps": ok / elapsed, "machine_busy": busy}
        if label == "proxy":
            out[label]["proxy_cpu_us_per_request"] = (cpu1 - cpu0) / max(1, ok) * 1e6
        log(f"{NAME}: throughput {label}: {ok / elapsed:,.0f} req/s, {failed} failed")
    out["ratio"] = out["proxy"]["rps"] / out["direct"]["rps"]
    return out


# -- 3. the burst -----------------------------------------------------------------------------


def burst_caller(sync: Sync, proxy_url: str, requests: int) -> dict[str, Any]:
    """``requests`` requests of CALLS calls (at most FAN at once each), all at the common start,
    through one proxy; 256 connections (32 pools of 8)."""

    async def main() -> dict[str, Any]:
        failed_calls = failed_requests = 0
        statuses: dict[int, int] = {}
        latencies: list[float] = []
        headers = {"X-Fleetgate-Deadline-Ms": "120000"}
        async with ShardedHTTP(proxy_url, 32, 8) as http:
            await http.warm()
            start = await sync.aready()

            async def call() -> None:
                nonlocal failed_calls
                r = await http.post("/v1/ranking", json=BODY, headers=headers)
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                if r.status_code != 200:
                    failed_calls += 1
                    raise RuntimeError(f"status {r.status_code}")

            async def request() -> None:
                nonlocal failed_requests
                fan = asyncio.Semaphore(FAN)

                async def one() -> None:
                    async with fan:
                        await call()

                try:
                    await asyncio.gather(*(one() for _ in range(CALLS)))
                except Exception:
                    failed_requests += 1
                latencies.append((time.monotonic_ns() - start) / 1e9)

            await asyncio.sleep(max(0.0, (start - time.monotonic_ns()) / 1e9))
            cpu0 = cpu_seconds()
            await asyncio.gather(*(request() for _ in range(requests)))
            return {
                "failed_calls": failed_calls,
                "failed_requests": failed_requests,
                "statuses": statuses,
                "latencies": latencies,
                "end": time.monotonic_ns(),
                "cpu": cpu_seconds() - cpu0,
            }

    return asyncio.run(main())


def burst(redis_url: str, sim: SimProcess, requests: int, logdir: str) -> dict[str, Any]:
    calls = requests * CALLS
    configure_gate(
        redis_url, GATE, floor=CAP, ceiling=CAP, max_queued=4 * calls, lease_ms=10_000,
        waiter_ms=5_000,
    )  # fmt: skip
    sim.reset_peaks()
    before = sim.stats()
    with (
        proxy_process(redis_url, sim.url, logdir) as pa,
        proxy_process(redis_url, sim.url, logdir) as pb,
    ):
        pcpu0 = pa.cpu() + pb.cpu()
        args = [(pa.url, requests // 2), (pb.url, requests - requests // 2)]
        with Workers(burst_caller, args) as w:
            start = w.go()
            busy0 = machine_jiffies()
            out = w.results(timeout=300)
        busy1 = machine_jiffies()
        pcpu = pa.cpu() + pb.cpu() - pcpu0
    after = sim.stats()
    makespan = (max(o["end"] for o in out) - start) / 1e9
    lat = sorted(x for o in out for x in o["latencies"])
    statuses: dict[str, int] = {}
    for o in out:
        for code, n in o["statuses"].items():
            statuses[str(code)] = statuses.get(str(code), 0) + n
    busy = busy_fraction(busy0, busy1)
    res = {
        "requests": requests,
        "calls": calls,
        "failed_calls": sum(o["failed_calls"] for o in out),
        "failed_requests": sum(o["failed_requests"] for o in out),
        "statuses": statuses,
        "makespan_s": makespan,
        "latency_s": percentiles(lat, (50, 99, 100)),
        "server": {k: after[k] - before.get(k, 0) for k in ("served", "rejected", "timed_out")},
        "server_peak_running": after.get("peak_running"),
        "proxy_cpu_us_per_call": pcpu / calls * 1e6,
        "caller_cpu_us_per_call": sum(o["cpu"] for o in out) / calls * 1e6,
        "machine_busy": busy,
        "latencies_sorted": lat,
    }
    log(
        f"{NAME}: burst {requests} x {CALLS}: {res['failed_calls']} failed calls, makespan "
        f"{makespan:.2f} s, peak running {res['server_peak_running']}, statuses {statuses}"
    )
    return res


# -- the run ----------------------------------------------------------------------------------


def run(opts: Options) -> list[Headline]:
    n_light = opts.pick(1000, 200)
    seconds = opts.pick(10.0, 3.0)
    requests = opts.pick(1000, 200)
    oracle = requests * CALLS * SERVICE_MS / 1000 / CAP
    logdir = tempfile.mkdtemp(prefix="fleetgate-bench-proxy-")
    with private_redis() as rp:
        fast = ["--concurrency", "100000", "--queue-size", "100000", "--request-timeout-ms", "0"]
        fast += ["--base-ms", "0", "--per-passage-ms", "0"]
        with sim_process("rerank", *fast) as sim0:
            configure_gate(rp.url, GATE, floor=100_000, ceiling=100_000, max_queued=100_000,
                           lease_ms=10_000, waiter_ms=5_000)  # fmt: skip
            with proxy_process(rp.url, sim0.url, logdir) as p:
                log(f"{NAME}: light load, {n_light} requests each way")
                light = light_load(sim0.url, p.url, n_light)
                log(f"{NAME}: throughput, {seconds:g} s each way")
                rps = throughput(sim0.url, p, seconds)
            log(f"{NAME}: cpu floor of the burst (server base-ms 0, never rejects)")
            floor = burst(rp.url, sim0, requests, logdir)
        with sim_process(
            "rerank",
            "--concurrency", str(CAP),
            "--queue-size", "64",
            "--request-timeout-ms", "5000",
            "--base-ms", f"{SERVICE_MS:g}",
            "--per-passage-ms", "0",
        ) as sim:  # fmt: skip
            log(f"{NAME}: burst through 2 proxies, {requests} x {CALLS} calls")
            main = burst(rp.url, sim, requests, logdir)
        with sim_process("vllm", *SIM_ARGS) as vllm, proxy_process(rp.url, vllm.url, logdir) as p:
            log(f"{NAME}: streaming, {opts.pick(200, 50)} calls each way")
            stream = streaming(vllm.url, p.url, opts.pick(200, 50))
        bound = max(oracle, floor["makespan_s"])
        d, px, add, ratio = light["direct"], light["proxy"], light["added_ms"], light["ratio"]

        def pair(x: dict[str, float], sep: str = " / ") -> str:
            return f"{x['p50']:.2f}{sep}{x['p99']:.2f}"

        rows = [
            ("light load: direct p50 / p99 ms", pair(d)),
            ("light load: proxy p50 / p99 ms", pair(px)),
            ("added p50 / p99 ms", pair(add)),
            ("proxy / direct p50, p99", pair(ratio, ", ")),
            ("req/s direct (16 callers)", f"{rps['direct']['rps']:,.0f}"),
            ("req/s through 1 proxy process", f"{rps['proxy']['rps']:,.0f}"),
            ("proxy / direct req/s", f"{rps['ratio']:.2f}"),
            ("proxy CPU µs per request", f"{rps['proxy']['proxy_cpu_us_per_request']:.0f}"),
            ("burst: failed calls / reqs", f"{main['failed_calls']} / {main['failed_requests']}"),
            ("burst: server peak running (cap 32)", str(main["server_peak_running"])),
            ("burst: makespan s (oracle)", f"{main['makespan_s']:.2f} ({oracle:.2f})"),
            ("burst: makespan / oracle", f"{main['makespan_s'] / oracle:.2f}"),
            ("burst: cpu floor makespan s", f"{floor['makespan_s']:.2f}"),
            ("burst: makespan / max(oracle, cpu floor)", f"{main['makespan_s'] / bound:.2f}"),
            ("burst: proxy CPU µs per call", f"{main['proxy_cpu_us_per_call']:.0f}"),
            ("stream: time to first token p50 direct / proxy ms",
             f"{stream['direct']['ttft']['p50']:.2f} / {stream['proxy']['ttft']['p50']:.2f}"),
            ("stream: added time to first token p50 / p99 ms", pair(stream["added_ttft_ms"])),
            ("stream: chunks' spread p50 direct / proxy ms",
             f"{stream['direct']['spread']['p50']:.1f} / {stream['proxy']['spread']['p50']:.1f}"),
        ]  # fmt: skip
        text = table(("figure", "value"), rows)
        fig, ax = figure(2)
        for label, vs in light.pop("samples").items():
            arr = np.array(vs) * 1000
            ax[0][0].plot(arr, np.linspace(0, 1, len(arr)), label=label)
        ax[0][0].set_xlabel("latency at light load (ms)")
        ax[0][0].set_ylabel("CDF")
        ax[0][0].legend()
        for label, r in (("burst (cap 32, 20 ms)", main), ("cpu floor (0 ms)", floor)):
            arr = np.array(r.pop("latencies_sorted"))
            ax[0][1].plot(
                arr, np.linspace(0, 1, len(arr)), label=f"{label}, {r['failed_calls']} failed"
            )
        ax[0][1].axvline(oracle, color="grey", ls="--", label=f"oracle {oracle:.2f} s")
        ax[0][1].set_xlabel("request latency from the burst start (s)")
        ax[0][1].legend(fontsize=8)
        fig.suptitle(f"fleetgate proxy ({opts.flavor.label}{', quick' if opts.quick else ''})")
        data = {
            "light_load": light,
            "throughput": rps,
            "burst": main,
            "burst_cpu_floor": floor,
            "streaming": stream,
            "oracle_s": oracle,
            "burst_makespan_vs_oracle": main["makespan_s"] / oracle,
            "burst_makespan_vs_max_oracle_cpu_floor": main["makespan_s"] / bound,
            "cpus": os.cpu_count(),
        }
        save(NAME, opts, rp.url, data, text, fig)
    return [
        Headline(NAME, "added latency p50 / p99 (light load)",
                 f"{light['added_ms']['p50']:.2f} / {light['added_ms']['p99']:.2f} ms", "-", None),
        Headline(NAME, "req/s per proxy process / direct", f"{rps['ratio']:.2f}", "-", None),
        Headline(NAME, "burst through 2 proxies: failed calls", str(main["failed_calls"]), "0",
                 main["failed_calls"] == 0),
        Headline(NAME, "burst makespan / oracle", f"{main['makespan_s'] / oracle:.2f}",
                 f"<= {MAKESPAN_TARGET}", main["makespan_s"] / oracle <= MAKESPAN_TARGET),
        Headline(NAME, "burst makespan / max(oracle, cpu floor)",
                 f"{main['makespan_s'] / bound:.2f}", "-", None),
        Headline(NAME, "streaming: added time to first token p50 / p99",
                 f"{pair(stream['added_ttft_ms'])} ms", "-", None),
    ]  # fmt: skip


if __name__ == "__main__":
    from ._common import main as _main

    sys.exit(_main(only=[NAME]))
