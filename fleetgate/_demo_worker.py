"""One worker pod of ``fleetgate demo``: drives more load through the gates than the servers hold.

Run by the demo as ``python -m fleetgate._demo_worker`` with a :class:`WorkerSpec` as JSON in
``$FLEETGATE_DEMO_WORKER`` (the environment, not argv, so ``ps`` shows no Redis URL). Each
*user* is a loop of requests against one simulator, every call inside a fleet-wide permit:

* ``chat``: one ``/v1/chat/completions`` call inside ``gate.permit()``;
* ``embed``: ``gate.map()`` over ``calls`` ``/v1/embeddings`` calls, ``fan`` at a time;
* ``rerank``: ``gate.map()`` over ``calls`` ``/v1/ranking`` batches, ``fan`` at a time.

Nothing is retried (``retry=False``), so every failure a server or the gate produced is counted.
Counters go to ``stats_path`` (JSON, atomically replaced) every second and at exit. SIGTERM or
SIGINT stops the users, releases every permit and exits 0; so does the demo going away.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Literal

import httpx
import msgspec
from prometheus_client import CollectorRegistry

from fleetgate.client import DeadlineExceeded, Fleet, Gate, Overloaded

__all__ = ["SPEC_ENV", "GateLoad", "WorkerSpec", "WorkerStats", "main"]

SPEC_ENV = "FLEETGATE_DEMO_WORKER"
SHUTDOWN_TIMEOUT = 5.0

Kind = Literal["chat", "embed", "rerank"]


class GateLoad(msgspec.Struct, frozen=True):
    """The load one worker puts on one gate."""

    name: str
    kind: Kind
    url: str  # simulator base URL, no trailing slash
    model: str
    floor: int
    users: int  # concurrent request loops
    calls: int = 1  # calls per request (gate.map over them)
    fan: int = 1  # max_in_flight of that map
    passages: int = 64  # rerank batch size


class WorkerSpec(msgspec.Struct, frozen=True):
    """Everything a worker needs, passed as one JSON argument."""

    worker_id: str
    redis_url: str
    prefix: str
    stats_path: str
    parent_pid: int
    gates: list[GateLoad]
    deadline: float = 30.0


class WorkerStats(msgspec.Struct):
    """What a worker reports: per gate, requests and calls that succeeded, errors by kind."""

    worker_id: str
    pid: int
    updated: float = 0.0
    requests: dict[str, int] = msgspec.field(default_factory=dict)
    calls: dict[str, int] = msgspec.field(default_factory=dict)
    errors: dict[str, dict[str, int]] = msgspec.field(default_factory=dict)
    stopped: bool = False


def _error_kind(exc: BaseException) -> str:
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


class Worker:
    """The users of one worker process and their counters."""

    def __init__(self, spec: WorkerSpec) -> None:
        """Prepare counters; nothing runs until :meth:`run`."""
        self.spec = spec
        self.stats = WorkerStats(worker_id=spec.worker_id, pid=os.getpid())
        self.calls: Counter[str] = Counter()
        self.requests: Counter[str] = Counter()
        self.errors: dict[str, Counter[str]] = {g.name: Counter() for g in spec.gates}
        self.stopping = False

    def write_stats(self, stopped: bool = False) -> None:
        """Replace the stats file atomically with the current counters."""
        s = self.stats
        s.updated, s.stopped = time.time(), stopped
        s.requests, s.calls = dict(self.requests), dict(self.calls)
        s.errors = {name: dict(c) for name, c in self.errors.items()}
        path = Path(self.spec.stats_path)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(msgspec.json.encode(s))
        os.replace(tmp, path)

    async def _call(self, http: httpx.AsyncClient, load: GateLoad, i: int, k: int = 0) -> None:
        """Call ``k`` of request ``i`` to the simulator behind ``load`` (raises on non-2xx)."""
        text = f"{self.spec.worker_id} request {i}.{k}"
        if load.kind == "chat":
            body: dict[str, Any] = {
                "model": load.model,
                "messages": [{"role": "user", "content": text}],
                "max_tokens": 32,
            }
            resp = await http.post(f"{load.url}/v1/chat/completions", json=body)
        elif load.kind == "embed":
            body = {"model": load.model, "input": [text]}
            resp = await http.post(f"{load.url}/v1/embeddings", json=body)
        else:
            body = {
                "model": load.model,
                "query": {"text": text},
                "passages": [{"text": f"passage {k} of {text}"} for k in range(load.passages)],
            }
            resp = await http.post(f"{load.url}/v1/ranking", json=body)
        resp.raise_for_status()
        self.calls[load.name] += 1

    async def _user(self, gate: Gate, http: httpx.AsyncClient, load: GateLoad) -> None:
        """Send requests back to back until cancelled or stopping."""
        i = 0
        while not self.stopping:
            i += 1
            try:
                if load.kind == "chat":
                    async with gate.permit(deadline=self.spec.deadline):
                        await self._call(http, load, i)
                else:
                    await gate.map(
                        functools.partial(self._call, http, load, i),  # an async callable
                        range(load.calls),
                        max_in_flight=load.fan,
                        deadline=self.spec.deadline,
                        retry=False,
                    )
                self.requests[load.name] += 1
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # counted, then the user carries on
                self.errors[load.name][_error_kind(exc)] += 1
                await asyncio.sleep(0.2)

    async def run(self, stop: asyncio.Event) -> None:
        """Run every user until ``stop`` is set; permits are released on the way out."""
        spec = self.spec
        async with contextlib.AsyncExitStack() as stack:
            fleet = await stack.enter_async_context(
                Fleet(
                    spec.redis_url,
                    prefix=spec.prefix,
                    pod_id=spec.worker_id,
                    registry=CollectorRegistry(),
                )
            )
            tasks: list[asyncio.Task[None]] = []
            for load in spec.gates:
                conns = load.users * load.fan + 4
                http = await stack.enter_async_context(
                    httpx.AsyncClient(
                        timeout=httpx.Timeout(spec.deadline),
                        limits=httpx.Limits(max_connections=conns, max_keepalive_connections=conns),
                    )
                )
                gate = fleet.gate(load.name, floor=load.floor)
                tasks += [
                    asyncio.create_task(self._user(gate, http, load)) for _ in range(load.users)
                ]
            stopped = asyncio.ensure_future(stop.wait())
            try:
                while not stopped.done():
                    self.write_stats()
                    if os.getppid() != spec.parent_pid:  # the demo is gone: stop too
                        break
                    await asyncio.wait({stopped}, timeout=1.0)
            finally:
                self.stopping = True
                for t in [*tasks, stopped]:
                    t.cancel()
                # Bounded: leaving the block closes the fleet, which releases what is held.
                await asyncio.wait([*tasks, stopped], timeout=SHUTDOWN_TIMEOUT)
        self.write_stats(stopped=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m fleetgate._demo_worker [NAME]`` (NAME only labels ``ps``)."""
    raw = os.environ.get(SPEC_ENV)
    if not raw:
        print(f"fleetgate._demo_worker: ${SPEC_ENV} is not set", file=sys.stderr)
        return 2
    spec = msgspec.json.decode(raw, type=WorkerSpec)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await Worker(spec).run(stop)

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
