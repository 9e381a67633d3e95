"""A small load generator: requests to a model server (or a simulator) through a fleet gate.

    python -m fleetgate.worker --redis redis://redis:6379/0 --gate bge-m3 \\
        --target-url http://vllm-embed:8000/v1 --kind vllm --rate 20 --concurrency 16

--concurrency loops share one schedule of --rate starts per second, so at most C requests are in
flight and at most R start per second (per gate). A 'vllm' request is one POST /v1/completions
inside gate.permit(); a 'rerank' request is --passages passages cut into --batch-size batches,
sent as POST /v1/ranking calls through gate.map(). The client metrics (fleetgate_client_*) and
fleetgate_worker_requests_total{gate,outcome} are served on --metrics-listen. Give --gate,
--target-url and --kind once per gate to drive several (one --kind applies to all). Stops on
SIGTERM/SIGINT or after --duration; what is in flight is cancelled and its permits released.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import logging
import os
import signal
from collections.abc import Sequence
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter, start_http_server

from fleetgate.client import DeadlineExceeded, Fleet, FleetgateError, Gate, Overloaded

__all__ = ["build_parser", "main", "run"]

log = logging.getLogger("fleetgate.worker")


def _listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {value!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def build_parser() -> argparse.ArgumentParser:
    """The ``fleetgate worker`` argument parser."""
    doc = (__doc__ or "").split("\n\n")
    p = argparse.ArgumentParser(
        prog="fleetgate worker",
        description=f"{doc[0]}\n\n{doc[2]}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--gate", action="append", required=True, metavar="NAME", help="gate name")
    p.add_argument(
        "--target-url",
        action="append",
        required=True,
        metavar="URL",
        help="the server's base URL, e.g. http://vllm-embed:8000/v1 (/v1 is added when missing)",
    )
    p.add_argument(
        "--kind", action="append", choices=["vllm", "rerank"], help="server kind (default: vllm)"
    )
    env = os.environ.get
    redis_url, prefix = (
        env("FLEETGATE_REDIS_URL") or "redis://127.0.0.1:6379/0",
        env("FLEETGATE_PREFIX") or "fg",
    )
    for flag, kind, default, meta, text in (
        ("--redis", str, redis_url, "URL", "Redis URL; env FLEETGATE_REDIS_URL"),
        ("--prefix", str, prefix, "P", "key prefix; env FLEETGATE_PREFIX"),
        ("--floor", int, 1, "N", "gate floor registered if Redis has no config for it yet"),
        ("--rate", float, 10.0, "R", "requests started per second per gate, 0 = no pacing"),
        ("--concurrency", int, 8, "C", "request loops = most requests in flight per gate"),
        ("--duration", float, 0.0, "S", "stop after S seconds, 0 = at SIGTERM/SIGINT"),
        ("--deadline", float, 30.0, "S", "total deadline of one request, queue wait included"),
        ("--passages", int, 64, "N", "rerank: passages per request"),
        ("--batch-size", int, 16, "N", "rerank: passages per call"),
        ("--metrics-listen", _listen, "0.0.0.0:9100", "HOST:PORT", "where to serve /metrics"),
        ("--log-interval", float, 5.0, "S", "seconds between progress lines"),
    ):
        p.add_argument(
            flag, type=kind, default=default, metavar=meta, help=f"{text} (default: {default})"
        )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logs")
    return p


async def _request(
    gate: Gate, http: httpx.AsyncClient, url: str, kind: str, n: int, ns: argparse.Namespace
) -> None:
    if kind == "vllm":
        async with gate.permit(deadline=ns.deadline):
            body = {"prompt": f"request {n}", "max_tokens": 16}
            (await http.post(f"{url}/completions", json=body)).raise_for_status()
        return

    # -> Any, not int: gate.map's Fn = Callable[[T], Awaitable[R] | R] makes mypy infer Never
    async def rank(batch: list[str]) -> Any:
        body = {"query": {"text": f"query {n}"}, "passages": [{"text": t} for t in batch]}
        response = await http.post(f"{url}/ranking", json=body)
        response.raise_for_status()
        return len(response.json()["rankings"])

    texts = [f"passage {n}-{i}" for i in range(ns.passages)]
    batches = [texts[i : i + ns.batch_size] for i in range(0, len(texts), ns.batch_size)]
    await gate.map(rank, batches, max_in_flight=4, deadline=ns.deadline)


def _outcome(exc: BaseException) -> str:
    if isinstance(exc, httpx.HTTPStatusError):
        return f"http_{exc.response.status_code}"
    kinds = {Overloaded: "overloaded", DeadlineExceeded: "deadline", FleetgateError: "fleetgate"}
    return next((v for k, v in kinds.items() if isinstance(exc, k)), "error")


async def _drive(
    gate: Gate,
    http: httpx.AsyncClient,
    target: tuple[str, str, str],
    ns: argparse.Namespace,
    tally: collections.Counter[str],
    requests: Counter,
) -> None:
    loop = asyncio.get_running_loop()
    interval = 1.0 / ns.rate if ns.rate > 0 else 0.0
    next_at, seq = loop.time(), itertools.count(1)

    async def one_loop() -> None:
        nonlocal next_at
        while True:
            if interval:  # claim the next start slot of the shared schedule
                now = loop.time()
                at = next_at = max(next_at, now)
                next_at += interval
                await asyncio.sleep(at - now)
            try:
                await _request(gate, http, target[1], target[2], next(seq), ns)
                outcome = "ok"
            except (FleetgateError, httpx.HTTPError, KeyError, ValueError) as exc:
                outcome = _outcome(exc)
                log.debug("%s: %s: %r", gate.name, outcome, exc)
                if not interval:
                    await asyncio.sleep(0.1)  # no busy loop against a server that is down
            tally[outcome] += 1
            requests.labels(gate.name, outcome).inc()

    await asyncio.gather(*(one_loop() for _ in range(ns.concurrency)))


async def _progress(tallies: dict[str, collections.Counter[str]], every: float) -> None:
    last = dict.fromkeys(tallies, 0)
    while True:
        await asyncio.sleep(every)
        for name, tally in tallies.items():
            total = sum(tally.values())
            rest = "".join(f", {k} {v}" for k, v in sorted(tally.items()) if k != "ok")
            rate = (total - last[name]) / every
            log.info("%s: %d requests, %d ok%s (%.1f/s)", name, total, tally["ok"], rest, rate)
            last[name] = total


async def run(ns: argparse.Namespace) -> dict[str, collections.Counter[str]]:
    """Run until SIGTERM/SIGINT or ``ns.duration``; return the request outcomes per gate."""
    loop = asyncio.get_running_loop()
    registry = CollectorRegistry()
    requests = Counter(
        "fleetgate_worker_requests",
        "Worker requests by outcome",
        ("gate", "outcome"),
        registry=registry,
    )
    host, port = ns.metrics_listen
    server, thread = start_http_server(port, addr=host, registry=registry)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if ns.duration > 0:
        loop.call_later(ns.duration, stop.set)
    tallies: dict[str, collections.Counter[str]] = {t[0]: collections.Counter() for t in ns.targets}
    try:
        async with (
            Fleet(ns.redis, prefix=ns.prefix, registry=registry) as fleet,
            httpx.AsyncClient(timeout=ns.deadline) as http,
        ):
            shown = ", ".join(f"{g} ({k} at {u})" for g, u, k in ns.targets)
            log.info(
                "worker %s: %s; metrics on %s:%d", fleet.pod_id, shown, host, server.server_port
            )
            tasks = [asyncio.create_task(_progress(tallies, ns.log_interval))]
            for t in ns.targets:
                drive = _drive(
                    fleet.gate(t[0], floor=ns.floor), http, t, ns, tallies[t[0]], requests
                )
                tasks.append(asyncio.create_task(drive))
            stopper = asyncio.create_task(stop.wait())
            await asyncio.wait([stopper, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for task in [stopper, *tasks]:
                task.cancel()
            for r in await asyncio.gather(*tasks, return_exceptions=True):
                if isinstance(r, Exception):  # a load loop died of a bug: report it
                    raise r
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        server.shutdown()
        server.server_close()
        thread.join(5)
    for name, tally in tallies.items():
        log.info("%s: stopped after %s", name, dict(tally) or "no requests")
    return tallies


def main(argv: Sequence[str] | None = None) -> int:
    """``fleetgate worker``: parse ``argv`` (None = ``sys.argv[1:]``), run, return 0."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    kinds = ns.kind or ["vllm"]
    kinds = kinds * len(ns.gate) if len(kinds) == 1 else kinds
    if not len(ns.gate) == len(ns.target_url) == len(kinds):
        parser.error("give --target-url (and --kind, unless one applies to all) once per --gate")
    if len(set(ns.gate)) != len(ns.gate):
        parser.error("a --gate is given twice")
    if min(ns.concurrency, ns.passages, ns.batch_size) < 1 or ns.rate < 0:
        parser.error("--concurrency, --passages and --batch-size must be >= 1, --rate >= 0")
    urls = [u.rstrip("/").removesuffix("/v1") + "/v1" for u in ns.target_url]
    ns.targets = list(zip(ns.gate, urls, kinds, strict=True))
    logging.basicConfig(
        level=logging.DEBUG if ns.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.DEBUG if ns.verbose else logging.WARNING)
    try:
        asyncio.run(run(ns))
    except OSError as exc:  # e.g. the metrics port is taken
        log.error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
