"""Upstream requests in one write (proxy/_coalesce.py): held writes go out at the read that
awaits the answer, at close they are dropped, past FLUSH_BYTES they go at once; the proxy's
routes that read bodies whole use it, a route streaming its uploads does not."""

from __future__ import annotations

import asyncio
import socket
import ssl
from typing import Any

import httpcore
import httpx
import pytest

from fleetgate.proxy._coalesce import FLUSH_BYTES, CoalescingBackend, _CoalescingStream, install
from fleetgate.proxy._upstream import Upstream
from fleetgate.proxy.config import RouteConfig


class _Recorded(httpcore.AsyncNetworkStream):
    """A stream that records what reaches it."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.reads = 0
        self.closed = False

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self.writes.append(buffer)

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        self.reads += 1
        return b"HTTP/1.1 200 OK\r\n"

    async def aclose(self) -> None:
        self.closed = True

    async def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.AsyncNetworkStream:
        return _Recorded()

    def get_extra_info(self, info: str) -> Any:
        return f"info:{info}"


def test_writes_wait_for_the_read_and_go_as_one() -> None:
    async def go() -> _Recorded:
        inner = _Recorded()
        stream = _CoalescingStream(inner)
        for part in (b"POST / HTTP/1.1\r\nContent-Length: 4\r\n\r\n", b"body", b""):
            await stream.write(part)
        assert inner.writes == []  # nothing sent before the answer is awaited
        assert await stream.read(1024) == b"HTTP/1.1 200 OK\r\n"
        await stream.read(1024)  # nothing held: no empty write
        assert stream.get_extra_info("is_readable") == "info:is_readable"
        return inner

    inner = asyncio.run(go())
    assert inner.writes == [b"POST / HTTP/1.1\r\nContent-Length: 4\r\n\r\nbody"]
    assert inner.reads == 2


class _OnSocket(_Recorded):
    """A recorded stream over a real socket (what httpcore's anyio stream gives)."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__()
        self.sock = sock
        self.asked: list[str] = []

    def get_extra_info(self, info: str) -> Any:
        self.asked.append(info)
        return self.sock if info == "socket" else f"info:{info}"


def test_is_readable_polls_the_socket_itself() -> None:
    """httpcore's pool asks every idle connection is_readable per request: the stream answers
    from its socket (looked up once), as httpcore does: not readable while idle, readable once
    the server sent something or closed, and a closed socket counts as readable."""
    ours, theirs = socket.socketpair()
    inner = _OnSocket(ours)
    stream = _CoalescingStream(inner)
    try:
        assert stream.get_extra_info("is_readable") is False
        theirs.send(b"x")  # bytes past an answer, or a server's close: never reuse it
        assert stream.get_extra_info("is_readable") is True
        ours.recv(1)
        assert stream.get_extra_info("is_readable") is False
        theirs.close()
        assert stream.get_extra_info("is_readable") is True
        assert inner.asked == ["socket"]  # once, at the start; every answer from the socket
        assert stream.get_extra_info("server_addr") == "info:server_addr"
    finally:
        ours.close()
        theirs.close()
    assert stream.get_extra_info("is_readable") is True  # closed: as httpcore says


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_the_stream_finds_the_socket_of_the_real_backend(loop: str) -> None:
    """httpcore's anyio stream gives asyncio's TransportSocket or uvloop's PseudoSocket, not a
    socket.socket: the stream must still poll it itself, or the saving silently goes."""

    async def go() -> tuple[bool, bool]:
        accepted: list[asyncio.StreamWriter] = []
        server = await asyncio.start_server(lambda r, w: accepted.append(w), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        stream = await CoalescingBackend(httpcore.AnyIOBackend()).connect_tcp("127.0.0.1", port)
        assert isinstance(stream, _CoalescingStream)
        try:
            return stream._socket is not None, stream.get_extra_info("is_readable")
        finally:
            await stream.aclose()
            for writer in accepted:
                writer.close()
                await writer.wait_closed()
            server.close()
            await server.wait_closed()

    if loop == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        found, readable = uvloop.run(go())
    else:
        found, readable = asyncio.run(go())
    assert found
    assert readable is False


def test_large_writes_go_at_once_and_a_close_drops_what_is_held() -> None:
    async def go() -> _Recorded:
        inner = _Recorded()
        stream = _CoalescingStream(inner)
        await stream.write(b"h" * 100)
        await stream.write(b"b" * FLUSH_BYTES)  # past the bound: both go, as one
        assert inner.writes == [b"h" * 100 + b"b" * FLUSH_BYTES]
        await stream.write(b"abandoned")
        await stream.aclose()
        assert inner.closed
        return inner

    assert len(asyncio.run(go()).writes) == 1


def test_tls_starts_after_the_held_writes_and_coalesces_too() -> None:
    async def go() -> tuple[_Recorded, httpcore.AsyncNetworkStream]:
        inner = _Recorded()
        stream = _CoalescingStream(inner)
        await stream.write(b"CONNECT x:443 HTTP/1.1\r\n\r\n")
        tls = await stream.start_tls(ssl.create_default_context(), "x")
        return inner, tls

    inner, tls = asyncio.run(go())
    assert inner.writes == [b"CONNECT x:443 HTTP/1.1\r\n\r\n"]
    assert isinstance(tls, _CoalescingStream)


@pytest.mark.parametrize(("stream_uploads", "coalesced"), [(False, True), (True, False)])
def test_routes_reading_bodies_whole_send_requests_in_one_write(
    stream_uploads: bool, coalesced: bool
) -> None:
    """Pins httpcore's pool attribute the backend is set on (``install`` returns False and the
    proxy sends as httpcore does if it moved)."""
    route = RouteConfig(upstream="http://127.0.0.1:9", gate="g", stream_uploads=stream_uploads)
    upstream = Upstream(route)
    backends = [t._pool._network_backend for t in upstream.transports]  # type: ignore[attr-defined]
    assert all(isinstance(b, CoalescingBackend) == coalesced for b in backends)
    transport = httpx.AsyncHTTPTransport()
    assert install(transport) and install(transport)  # idempotent
    assert isinstance(transport._pool._network_backend, CoalescingBackend)  # type: ignore[attr-defined]
    assert not isinstance(transport._pool._network_backend._inner, CoalescingBackend)  # type: ignore[attr-defined]
