"""The ``proxy_hop`` benchmark's load: keep-alive HTTP/1.1 connections on the loop's own
transport, one pre-built request each time, answers framed by httptools.

A caller built on httpx costs a few hundred µs of CPU per request, as much as the hop it
measures; on a 2-core box it would starve the servers under test. This one writes the same bytes
each time and only frames the answer (status, body to its end, chunked or by length), so the
machine's CPU goes to the servers. Three shapes: :func:`saturate` (``conns`` callers back to back
for a time: req/s), :func:`paced` (an open loop at a fixed rate: latency without queueing in the
caller) and both work for streamed answers (the answer ends at its last chunk).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httptools

__all__ = ["Load", "chat_request", "paced", "saturate"]

#: a request unanswered this long counts as failed (its connection closed): a run never hangs
CALL_TIMEOUT_S = 30.0


def chat_request(host: str, port: int, *, stream: bool, tokens: int) -> bytes:
    """A chat completion request to ``host:port`` as bytes on the wire (keep-alive)."""
    body = json.dumps(
        {
            "model": "sim-model",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": tokens,
            "stream": stream,
        }
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class _Conn(asyncio.Protocol):
    """One keep-alive connection: one request at a time, its answer's status when it ends."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[int] | None = None
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(exc)

    def on_message_complete(self) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(self.parser.get_status_code())

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._fail(exc or ConnectionError("closed"))

    def _fail(self, exc: BaseException) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    def send(self, request: bytes) -> asyncio.Future[int]:
        assert self.transport is not None and self.waiter is None
        if self.lost:
            raise ConnectionError("closed")
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self.waiter


@dataclass
class Load:
    """What one load run saw: answers by status, failures, elapsed seconds, latencies (s)."""

    statuses: dict[int, int] = field(default_factory=dict)
    failed: int = 0
    elapsed: float = 0.0
    latencies: list[float] = field(default_factory=list)

    @property
    def ok(self) -> int:
        return self.statuses.get(200, 0)


async def _connect(host: str, port: int) -> _Conn:
    _, conn = await asyncio.get_running_loop().create_connection(_Conn, host, port)
    return conn


async def _call(host: str, port: int, pool: list[_Conn], request: bytes, load: Load) -> None:
    while pool and pool[-1].lost:  # closed by the server while idle (its keep-alive timeout)
        pool.pop()
    conn = pool.pop() if pool else await _connect(host, port)
    t0 = time.perf_counter()
    try:
        status = await asyncio.wait_for(conn.send(request), CALL_TIMEOUT_S)
    except (OSError, TimeoutError, httptools.HttpParserError):
        load.failed += 1
        if conn.transport is not None:
            conn.transport.close()
        return
    load.latencies.append(time.perf_counter() - t0)
    load.statuses[status] = load.statuses.get(status, 0) + 1
    if not conn.lost:
        pool.append(conn)


async def saturate(host: str, port: int, request: bytes, conns: int, seconds: float) -> Load:
    """``conns`` callers, each on its own keep-alive connection, back to back for ``seconds``."""
    load, pool = Load(), [await _connect(host, port) for _ in range(conns)]
    end = time.monotonic() + seconds

    async def caller() -> None:
        mine: list[_Conn] = [pool.pop()]
        while time.monotonic() < end:
            await _call(host, port, mine, request, load)
        _close(mine)

    t0 = time.monotonic()
    await asyncio.gather(*(caller() for _ in range(conns)))
    load.elapsed = time.monotonic() - t0
    return load


async def paced(host: str, port: int, request: bytes, rate: float, seconds: float) -> Load:
    """An open loop: one request every ``1/rate`` s for ``seconds`` (on idle keep-alive
    connections, a new one when none is idle), each request's latency."""
    load, pool = Load(), [await _connect(host, port) for _ in range(4)]
    tasks: set[asyncio.Task[None]] = set()
    t0 = time.monotonic()
    n = int(rate * seconds)
    for i in range(n):
        await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
        task = asyncio.create_task(_call(host, port, pool, request, load))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    while tasks:
        await asyncio.gather(*list(tasks))
    load.elapsed = time.monotonic() - t0
    _close(pool)
    return load


def _close(pool: list[_Conn]) -> None:
    for conn in pool:
        if conn.transport is not None:
            conn.transport.close()
