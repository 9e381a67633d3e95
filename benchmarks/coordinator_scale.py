"""Coordinator scale: how many models one coordinator scrapes, decides and publishes per poll.

One leader, N adaptive gates, each with its own ``/metrics`` endpoint on a stub server (a
separate process, so the coordinator has its core to itself). Each poll is timed end to end
(``Coordinator.poll_once``: scrape all N concurrently, read fleet in-flight, step N controllers,
publish in one pipeline) and split into its scrape and publish parts, with the coordinator
process's CPU time per poll (steadier than wall time on a shared machine). Target: 1,000 models
in ≤ 1 s per poll.

``FLEETGATE_BENCH_HTTP=httpx`` scrapes through httpx instead of the coordinator's lean GET, for
the comparison in ``docs/servers.md``.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import time
from typing import Any, Literal

from prometheus_client import CollectorRegistry

from fleetgate.coordinator.config import Config
from fleetgate.coordinator.daemon import Coordinator
from fleetgate.tools.redisproc import free_port

from ._common import Headline, Options, figure, log, percentiles, save, table
from ._server import PREFIX, private_redis

NAME = "coordinator_scale"
POLLS = 5
HTTP: Literal["lean", "httpx"] = (
    "httpx" if os.environ.get("FLEETGATE_BENCH_HTTP") == "httpx" else "lean"
)


def _exposition(i: int) -> str:
    labels = f'engine="0",model_name="m{i}"'
    return (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        f"vllm:num_requests_running{{{labels}}} {i % 17}.0\n"
        "# HELP vllm:num_requests_waiting_by_reason Number of requests waiting, by reason.\n"
        "# TYPE vllm:num_requests_waiting_by_reason gauge\n"
        f'vllm:num_requests_waiting_by_reason{{{labels},reason="capacity"}} {i % 3}.0\n'
        f'vllm:num_requests_waiting_by_reason{{{labels},reason="deferred"}} 0.0\n'
    )


def _serve_stub(port: int) -> None:
    """A deliberately minimal HTTP/1.1 server (keep-alive, pre-rendered bodies), so the stub
    costs little of the shared CPU and the figure measures the coordinator, not the stub."""
    import asyncio as aio
    import re

    bodies: dict[int, bytes] = {}
    path = re.compile(rb"GET /m/(\d+)/metrics ")

    def response(i: int) -> bytes:
        body = bodies.get(i)
        if body is None:
            body = bodies[i] = _exposition(i).encode()
        head = f"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n\r\n"
        return head.encode() + body

    async def handle(reader: aio.StreamReader, writer: aio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                m = path.match(head)
                if m is None:
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                else:
                    writer.write(response(int(m.group(1))))
                await writer.drain()
        except (aio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main() -> None:
        server = await aio.start_server(handle, "127.0.0.1", port, backlog=4096)
        async with server:
            await server.serve_forever()

    aio.run(main())


def _config(url: str, stub: str, n: int) -> Config:
    gates = "".join(
        f'[[gates]]\nname = "model-{i}"\nfloor = 4\nmetrics_url = "{stub}/m/{i}/metrics"\n'
        for i in range(n)
    )
    return Config.from_toml_text(
        f'[redis]\nurl = "{url}"\nprefix = "{PREFIX}"\n'
        "[coordinator]\npoll_interval = 600.0\nleader_ttl = 30.0\n"
        'metrics_listen = "127.0.0.1:0"\nscrape_timeout = 10.0\n' + gates,
        env={},
    )


async def _measure(url: str, stub: str, n: int) -> dict[str, Any]:
    coord = Coordinator(_config(url, stub, n), registry=CollectorRegistry(), http=HTTP)
    stop = asyncio.Event()
    task = asyncio.create_task(coord.run(stop))
    try:
        while coord._election is None or not coord.election.is_leader:
            await asyncio.sleep(0.01)
        await coord.poll_once()  # warm: connections, scripts loaded
        term = coord.election.term
        assert term is not None, "the coordinator lost its leadership during warm-up"
        total, cpu, scrape, publish = [], [], [], []
        for _ in range(POLLS):
            t0, c0 = time.perf_counter(), time.process_time()
            await coord.poll_once()
            total.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            t1 = time.perf_counter()
            await asyncio.gather(*(coord._scrape(g) for g in coord.config.gates))
            scrape.append(time.perf_counter() - t1)
            pubs = [coord._decide(g, None, 0, time.time()) for g in coord.config.gates]
            t2 = time.perf_counter()
            await coord.publisher.publish(term.epoch, 36_000, pubs)
            publish.append(time.perf_counter() - t2)
        ok = sum(1 for g in coord.config.gates if coord.states.get(g.name) is not None)
    finally:
        stop.set()
        await task
    return {
        "models": n,
        "poll_s": percentiles(total, (50, 90)),
        "poll_cpu_s": percentiles(cpu, (50,)),
        "scrape_s": percentiles(scrape, (50,)),
        "publish_s": percentiles(publish, (50,)),
        "models_per_s": n / percentiles(total, (50,))["p50"],
        "decided": ok,
    }


def run(opts: Options) -> list[Headline]:
    sizes = opts.pick([10, 100, 500, 1000], [10, 100, 300])
    port = free_port()
    stub_proc = mp.get_context("spawn").Process(target=_serve_stub, args=(port,), daemon=True)
    stub_proc.start()
    stub = f"http://127.0.0.1:{port}"
    rows: list[dict[str, Any]] = []
    try:
        import httpx

        for _ in range(200):  # wait for the stub to answer
            try:
                if httpx.get(f"{stub}/health", timeout=0.5).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)
        with private_redis() as server:
            for n in sizes:
                log(f"{NAME}: {n} models")
                rows.append(asyncio.run(_measure(server.url, stub, n)))
            _report(opts, server.url, rows)
    finally:
        stub_proc.terminate()
        stub_proc.join(5)
    biggest = rows[-1]
    within = biggest["poll_s"]["p50"] <= 1.0
    return [
        Headline(
            NAME,
            f"poll of {biggest['models']} models (p50)",
            f"{biggest['poll_s']['p50']:.2f} s",
            "1,000 models in <= 1 s",
            within if biggest["models"] >= 1000 else None,
        )
    ]


def _report(opts: Options, url: str, rows: list[dict[str, Any]]) -> None:
    text = table(
        ("models", "poll p50 s", "poll p90 s", "cpu p50 s", "scrape p50 s", "publish p50 s",
         "models/s"),
        [
            (r["models"], r["poll_s"]["p50"], r["poll_s"]["p90"], r["poll_cpu_s"]["p50"],
             r["scrape_s"]["p50"], r["publish_s"]["p50"], r["models_per_s"])
            for r in rows
        ],
    )  # fmt: skip
    fig, ax = figure()
    a = ax[0][0]
    a.plot([r["models"] for r in rows], [r["poll_s"]["p50"] for r in rows], "o-", label="poll")
    a.plot([r["models"] for r in rows], [r["scrape_s"]["p50"] for r in rows], "s--", label="scrape")
    a.plot(
        [r["models"] for r in rows], [r["publish_s"]["p50"] for r in rows], "^--", label="publish"
    )
    a.axhline(1.0, color="grey", lw=0.8, ls=":", label="1 s target")
    a.set_xlabel("models per coordinator")
    a.set_ylabel("seconds per poll (p50)")
    a.legend()
    save(NAME, opts, url, {"polls_per_size": POLLS, "http": HTTP, "sizes": rows}, text, fig)


if __name__ == "__main__":
    import sys

    from ._common import main

    sys.exit(main(only=[NAME]))
