"""The load generator: request loops against model servers (or simulators), each through a gate.

    fleetgate worker --redis redis://redis:6379/0 --gate bge-m3 \\
        --target-url http://vllm-embed:8000/v1 --kind vllm --rate 20 --concurrency 16

One job: run *users* (request loops) per gate, every call inside a fleet-wide permit, and count
what came back. A :class:`LoadSpec` says what to drive; it comes from the command line
(``fleetgate worker``, ``python -m fleetgate.tools.load``: docker-compose, the Prometheus test)
or, for the demo's worker pods, as JSON in ``$FLEETGATE_LOAD_SPEC`` with ``--spec-from-env``
(the environment, not argv, so ``ps`` shows no Redis URL). A request of kind

* ``completions`` (``--kind vllm``): one ``POST /v1/completions`` inside ``gate.permit()``;
* ``chat``: one ``POST /v1/chat/completions`` inside ``gate.permit()``;
* ``embed``: ``gate.map()`` over ``calls`` ``POST /v1/embeddings`` calls, ``fan`` at a time;
* ``rerank``: ``gate.map()`` over ``calls`` ``POST /v1/ranking`` batches of ``passages``.

A gate's users share one schedule of ``rate`` starts per second (0: back to back, with a pause of
0.2 s after a failure so a server that is down is not spun on). Outcomes (``ok``, ``overloaded``,
``deadline``, ``http_<code>``, ``transport``, else the exception's name) are counted in
``fleetgate_worker_requests_total{gate,outcome}`` next to the client metrics (served on
``--metrics-listen``), logged every ``--log-interval`` and, for the demo, written to a JSON stats
file every second. Stops on SIGTERM/SIGINT, after ``duration`` or when ``parent_pid`` is gone;
what is in flight is cancelled and its permits released.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import logging
import math
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import httpx
import msgspec
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client import Counter as PromCounter

from fleetgate.client import DeadlineExceeded, Fleet, Gate, Overloaded

__all__ = [
    "SPEC_ENV",
    "GateLoad",
    "Kind",
    "LoadSpec",
    "WorkerStats",
    "build_parser",
    "main",
    "run",
]

log = logging.getLogger("fleetgate.tools.load")  # not __name__: __main__ under -m

SPEC_ENV = "FLEETGATE_LOAD_SPEC"
SHUTDOWN_TIMEOUT = 5.0
ERROR_PAUSE = 0.2  # seconds an unpaced user waits after a failed request

Kind = Literal["completions", "chat", "embed", "rerank"]
CLI_KINDS: dict[str, Kind] = {"vllm": "completions", "rerank": "rerank"}


class GateLoad(msgspec.Struct, frozen=True):
    """The load one process puts on one gate."""

    name: str
    kind: Kind
    url: str  # the server's base URL, without /v1 and trailing slash
    floor: int = 1  # registered if Redis has no config for the gate yet
    users: int = 1  # concurrent request loops
    rate: float = 0.0  # request starts per second shared by the users, 0 = back to back
    calls: int = 1  # calls per request (gate.map over them): embed, rerank
    fan: int = 1  # max_in_flight of that map
    passages: int = 64  # rerank: passages per call
    model: str = ""  # sent as "model" when set


class LoadSpec(msgspec.Struct, frozen=True):
    """Everything one load-generating process needs."""

    redis_url: str
    prefix: str
    gates: list[GateLoad]
    pod_id: str | None = None  # None: the client's host-pid-random id
    deadline: float = 30.0  # total deadline of one request, queue wait included
    retry: bool = False  # let gate.map retry transient call failures
    duration: float = 0.0  # stop after this many seconds, 0 = at SIGTERM/SIGINT
    metrics_listen: tuple[str, int] | None = None  # where to serve /metrics
    log_interval: float = 0.0  # seconds between progress lines, 0 = none
    stats_path: str | None = None  # WorkerStats as JSON, replaced every second and at exit
    parent_pid: int | None = None  # stop when the parent is no longer this pid


class WorkerStats(msgspec.Struct):
    """What a process reports: per gate, requests and calls that succeeded, errors by kind."""

    worker_id: str
    pid: int
    updated: float = 0.0
    requests: dict[str, int] = msgspec.field(default_factory=dict)
    calls: dict[str, int] = msgspec.field(default_factory=dict)
    errors: dict[str, dict[str, int]] = msgspec.field(default_factory=dict)
    stopped: bool = False


def outcome_of(exc: BaseException) -> str:
    """A short label for a failed request."""
    if isinstance(exc, Overloaded):
        return "overloaded"
    if isinstance(exc, DeadlineExceeded):
        return "deadline"
    if isinstance(exc, httpx.HTTPStatusError):
        return f"http_{exc.response.status_code}"
    if isinstance(exc, httpx.TransportError):
        return "transport"
    return type(exc).__name__


class Load:
    """The users of one process, their counters and the chores around them."""

    def __init__(self, spec: LoadSpec, registry: CollectorRegistry) -> None:
        """Prepare counters in ``registry``; nothing runs until :meth:`run`."""
        self.spec = spec
        self.registry = registry
        self.outcomes = PromCounter(
            "fleetgate_worker_requests",
            "Worker requests by outcome",
            ("gate", "outcome"),
            registry=registry,
        )
        self.calls: Counter[str] = Counter()
        self.requests: Counter[str] = Counter()
        self.errors: dict[str, Counter[str]] = {g.name: Counter() for g in spec.gates}
        self.worker_id = ""

    def tally(self, gate: str) -> dict[str, int]:
        """Outcome → count of one gate's requests so far."""
        return {"ok": self.requests[gate], **self.errors[gate]}

    def write_stats(self, stopped: bool = False) -> None:
        """Replace the stats file (if any) atomically with the current counters."""
        if self.spec.stats_path is None:
            return
        stats = WorkerStats(
            worker_id=self.worker_id,
            pid=os.getpid(),
            updated=time.time(),
            requests=dict(self.requests),
            calls=dict(self.calls),
            errors={name: dict(c) for name, c in self.errors.items()},
            stopped=stopped,
        )
        path = Path(self.spec.stats_path)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(msgspec.json.encode(stats))
        os.replace(tmp, path)

    async def _call(self, http: httpx.AsyncClient, load: GateLoad, i: int, k: int = 0) -> None:
        """Call ``k`` of request ``i`` to the server behind ``load`` (raises on non-2xx)."""
        text = f"{self.worker_id} request {i}.{k}"
        model = {"model": load.model} if load.model else {}
        body: dict[str, Any]
        if load.kind == "completions":
            path, body = "completions", {"prompt": text, "max_tokens": 16}
        elif load.kind == "chat":
            messages = [{"role": "user", "content": text}]
            path, body = "chat/completions", {"messages": messages, "max_tokens": 32}
        elif load.kind == "embed":
            path, body = "embeddings", {"input": [text]}
        else:
            passages = [{"text": f"passage {p} of {text}"} for p in range(load.passages)]
            path, body = "ranking", {"query": {"text": text}, "passages": passages}
        resp = await http.post(f"{load.url}/v1/{path}", json={**model, **body})
        resp.raise_for_status()
        self.calls[load.name] += 1

    async def _request(self, gate: Gate, http: httpx.AsyncClient, load: GateLoad, i: int) -> None:
        if load.kind in ("completions", "chat"):
            async with gate.permit(deadline=self.spec.deadline):
                await self._call(http, load, i)
            return
        await gate.map(
            functools.partial(self._call, http, load, i),  # an async callable
            range(load.calls),
            max_in_flight=load.fan,
            deadline=self.spec.deadline,
            retry=None if self.spec.retry else False,
        )

    async def _users(self, gate: Gate, http: httpx.AsyncClient, load: GateLoad) -> None:
        """``load.users`` request loops sharing one start schedule, until cancelled."""
        loop = asyncio.get_running_loop()
        interval = 1.0 / load.rate if load.rate > 0 else 0.0
        next_at, seq = loop.time(), itertools.count(1)

        async def user() -> None:
            nonlocal next_at
            while True:
                if interval:  # claim the next start slot of the shared schedule
                    now = loop.time()
                    at = next_at = max(next_at, now)
                    next_at += interval
                    await asyncio.sleep(at - now)
                try:
                    await self._request(gate, http, load, next(seq))
                except Exception as exc:  # counted, then the user carries on
                    outcome = outcome_of(exc)
                    self.errors[load.name][outcome] += 1
                    log.debug("%s: %s: %r", load.name, outcome, exc)
                    if not interval:
                        await asyncio.sleep(ERROR_PAUSE)
                else:
                    outcome = "ok"
                    self.requests[load.name] += 1
                self.outcomes.labels(load.name, outcome).inc()

        await asyncio.gather(*(user() for _ in range(load.users)))

    def _progress(self, last: dict[str, int], every: float) -> None:
        for name in last:
            tally = self.tally(name)
            total = sum(tally.values())
            rest = "".join(f", {k} {v}" for k, v in sorted(tally.items()) if k != "ok")
            rate = (total - last[name]) / every
            log.info("%s: %d requests, %d ok%s (%.1f/s)", name, total, tally["ok"], rest, rate)
            last[name] = total

    async def _supervise(self, stop: asyncio.Event, users: list[asyncio.Task[None]]) -> None:
        """Write stats and progress until ``stop``, the parent leaving or a users task dying."""
        spec, loop = self.spec, asyncio.get_running_loop()
        tick = min(1.0, spec.log_interval) if spec.log_interval > 0 else 1.0
        last, next_log = dict.fromkeys(self.errors, 0), loop.time() + spec.log_interval
        stopped = asyncio.ensure_future(stop.wait())
        try:
            while not stopped.done():
                self.write_stats()
                if spec.parent_pid is not None and os.getppid() != spec.parent_pid:
                    return  # the parent (the demo) is gone: stop too
                if spec.log_interval > 0 and loop.time() >= next_log:
                    self._progress(last, spec.log_interval)
                    next_log += spec.log_interval
                done, _ = await asyncio.wait(
                    {stopped, *users}, timeout=tick, return_when=asyncio.FIRST_COMPLETED
                )
                if done - {stopped}:
                    return  # a users task ended: it died of a bug, reported by run()
        finally:
            stopped.cancel()

    async def run(self, stop: asyncio.Event) -> None:
        """Run every user until ``stop`` is set; permits are released on the way out."""
        spec = self.spec
        async with contextlib.AsyncExitStack() as stack:
            fleet = await stack.enter_async_context(
                Fleet(
                    spec.redis_url, prefix=spec.prefix, pod_id=spec.pod_id, registry=self.registry
                )
            )
            self.worker_id = spec.pod_id or fleet.pod_id
            shown = ", ".join(f"{g.name} ({g.kind} at {g.url})" for g in spec.gates)
            log.info("worker %s: %s", fleet.pod_id, shown)
            users: list[asyncio.Task[None]] = []
            for load in spec.gates:
                conns = load.users * load.fan + 4
                http = await stack.enter_async_context(
                    httpx.AsyncClient(
                        timeout=httpx.Timeout(spec.deadline),
                        limits=httpx.Limits(max_connections=conns, max_keepalive_connections=conns),
                    )
                )
                gate = fleet.gate(load.name, floor=load.floor)
                users.append(asyncio.create_task(self._users(gate, http, load)))
            try:
                await self._supervise(stop, users)
            finally:
                for task in users:
                    task.cancel()
                # Bounded: leaving the block closes the fleet, which releases what is held.
                await asyncio.wait(users, timeout=SHUTDOWN_TIMEOUT)
            for task in users:
                exc = None if task.cancelled() or not task.done() else task.exception()
                if exc is not None:
                    raise exc  # a users task died of a bug: report it
        self.write_stats(stopped=True)
        for name in self.errors:
            log.info("%s: stopped after %s", name, self.tally(name))


async def run(spec: LoadSpec) -> dict[str, dict[str, int]]:
    """Run until SIGTERM/SIGINT, ``spec.duration`` or the parent leaving; outcomes per gate."""
    loop = asyncio.get_running_loop()
    load = Load(spec, CollectorRegistry())
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if spec.duration > 0:
        loop.call_later(spec.duration, stop.set)
    with contextlib.ExitStack() as stack:
        if spec.metrics_listen is not None:
            host, port = spec.metrics_listen
            server, thread = start_http_server(port, addr=host, registry=load.registry)
            stack.callback(thread.join, 5)
            stack.callback(server.server_close)
            stack.callback(server.shutdown)
            log.info("metrics on %s:%d", host, server.server_port)
        try:
            await load.run(stop)
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
    return {name: load.tally(name) for name in load.errors}


def _listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {value!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def build_parser() -> argparse.ArgumentParser:
    """The ``fleetgate worker`` argument parser."""
    p = argparse.ArgumentParser(
        prog="fleetgate worker",
        description="Requests to model servers (or simulators) through fleet gates: --concurrency "
        "loops per gate share one schedule of --rate starts per second. A 'vllm' request is one "
        "POST /v1/completions inside gate.permit(); a 'rerank' request is --passages passages "
        "cut into --batch-size batches, sent as POST /v1/ranking calls through gate.map(). Give "
        "--gate, --target-url and --kind once per gate (one --kind applies to all). Stops on "
        "SIGTERM/SIGINT or after --duration, releasing its permits.",
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
        "--kind", action="append", choices=list(CLI_KINDS), help="server kind (default: vllm)"
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
    p.add_argument(
        "--spec-from-env",
        metavar="LABEL",
        help=f"as the first option, alone: take the whole load as JSON from ${SPEC_ENV} (LABEL "
        "only names the process in ps); the demo's worker pods run so",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logs")
    return p


def spec_from_args(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> LoadSpec:
    """The :class:`LoadSpec` of ``fleetgate worker``'s options (``parser.error`` when bad)."""
    if ns.spec_from_env is not None:
        parser.error("--spec-from-env comes first and alone")
    kinds = ns.kind or ["vllm"]
    kinds = kinds * len(ns.gate) if len(kinds) == 1 else kinds
    if not len(ns.gate) == len(ns.target_url) == len(kinds):
        parser.error("give --target-url (and --kind, unless one applies to all) once per --gate")
    if len(set(ns.gate)) != len(ns.gate):
        parser.error("a --gate is given twice")
    if min(ns.concurrency, ns.passages, ns.batch_size) < 1 or ns.rate < 0:
        parser.error("--concurrency, --passages and --batch-size must be >= 1, --rate >= 0")
    gates = [
        GateLoad(
            name=name,
            kind=CLI_KINDS[kind],
            url=url.rstrip("/").removesuffix("/v1"),
            floor=ns.floor,
            users=ns.concurrency,
            rate=ns.rate,
            calls=math.ceil(ns.passages / ns.batch_size),
            fan=4,
            passages=min(ns.batch_size, ns.passages),
        )
        for name, url, kind in zip(ns.gate, ns.target_url, kinds, strict=True)
    ]
    return LoadSpec(
        redis_url=ns.redis,
        prefix=ns.prefix,
        gates=gates,
        deadline=ns.deadline,
        retry=True,
        duration=ns.duration,
        metrics_listen=ns.metrics_listen,
        log_interval=ns.log_interval,
    )


def _spec_from_env() -> LoadSpec | None:
    raw = os.environ.get(SPEC_ENV)
    if not raw:
        print(f"fleetgate worker: ${SPEC_ENV} is not set", file=sys.stderr)
        return None
    return msgspec.json.decode(raw, type=LoadSpec)


def main(argv: Sequence[str] | None = None) -> int:
    """``fleetgate worker``: parse ``argv`` (None = ``sys.argv[1:]``), run, return the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--spec-from-env"]:
        from_env = _spec_from_env()
        if from_env is None:
            return 2
        spec, verbose = from_env, False
    else:
        parser = build_parser()
        ns = parser.parse_args(argv)
        spec, verbose = spec_from_args(parser, ns), ns.verbose
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.DEBUG if verbose else logging.WARNING)
    try:
        asyncio.run(run(spec))
    except OSError as exc:  # e.g. the metrics port is taken
        log.error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
