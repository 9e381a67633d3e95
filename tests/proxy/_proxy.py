"""Helpers of the proxy tests: a test upstream that records what it saw, proxy configs, and
polling Redis for a gate's holders and waiters."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import redis
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from fleetgate.client import Fleet
from fleetgate.keys import GateKeys
from fleetgate.proxy import ProxyConfig, serve_in_thread
from fleetgate.tools.sim._server import Served, run_unless_disconnected

from ..conftest import RedisUnderTest


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
    #: the OpenAI-like endpoints: each request's JSON body, and the tokens each answer said
    bodies: list[dict[str, Any]] = field(default_factory=list)
    used: list[int] = field(default_factory=list)


def server_tokens(text: str) -> int:
    """How the test upstream counts tokens (not the proxy's characters / 4): words cut into
    pieces of at most 6 characters, each punctuation mark one token -- about 1.2 tokens a word of
    English, as BPE tokenizers count."""
    return len(_PIECES.findall(text))


_PIECES = re.compile(r"\w{1,6}|[^\w\s]")


def _chat_prompt(body: dict[str, Any]) -> int:
    if "messages" in body:  # a chat template of 5 tokens a message and 2 for the reply
        return 2 + sum(5 + server_tokens(str(m.get("content") or "")) for m in body["messages"])
    prompt = body.get("prompt", "")
    return (
        sum(server_tokens(p) if isinstance(p, str) else 1 for p in prompt)
        if isinstance(prompt, list)
        else server_tokens(str(prompt))
    )


def openai_routes(state: UpstreamLog) -> list[Route]:
    """An OpenAI-like ``/v1/chat/completions`` and ``/v1/completions`` (the output: the
    ``x-output-tokens`` header's count of words, at most ``max_tokens``; held ``x-hold-ms``;
    streamed when asked, with ``"usage":null`` in every chunk and a usage-only last chunk when
    ``stream_options.include_usage``, as OpenAI's API does) and ``/v1/embeddings`` (usage:
    the input's tokens)."""

    async def completions(request: Request) -> Response:
        body = json.loads(await request.body())
        state.bodies.append(body)
        bound = body.get("max_completion_tokens") or body.get("max_tokens")
        out = int(request.headers.get("x-output-tokens", "16"))
        out = min(out, bound) if bound else out
        prompt = _chat_prompt(body)
        usage = {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out}
        state.running += 1
        state.peak = max(state.peak, state.running)
        try:
            await asyncio.sleep(float(request.headers.get("x-hold-ms", "0")) / 1000)
        finally:
            state.running -= 1
        state.used.append(prompt + out)
        chat = "messages" in body
        kind = "chat.completion" if chat else "text_completion"
        head = {"id": "cmpl-1", "object": kind, "created": 1700000000, "model": "m"}
        if not body.get("stream"):
            text = "word " * out
            choice = {"index": 0, "finish_reason": "length"}
            choice |= (
                {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
            )
            answer = {**head, "choices": [choice], "usage": usage}
            return Response(json.dumps(answer), media_type="application/json")
        with_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        kind += ".chunk" if chat else ""

        async def events() -> Any:
            for i in range(out):
                delta = {"delta": {"content": "word "}} if chat else {"text": "word "}
                chunk: dict[str, Any] = {**head, "object": kind, "choices": [{"index": 0, **delta}]}
                if with_usage:
                    chunk["usage"] = None
                yield f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n".encode()
                if i % 4 == 3:
                    await asyncio.sleep(0)
            if with_usage:
                last = {**head, "object": kind, "choices": [], "usage": usage}
                yield f"data: {json.dumps(last, separators=(',', ':'))}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def embeddings(request: Request) -> Response:
        body = json.loads(await request.body())
        state.bodies.append(body)
        given = body.get("input", "")
        texts = given if isinstance(given, list) else [given]
        prompt = sum(server_tokens(t) for t in texts)
        state.used.append(prompt)
        data = [
            {"object": "embedding", "index": i, "embedding": [0.0, 1.0]} for i in range(len(texts))
        ]
        usage = {"prompt_tokens": prompt, "total_tokens": prompt}
        return JSONResponse({"object": "list", "data": data, "model": "e", "usage": usage})

    return [
        Route("/v1/chat/completions", completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
    ]


def upstream_app(hold_s: float = 0.05) -> Starlette:
    """``/work?tag=T&ms=M``: records T, holds M ms (default ``hold_s``), answers JSON;
    ``/echo``: the request's headers and body; ``/status/N``: status N with a body and a header
    of its own; ``/sse?n=N&ms=M``: N events M ms apart; ``/hang``: never answers (counts the
    cancellation); ``/big?mb=N``: N MiB at once; ``/cookie?v=V``: sets the cookie
    ``session=V``; the OpenAI-like endpoints of :func:`openai_routes`."""
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

    async def cookie(request: Request) -> Response:
        value = request.query_params.get("v", "")
        return Response(b"{}", headers={"set-cookie": f"session={value}; Path=/"})

    app = Starlette(
        routes=[
            Route("/work", work, methods=["GET", "POST"]),
            Route("/echo", echo, methods=["GET", "POST", "PUT"]),
            Route("/status/{code}", status, methods=["GET", "POST"]),
            Route("/sse", sse, methods=["GET", "POST"]),
            Route("/hang", hang, methods=["GET", "POST"]),
            Route("/big", big, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/cookie", cookie, methods=["GET"]),
            *openai_routes(state),
        ]
    )
    app.state.log = state
    return app


def _ok(head: bytes) -> tuple[bytes, bool]:
    return b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}", False


@contextlib.contextmanager
def counting_upstream(
    reply: Callable[[bytes], tuple[bytes, bool]] = _ok,
) -> Iterator[tuple[str, list[int]]]:
    """A bare HTTP/1.1 server on loopback that counts the connections it accepted and the
    requests it read: yields (base URL, [connections, requests]). ``reply(head)`` gives the
    bytes to answer a request's head with (default ``200 {}``) and whether to close then."""
    counts = [0, 0]
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    loop = asyncio.new_event_loop()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        counts[0] += 1
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                counts[1] += 1
                answer, close = reply(head)
                writer.write(answer)
                if close:
                    await writer.drain()
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def main(stop: asyncio.Event) -> None:
        async with await asyncio.start_server(handle, sock=sock):
            await stop.wait()

    stop = asyncio.Event()
    thread = threading.Thread(target=loop.run_until_complete, args=(main(stop),), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}", counts
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(5)
        loop.close()
        sock.close()


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


def upstream_log(up: Served) -> UpstreamLog:
    """What the :func:`upstream_app` served by ``up`` saw."""
    log: UpstreamLog = up.state.log
    return log


def serve_proxy(rut: RedisUnderTest, upstream: Served | str, **route: Any) -> Any:
    """A proxy on a thread (:func:`fleetgate.proxy.serve_in_thread`, a context manager giving
    its URL) with one route to ``upstream`` through gate ``g`` (see :func:`proxy_config`)."""
    url = upstream if isinstance(upstream, str) else upstream.url
    return serve_in_thread(proxy_config(rut.url, rut.prefix, url, **route))


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


# -- proxy processes ---------------------------------------------------------------------------


def rerank_worker(url: str, prefix: str, gate: str, sim_url: str, calls: int) -> dict[str, int]:
    """A Python service beside the proxies: ``calls`` rerank calls through ``gate.map``
    (no retries), straight to the reranker. Returns its failures."""

    async def main() -> dict[str, int]:
        failed = 0
        limits = httpx.Limits(max_connections=16, max_keepalive_connections=16)
        async with httpx.AsyncClient(base_url=sim_url, timeout=60, limits=limits) as http:

            async def call(i: int) -> None:
                nonlocal failed
                body = {"query": {"text": "q"}, "passages": [{"text": f"p{i}"}]}
                r = await http.post("/v1/ranking", json=body)
                if r.status_code != 200:
                    failed += 1

            async with Fleet(url, prefix=prefix, registry=CollectorRegistry()) as fleet:
                g = fleet.gate(gate)
                await g.map(call, range(calls), max_in_flight=16, deadline=60, retry=False)
        return {"failed": failed, "calls": calls}

    return asyncio.run(main())
