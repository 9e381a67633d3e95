"""The proxy's HTTP/1.1 client to one upstream: h11 on asyncio protocols, a pool of keep-alive
connections, nothing else.

Why not httpx/httpcore: per forwarded request they cost ~40 % of the proxy's CPU (anyio cancel
scopes and locks around every read and write, a pool that scans every connection -- and polls
each idle one's socket -- on every request, the request's head and body written in two
system calls). httpx's ``AsyncClient`` also kept a cookie jar shared by every caller and logged
each URL with its query string at INFO. Here one request is one ``transport.write`` (head and
body, when the body is all here), and h11 does the framing both ways (Content-Length, chunked,
HEAD, 1xx, a body delimited by the close).

A connection goes back to the pool only after a complete exchange; a call that is cancelled or
fails midway closes its connection (the upstream sees the disconnect: vLLM and NIM abort the
request). An idle connection the upstream closed is never reused (its ``connection_lost`` came
first), nor one idle for longer than ``IDLE_S`` (uvicorn's keep-alive is 5 s).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any, cast

import h11

__all__ = ["ConnectFailed", "ConnectTimedOut", "Upstream", "UpstreamError", "UpstreamResponse"]

IDLE_S = 4.0
MAX_IDLE = 64


class UpstreamError(Exception):
    """The upstream broke the exchange (reset, closed early, spoke bad HTTP)."""


class ConnectFailed(UpstreamError):
    """No connection to the upstream."""


class ConnectTimedOut(UpstreamError):
    """The upstream did not accept a connection within ``connect_timeout_s``."""


class _Conn(asyncio.Protocol):
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.h11 = h11.Connection(h11.CLIENT)
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.pooled = False  # idle in the pool: the upstream has nothing to say now
        self.idle_since = 0.0
        self._wake: asyncio.Future[None] | None = None
        self._can_write: asyncio.Future[None] | None = None

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        if self.pooled:  # bytes nobody asked for: never let them answer the next request
            self.close()
            return
        self.h11.receive_data(data)
        self._notify()

    def eof_received(self) -> bool | None:
        self.lost = True
        self.h11.receive_data(b"")
        self._notify()
        return None  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost:
            self.lost = True
            self.h11.receive_data(b"")
        self._notify()
        if self._can_write is not None and not self._can_write.done():
            self._can_write.set_result(None)

    def pause_writing(self) -> None:
        self._can_write = self.loop.create_future()

    def resume_writing(self) -> None:
        if self._can_write is not None and not self._can_write.done():
            self._can_write.set_result(None)
        self._can_write = None

    def _notify(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    # -- use

    def usable(self, now: float) -> bool:
        t = self.transport
        return (
            not self.lost
            and t is not None
            and not t.is_closing()
            and now - self.idle_since < IDLE_S
            and self.h11.our_state is h11.IDLE
        )

    def close(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.abort()

    def write(self, data: bytes) -> None:
        if self.lost or self.transport is None or self.transport.is_closing():
            raise UpstreamError("the upstream closed the connection")
        self.transport.write(data)

    async def drain(self) -> None:
        if self._can_write is not None:
            await self._can_write
        if self.lost:
            raise UpstreamError("the upstream closed the connection")

    async def next_event(self) -> Any:
        while True:
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError as exc:
                raise UpstreamError(f"the upstream broke HTTP/1.1: {exc}") from None
            if event is not h11.NEED_DATA:
                return event
            if self.lost:  # h11 saw the EOF and still needs data: cannot happen, but never spin
                raise UpstreamError("the upstream closed the connection")
            self._wake = self.loop.create_future()
            try:
                await self._wake
            finally:
                self._wake = None


class UpstreamResponse:
    """The status and headers of the upstream's answer; the body with :meth:`aiter`; always
    :meth:`aclose` (pools the connection after a complete exchange, else closes it)."""

    def __init__(self, pool: _Pool, conn: _Conn, status: int, headers: list[tuple[bytes, bytes]]):
        self.status = status
        self.headers = headers
        self._pool = pool
        self._conn: _Conn | None = conn
        self._complete = False

    async def aiter(self) -> AsyncIterator[bytes]:
        conn = self._conn
        assert conn is not None
        while True:
            event = await conn.next_event()
            if type(event) is h11.Data:
                yield bytes(event.data)
            elif type(event) is h11.EndOfMessage:
                self._complete = True
                return
            else:
                raise UpstreamError("the upstream closed the connection mid-response")

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._pool.give_back(conn, self._complete)


class _Pool:
    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream
        self.idle: list[_Conn] = []

    async def take(self) -> _Conn:
        loop = asyncio.get_running_loop()
        now = loop.time()
        while self.idle:
            conn = self.idle.pop()
            conn.pooled = False
            if conn.usable(now):
                return conn
            conn.close()
        up = self.upstream
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(
                    lambda: _Conn(loop),
                    up.host,
                    up.port,
                    ssl=up.ssl,
                    server_hostname=up.host if up.ssl else None,
                ),
                up.connect_timeout_s,
            )
        except (TimeoutError, asyncio.TimeoutError):
            raise ConnectTimedOut(f"no connection within {up.connect_timeout_s:g} s") from None
        except OSError as exc:
            raise ConnectFailed(f"cannot connect: {exc.strerror or type(exc).__name__}") from None
        return conn

    def give_back(self, conn: _Conn, complete: bool) -> None:
        state = conn.h11
        if (
            complete
            and not conn.lost
            and state.our_state is h11.DONE
            and state.their_state is h11.DONE
            and not state.trailing_data[0]  # more than the answer: the stream is not to trust
            and len(self.idle) < MAX_IDLE
        ):
            state.start_next_cycle()
            conn.pooled = True
            conn.idle_since = asyncio.get_running_loop().time()
            self.idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        for conn in self.idle:
            conn.close()
        self.idle.clear()


class Upstream:
    """``scheme://host:port`` of one route, with its pool of keep-alive connections."""

    def __init__(self, scheme: str, host: str, port: int, connect_timeout_s: float) -> None:
        self.host = host
        self.port = port
        self.connect_timeout_s = connect_timeout_s
        self.ssl: ssl.SSLContext | None = _ssl_context() if scheme == "https" else None
        self._pool = _Pool(self)

    async def send(
        self,
        method: bytes,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        content: bytes | AsyncIterable[bytes],
    ) -> UpstreamResponse:
        """Send the request; return once the response's head is in. Cancelling it closes the
        connection."""
        conn = await self._pool.take()
        try:
            state = conn.h11
            try:
                head = state.send(h11.Request(method=method, target=target, headers=headers))
                if isinstance(content, bytes):
                    out = head
                    if content:
                        out += state.send(h11.Data(data=content))
                    conn.write(out + state.send(h11.EndOfMessage()))
                else:
                    conn.write(head)
                    async for chunk in content:
                        if chunk:
                            conn.write(state.send(h11.Data(data=chunk)))
                            await conn.drain()
                    conn.write(state.send(h11.EndOfMessage()))
            except h11.LocalProtocolError as exc:  # the body does not match its framing
                raise UpstreamError(f"cannot forward the request: {exc}") from None
            while True:
                event = await conn.next_event()
                if type(event) is h11.Response:
                    return UpstreamResponse(
                        self._pool, conn, event.status_code, list(event.headers.raw_items())
                    )
                if type(event) is not h11.InformationalResponse:  # 1xx: the answer follows
                    raise UpstreamError("the upstream closed the connection without answering")
        except BaseException:
            conn.close()
            raise

    def close(self) -> None:
        self._pool.close()


def _ssl_context() -> ssl.SSLContext:
    try:
        import certifi
    except ImportError:  # pragma: no cover - httpx depends on certifi
        return ssl.create_default_context()
    return ssl.create_default_context(cafile=certifi.where())
