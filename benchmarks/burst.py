"""burst: the rerank burst of the pull request, fleet-wide, against a separate reranker process.

4 spawned worker processes share R requests (full 1000, quick 200), each a findAndRerank-like
request of 10 rerank calls, all fired at one instant at the reranker simulator run as its own OS
process (``python -m fleetgate.tools.sim.rerank --concurrency 32 --queue-size 64
--request-timeout-ms 5000 --base-ms 20 --per-passage-ms 0``). Three modes, no retries anywhere:

* ``none``: no gate at all (each worker's httpx pool of 64 connections is the only bound);
* ``local``: a per-process ``asyncio.Semaphore(32)`` (the pull request's per-pod gate);
* ``fleet``: the fleet gate, limit 32, ``gate.map(..., max_in_flight=8, retry=False)``.

Per mode: failed calls (non-200), failed requests (any failed call), p50/p99 request latency
(from the common start, since every request starts then), makespan, and makespan / oracle, with
oracle = calls x 20 ms / 32 (total work over capacity).

The box has 2 cores shared by 4 workers, the simulator and redis-server, so the client cost is
measured too: the same calls against a second simulator with ``--base-ms 0`` and no practical
concurrency limit (``cpu floor`` rows), once with local semaphores (plain HTTP cost: httpx stays
cheap with few requests pending per pool) and once with the fleet gate. That makespan is what the
CPU alone allows; the fleet gate's makespan is compared with max(oracle, its floor), and the
difference of the two floors' client µs/call is the gate's own client-side cost.
Targets: fleet gate 0 failed calls, makespan <= 1.05 x oracle.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from ._common import Flavor, Headline, Options, figure, log, percentiles, save, table
from ._server import (
    busy_fraction,
    configure_gate,
    machine_jiffies,
    private_redis,
    sync_client,
)
from ._workers import Sync, Workers, cpu_seconds, worker_fleet

NAME = "burst"
GATE = "bench-burst"
PROCS, CALLS, CAP, SERVICE_MS = 4, 10, 32, 20.0
MAKESPAN_TARGET = 1.05
MODES = ("none", "local", "fleet")


# -- the simulator as a separate process ------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class SimProcess:
    proc: subprocess.Popen[bytes]
    url: str

    def stats(self) -> dict[str, Any]:
        return dict(httpx.get(f"{self.url}/admin/stats", timeout=10).json())

    def reset_peaks(self) -> None:
        httpx.post(f"{self.url}/admin/reset-peaks", timeout=10).raise_for_status()

    def set_capacity(self, n: int) -> dict[str, Any]:
        r = httpx.post(f"{self.url}/admin/capacity", json={"capacity": n}, timeout=10)
        r.raise_for_status()
        return dict(r.json())

    def cpu(self) -> float:
        """CPU seconds (user + system) the simulator process has used."""
        try:
            with open(f"/proc/{self.proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            return float("nan")


@contextlib.contextmanager
def sim_process(module: str, *args: str) -> Iterator[SimProcess]:
    """``python -m fleetgate.tools.sim.<module> --port P <args>`` until the block ends."""
    port = free_port()
    cmd = [sys.executable, "-m", f"fleetgate.tools.sim.{module}", "--port", str(port)]
    cmd += ["--log-level", "warning", *args]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 20
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > end:
                raise RuntimeError(f"{' '.join(cmd)} did not answer /health in 20 s")
            time.sleep(0.1)
        log(f"sim {module} pid {proc.pid} on {url}: {' '.join(args)}")
        yield SimProcess(proc, url)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


# -- HTTP client ----------------------------------------------------------------------------


class ShardedHTTP:
    """``shards`` httpx clients used round-robin, ``per_shard`` connections each.

    httpx (httpcore's pool) spends time proportional to the requests pending on one pool for
    every request it assigns: one client with 200 requests in flight costs ~5 ms of CPU per
    request on this box, 10 in flight ~1.1 ms. Spreading the calls over small pools keeps the
    client's cost per call flat, so the benchmarks measure the gate and the server, not httpx."""

    def __init__(self, base_url: str, shards: int, per_shard: int) -> None:
        limits = httpx.Limits(max_connections=per_shard, max_keepalive_connections=per_shard)
        self.clients = [
            httpx.AsyncClient(base_url=base_url, limits=limits, timeout=120) for _ in range(shards)
        ]
        self.per_shard = per_shard
        self._next = 0

    def pick(self) -> httpx.AsyncClient:
        self._next = (self._next + 1) % len(self.clients)
        return self.clients[self._next]

    async def post(self, path: str, **kw: Any) -> httpx.Response:
        return await self.pick().post(path, **kw)

    async def warm(self) -> None:
        """Open every connection before the measured window."""
        await asyncio.gather(
            *(c.get("/health") for c in self.clients for _ in range(self.per_shard))
        )

    async def __aenter__(self) -> ShardedHTTP:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.gather(*(c.aclose() for c in self.clients))


# -- the worker ------------------------------------------------------------------------------


@dataclass
class _Plain:
    start: int


@contextlib.asynccontextmanager
async def _plain_start(sync: Sync) -> AsyncIterator[_Plain]:
    yield _Plain(await sync.aready())


def burst_worker(
    sync: Sync,
    url: str,
    sim_url: str,
    requests: int,
    calls: int,
    mode: str,
    flavor: Flavor,
) -> dict[str, Any]:
    """``requests`` concurrent requests of ``calls`` rerank calls each, all at the common start.

    Returns failed calls/requests, each request's latency (s, from the start), the end instant
    (monotonic ns) and this process' CPU seconds from the start to its end."""

    async def main() -> dict[str, Any]:
        failed_calls = failed_requests = 0
        latencies: list[float] = []
        # 64 connections per process as in tests/_workers.burst, in 8 pools of 8 (ShardedHTTP).
        async with ShardedHTTP(sim_url, 8, 2 * CAP // 8) as http:
            await http.warm()

            async def rerank(batch: list[str]) -> int:
                nonlocal failed_calls
                body = {"query": {"text": "q"}, "passages": [{"text": p} for p in batch]}
                resp = await http.post("/v1/ranking", json=body)
                if resp.status_code != 200:
                    failed_calls += 1
                    resp.raise_for_status()
                return len(resp.json()["rankings"])

            passages = [[f"passage {i}-{j}" for j in range(10)] for i in range(calls)]
            ctx: Any
            if mode == "fleet":
                ctx = worker_fleet(sync, url, flavor, connections=64, overdue_s=150)
            else:
                ctx = _plain_start(sync)
            async with ctx as run:
                gate = run.fleet.gate(GATE) if mode == "fleet" else None
                local = asyncio.Semaphore(CAP)
                start = run.start

                async def guarded(batch: list[str]) -> int:
                    async with local:
                        return await rerank(batch)

                async def request() -> None:
                    nonlocal failed_requests
                    try:
                        if gate is not None:
                            await gate.map(
                                rerank, passages, max_in_flight=8, deadline=120, retry=False
                            )
                        elif mode == "local":
                            await asyncio.gather(*(guarded(b) for b in passages))
                        else:
                            await asyncio.gather(*(rerank(b) for b in passages))
                    except Exception:
                        failed_requests += 1
                    latencies.append((time.monotonic_ns() - start) / 1e9)

                await asyncio.sleep(max(0.0, (start - time.monotonic_ns()) / 1e9))
                cpu0 = cpu_seconds()
                await asyncio.gather(*(request() for _ in range(requests)))
                end = time.monotonic_ns()
                result = {
                    "failed_calls": failed_calls,
                    "failed_requests": failed_requests,
                    "latencies": latencies,
                    "end": end,
                    "cpu": cpu_seconds() - cpu0,
                    "events": getattr(run, "events", {}),
                }
                sync.publish(result)
                return result

    return flavor.run(main())


# -- one run ---------------------------------------------------------------------------------


def run_mode(url: str, sim: SimProcess, mode: str, requests: int, flavor: Flavor) -> dict[str, Any]:
    per = requests // PROCS
    calls = per * PROCS * CALLS
    configure_gate(
        url, GATE, floor=CAP, ceiling=CAP, max_queued=4 * calls, lease_ms=10_000, waiter_ms=5_000
    )
    sim.reset_peaks()
    before = sim.stats()
    r = sync_client(url)
    rcpu0 = float(r.info("cpu")["used_cpu_user"]) + float(r.info("cpu")["used_cpu_sys"])
    args = [(url, sim.url, per, CALLS, mode, flavor)] * PROCS
    with Workers(burst_worker, args) as w:
        start = w.go()
        scpu0, busy0 = sim.cpu(), machine_jiffies()
        out = w.results(timeout=180)
    scpu1, busy1 = sim.cpu(), machine_jiffies()
    rcpu1 = float(r.info("cpu")["used_cpu_user"]) + float(r.info("cpu")["used_cpu_sys"])
    r.close()
    after = sim.stats()
    makespan = (max(o["end"] for o in out) - start) / 1e9
    lat = [x for o in out for x in o["latencies"]]
    busy = busy_fraction(busy0, busy1)
    client_cpu = sum(o["cpu"] for o in out)
    res = {
        "mode": mode,
        "requests": per * PROCS,
        "calls": calls,
        "failed_calls": sum(o["failed_calls"] for o in out),
        "failed_requests": sum(o["failed_requests"] for o in out),
        "latency_s": percentiles(lat, (50, 99, 100)),
        "makespan_s": makespan,
        "server": {
            k: after[k] - before.get(k, 0)
            for k in ("served", "rejected", "timed_out", "aborted")
            if k in after
        },
        "server_peak_running": after.get("peak_running"),
        "server_peak_in_flight": after.get("peak_in_flight"),
        "client_cpu_s": client_cpu,
        "client_cpu_us_per_call": client_cpu / calls * 1e6,
        "sim_cpu_s": scpu1 - scpu0,
        "sim_cpu_us_per_call": (scpu1 - scpu0) / calls * 1e6,
        "redis_cpu_s": rcpu1 - rcpu0,
        "machine_cpu_busy": busy,
        "client_warnings": {k: sum(o["events"].get(k, 0) for o in out) for k in out[0]["events"]},
        "workers_stuck_in_close": len(w.stuck),
        "latencies_sorted": sorted(lat),
    }
    log(
        f"{NAME}: {mode}: {res['failed_calls']} failed calls, {res['failed_requests']} failed "
        f"requests, makespan {makespan:.2f} s, p99 {res['latency_s']['p99']:.2f} s, "
        f"machine busy {busy if busy is None else round(busy, 2)}"
    )
    return res


def run(opts: Options) -> list[Headline]:
    requests = opts.pick(1000, 200)
    calls = requests * CALLS
    oracle = calls * SERVICE_MS / 1000 / CAP
    runs: dict[str, dict[str, Any]] = {}
    floors: dict[str, dict[str, Any]] = {}
    with private_redis() as rp:
        with sim_process(
            "rerank",
            "--concurrency", str(CAP),
            "--queue-size", "64",
            "--request-timeout-ms", "5000",
            "--base-ms", f"{SERVICE_MS:g}",
            "--per-passage-ms", "0",
        ) as sim:  # fmt: skip
            for mode in MODES:
                log(f"{NAME}: mode {mode}: {PROCS} x {requests // PROCS} requests x {CALLS} calls")
                runs[mode] = run_mode(rp.url, sim, mode, requests, opts.flavor)
        # The client's own cost: same calls, a server that answers at once and never rejects.
        with sim_process(
            "rerank",
            "--concurrency", "100000",
            "--queue-size", "100000",
            "--request-timeout-ms", "0",
            "--base-ms", "0",
            "--per-passage-ms", "0",
        ) as sim0:  # fmt: skip
            for mode in ("local", "fleet"):
                log(f"{NAME}: cpu floor, mode {mode} (server base-ms 0)")
                floors[mode] = run_mode(rp.url, sim0, mode, requests, opts.flavor)
        floor = floors["fleet"]["makespan_s"]
        bound = max(oracle, floor)
        rows = []
        for label, r in [
            *((m, runs[m]) for m in MODES),
            *((f"cpu floor: {m}", floors[m]) for m in floors),
        ]:
            rows.append(
                (
                    label,
                    r["failed_calls"],
                    r["failed_requests"],
                    r["latency_s"]["p50"],
                    r["latency_s"]["p99"],
                    r["makespan_s"],
                    r["makespan_s"] / oracle,
                    r["server_peak_running"],
                    r["server"].get("rejected", 0),
                    r["server"].get("timed_out", 0),
                    r["client_cpu_us_per_call"],
                    r["sim_cpu_us_per_call"],
                    "-" if r["machine_cpu_busy"] is None else r["machine_cpu_busy"],
                )
            )
        text = table(
            (
                "mode",
                "failed calls",
                "failed reqs",
                "p50 s",
                "p99 s",
                "makespan s",
                "/ oracle",
                "peak run",
                "503",
                "504",
                "client µs/call",
                "sim µs/call",
                "CPU busy",
            ),
            rows,
        )
        fleet = runs["fleet"]
        text += (
            f"\n\ncalls {calls}, oracle {oracle:.2f} s (calls x {SERVICE_MS:g} ms / {CAP}); "
            f"cpu floor with the fleet gate {floor:.2f} s, with local semaphores "
            f"{floors['local']['makespan_s']:.2f}"
            f" s\nfleet makespan / max(oracle, cpu floor) = {fleet['makespan_s'] / bound:.3f}"
        )
        fig, ax = figure(1)
        for label, r in [*runs.items(), ("cpu floor (fleet)", floors["fleet"])]:
            lat = np.array(r.pop("latencies_sorted"))
            ax[0][0].plot(
                lat, np.linspace(0, 1, len(lat)), label=f"{label} ({r['failed_requests']} failed)"
            )
        for r in floors.values():
            r.pop("latencies_sorted", None)
        ax[0][0].axvline(oracle, color="grey", ls="--", label=f"oracle makespan {oracle:.2f} s")
        ax[0][0].set_xlabel("request latency from the burst start (s)")
        ax[0][0].set_ylabel("CDF of requests")
        ax[0][0].legend(loc="lower right", fontsize=8)
        fig.suptitle(
            f"burst: {requests} requests x {CALLS} calls, {PROCS} processes, reranker cap {CAP}, "
            f"{SERVICE_MS:g} ms ({opts.flavor.label})"
        )
        data = {
            "requests": requests,
            "calls": calls,
            "oracle_s": oracle,
            "modes": runs,
            "cpu_floor": floors,
            "fleet_makespan_vs_oracle": fleet["makespan_s"] / oracle,
            "fleet_makespan_vs_max_oracle_cpu_floor": fleet["makespan_s"] / bound,
        }
        save(NAME, opts, rp.url, data, text, fig)
    ratio = fleet["makespan_s"] / oracle
    return [
        Headline(
            NAME,
            "fleet gate failed calls / requests",
            f"{fleet['failed_calls']} / {fleet['failed_requests']}",
            "0 / 0",
            fleet["failed_calls"] == 0 and fleet["failed_requests"] == 0,
        ),
        Headline(
            NAME,
            "fleet makespan / oracle",
            f"{ratio:.3f}",
            f"<= {MAKESPAN_TARGET}",
            ratio <= MAKESPAN_TARGET,
        ),
        Headline(
            NAME,
            "fleet makespan / max(oracle, cpu floor)",
            f"{fleet['makespan_s'] / bound:.3f}",
            "-",
            None,
        ),
        Headline(
            NAME,
            "local Semaphore(32) failed requests",
            str(runs["local"]["failed_requests"]),
            "-",
            None,
        ),
    ]


if __name__ == "__main__":
    from ._common import main

    sys.exit(main(only=[NAME]))
