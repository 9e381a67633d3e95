"""Helpers of the proxy tests: a test upstream that records what it saw, proxy configs, and
polling Redis for a gate's holders and waiters."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from fleetgate.keys import GateKeys
from fleetgate.proxy import ProxyConfig
from fleetgate.tools.sim._server import run_unless_disconnected


@dataclass
class UpstreamLog:
    """What the test upstream saw: arrival order, concurrency, cancellations."""

    arrivals: list[str] = field(default_factory=list)
    running: int = 0
    peak: int = 0
    cancelled: int = 0
    finished: int = 0
    headers: list[dict[str, str]] = field(default_factory=list)
    sse_sent: list[float] = field(default_factory=list)
    stream_done: list[float] = field(default_factory=list)


def upstream_app(hold_s: float = 0.05) -> Starlette:
    """``/work?tag=T&ms=M``: records T, holds M ms (default ``hold_s``), answers JSON;
    ``/echo``: the request's headers and body; ``/status/N``: status N with a body and a header
    of its own; ``/sse?n=N&ms=M``: N events M ms apart; ``/hang``: never answers (counts the
    cancellation); ``/big?mb=N``: N MiB at once."""
    state = UpstreamLog()

    async def work(request: Request) -> Response:
        tag = request.query_params.get("tag", "")
        ms = float(request.query_params.get("ms", hold_s * 1000))
        await request.body()
        state.arrivals.append(tag)
        state.running += 1
        state.peak = max(state.peak, state.running)
        try:
            await asyncio.sleep(ms / 1000)
        except asyncio.CancelledError:
            state.cancelled += 1
            raise
        finally:
            state.running -= 1
        state.finished += 1
        return JSONResponse({"tag": tag})

    async def echo(request: Request) -> Response:
        try:
            body = await request.body()
        except ClientDisconnect:  # the proxy cut a body that grew too large
            state.cancelled += 1
            return Response(status_code=499)
        state.headers.append({k: v for k, v in request.headers.items()})
        url = request.url
        seen = {"headers": dict(request.headers.items()), "body": body.decode()}
        return JSONResponse({**seen, "path": url.path, "query": url.query})

    async def status(request: Request) -> Response:
        code = int(request.path_params["code"])
        return Response(
            b'{"upstream": "said so"}',
            status_code=code,
            headers={"x-upstream": "yes", "retry-after": "7"},
            media_type="application/json",
        )

    async def sse(request: Request) -> Response:
        n = int(request.query_params.get("n", "5"))
        ms = float(request.query_params.get("ms", "100"))

        async def events() -> Any:
            state.running += 1
            state.peak = max(state.peak, state.running)
            try:
                for i in range(n):
                    state.sse_sent.append(time.monotonic())
                    yield f"data: {json.dumps({'i': i})}\n\n".encode()
                    await asyncio.sleep(ms / 1000)
                yield b"data: [DONE]\n\n"
                state.stream_done.append(time.monotonic())
            except asyncio.CancelledError:
                state.cancelled += 1
                raise
            finally:
                state.running -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    async def hang(request: Request) -> Response:
        await request.body()
        state.running += 1
        try:
            finished, _ = await run_unless_disconnected(request, asyncio.sleep(3600))
        finally:
            state.running -= 1
        state.cancelled += not finished
        return Response()

    async def big(request: Request) -> Response:
        mb = int(request.query_params.get("mb", "1"))
        return Response(b"x" * (mb * 1024 * 1024), media_type="application/octet-stream")

    async def health(request: Request) -> Response:
        return Response()

    app = Starlette(
        routes=[
            Route("/work", work, methods=["GET", "POST"]),
            Route("/echo", echo, methods=["GET", "POST", "PUT"]),
            Route("/status/{code}", status, methods=["GET", "POST"]),
            Route("/sse", sse, methods=["GET", "POST"]),
            Route("/hang", hang, methods=["GET", "POST"]),
            Route("/big", big, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
        ]
    )
    app.state.log = state
    return app


def proxy_config(
    redis_url: str, prefix: str, upstream: str, gate: str = "g", **route: Any
) -> ProxyConfig:
    """One route over every path to ``upstream`` through ``gate``; ``proxy`` (a dict) sets
    ``[proxy]`` keys, the rest are route keys."""
    proxy = {"listen": "127.0.0.1:0", "drain_seconds": 5.0, **route.pop("proxy", {})}
    routes = route.pop("routes", None) or [{"upstream": upstream, "gate": gate, **route}]
    raw = {"redis": {"url": redis_url, "prefix": prefix}, "proxy": proxy, "routes": routes}
    config: ProxyConfig = ProxyConfig.from_mapping(raw, env={})
    return config


def gate_counts(url: str, prefix: str, gate: str) -> tuple[int, int]:
    """(holders, waiters) of ``gate`` in Redis."""
    keys = GateKeys.of(prefix, gate)
    with redis.Redis.from_url(url) as r:
        return int(r.zcard(keys.holders)), int(r.zcard(keys.waiters))


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.02)


def wait_idle(url: str, prefix: str, gate: str, timeout: float = 10.0) -> None:
    """Wait until the gate has no holder and no waiter (every permit came back)."""
    wait_until(
        lambda: gate_counts(url, prefix, gate) == (0, 0),
        timeout,
        f"gate {gate} idle (holders, waiters now {gate_counts(url, prefix, gate)})",
    )
