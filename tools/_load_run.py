"""The request loops of one load-generating process: *users* per gate, every request inside a
fleet-wide permit, outcomes counted, stats written, stopped by a signal, a duration or the
parent leaving."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import math
import os
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import msgspec
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client import Counter as PromCounter

from fleetgate.client import DeadlineExceeded, Fleet, Gate, Overloaded
from fleetgate.tools._load_spec import GateLoad, LoadSpec, WorkerStats

__all__ = ["Load", "charge", "log", "outcome_of", "prompt_of", "run"]

log = logging.getLogger("fleetgate.tools.load")  # the worker's logger, whatever module logs

SHUTDOWN_TIMEOUT = 5.0
ERROR_PAUSE = 0.2  # seconds an unpaced user waits after a failed request


async def _read_stream(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> int | None:
    """POST a streamed request and read its events to ``data: [DONE]`` (raises on non-2xx, or a
    stream that ends without it); the total tokens of its usage chunk, None without one."""
    used = None
    async with http.stream("POST", url, json=body) as resp:
        resp.raise_for_status()
        last = ""
        async for line in resp.aiter_lines():
            last = line or last
            if line.startswith("data: {") and '"usage":{' in line.replace(" ", ""):
                used = _total_tokens(msgspec.json.decode(line[6:]))
    if last != "data: [DONE]":
        raise httpx.RemoteProtocolError(f"stream from {url} ended without [DONE]")
    return used


def _total_tokens(reply: Any) -> int | None:
    """``usage.total_tokens`` of a reply (or a stream's usage chunk), None when it has none."""
    usage = reply.get("usage") if isinstance(reply, dict) else None
    total = usage.get("total_tokens") if isinstance(usage, dict) else None
    return total if isinstance(total, int) and total >= 0 else None


def prompt_of(load: GateLoad, text: str) -> str:
    """``text``, padded to ``load.prompt_tokens`` tokens (4 characters a token) when asked."""
    want = 4 * load.prompt_tokens
    if len(text) >= want:
        return text
    return (text + " " + "lorem " * (want // 6 + 1))[:want]


def charge(load: GateLoad, text: str) -> int:
    """What a caller without the server's tokenizer charges the token budget for a call: its
    prompt at 3 characters a token (the safe side: the server counts 4) plus ``max_tokens``,
    in whole blocks of ``load.token_block`` (as benchmarks/tokens.py charges)."""
    block = load.token_block
    return math.ceil((math.ceil(len(text) / 3) + _max_tokens(load)) / block) * block


def _max_tokens(load: GateLoad) -> int:
    return load.max_tokens or (16 if load.kind == "completions" else 32)


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

    def _text(self, load: GateLoad, i: int, k: int = 0) -> str:
        return prompt_of(load, f"{self.worker_id} request {i}.{k}")

    async def _call(
        self, http: httpx.AsyncClient, load: GateLoad, i: int, k: int = 0
    ) -> int | None:
        """Call ``k`` of request ``i`` to the server behind ``load`` (raises on non-2xx); the
        tokens the reply's usage says it used (None: not stated)."""
        text = self._text(load, i, k)
        model = {"model": load.model} if load.model else {}
        body: dict[str, Any]
        if load.kind == "completions":
            path, body = "completions", {"prompt": text, "max_tokens": _max_tokens(load)}
        elif load.kind == "chat":
            messages = [{"role": "user", "content": text}]
            path, body = "chat/completions", {"messages": messages, "max_tokens": _max_tokens(load)}
        elif load.kind == "embed":
            path, body = "embeddings", {"input": [text]}
        else:
            passages = [{"text": f"passage {p} of {text}"} for p in range(load.passages)]
            path, body = "ranking", {"query": {"text": text}, "passages": passages}
        if load.stream and load.kind in ("completions", "chat"):
            body = {**model, **body, "stream": True}
            if load.token_block:  # the usage chunk, to report what the call used
                body["stream_options"] = {"include_usage": True}
            used = await _read_stream(http, f"{load.url}/v1/{path}", body)
        else:
            resp = await http.post(f"{load.url}/v1/{path}", json={**model, **body})
            resp.raise_for_status()
            used = _total_tokens(resp.json()) if load.token_block else None
        self.calls[load.name] += 1
        return used

    async def _request(self, gate: Gate, http: httpx.AsyncClient, load: GateLoad, i: int) -> None:
        if load.kind in ("completions", "chat"):
            tokens = charge(load, self._text(load, i)) if load.token_block else 0
            async with gate.permit(deadline=self.spec.deadline, tokens=tokens) as lease:
                used = await self._call(http, load, i)
                if used is not None:
                    lease.report("ok", tokens=used)
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
