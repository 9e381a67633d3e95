"""Upstream connections that send a request in one write.

httpcore writes an HTTP/1.1 request as it builds it: the head, each body chunk, the end of the
message (an empty write for a body framed by its length) -- three or four socket writes, each a
system call and, on a loaded machine, a wake-up of the upstream for a fragment of a request.
The proxy sends a body it already holds whole (every route but one with ``stream_uploads``), so
nothing is gained by sending the head before the body: :class:`CoalescingBackend` holds the
writes of a connection until it reads (the answer is awaited only after the whole request is
written) or :data:`FLUSH_BYTES` are held, then sends them as one.

Not for streamed uploads: their chunks come as the caller sends them, and held until the request
ends they would reach the upstream late. :class:`~._upstream.Upstream` installs the backend on
the routes that read bodies whole.

The stream also answers httpcore's ``is_readable`` itself. httpcore's pool asks it of every idle
connection each time it assigns a request (a readable idle socket is a server's close: the
connection is dropped, not reused); through anyio each ask built the socket's attribute table
anew, ~5 % of the proxy's CPU per request at saturation. The socket is looked up once and polled
as httpcore polls it.
"""

from __future__ import annotations

import select
import ssl
import typing

import httpcore

__all__ = ["FLUSH_BYTES", "CoalescingBackend", "install"]

#: writes held past this many bytes go out at once (a large body is not copied into one buffer)
FLUSH_BYTES = 64 * 1024


class _CoalescingStream(httpcore.AsyncNetworkStream):
    """A network stream whose writes wait for the next read, close or :data:`FLUSH_BYTES`."""

    def __init__(self, inner: httpcore.AsyncNetworkStream) -> None:
        self._inner = inner
        self._held: list[bytes] = []
        self._size = 0
        # asyncio's TransportSocket, uvloop's PseudoSocket: anything with the descriptor
        sock = inner.get_extra_info("socket")
        self._socket: _HasFileno | None = sock if hasattr(sock, "fileno") else None

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        self._held.append(buffer)
        self._size += len(buffer)
        if self._size >= FLUSH_BYTES:
            await self._flush(timeout)

    async def _flush(self, timeout: float | None) -> None:
        if not self._held:
            return
        held = self._held
        data = held[0] if len(held) == 1 else b"".join(held)
        self._held, self._size = [], 0
        await self._inner.write(data, timeout)

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        await self._flush(timeout)
        return await self._inner.read(max_bytes, timeout)

    async def aclose(self) -> None:
        # a connection closed before its answer was read: the request is abandoned, its held
        # writes with it (sending them now would start work nobody waits for)
        self._held, self._size = [], 0
        await self._inner.aclose()

    async def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.AsyncNetworkStream:
        await self._flush(timeout)
        tls = await self._inner.start_tls(ssl_context, server_hostname, timeout)
        return _CoalescingStream(tls)

    def get_extra_info(self, info: str) -> typing.Any:
        if info == "is_readable" and self._socket is not None:
            return readable(self._socket)
        return self._inner.get_extra_info(info)


class _HasFileno(typing.Protocol):
    def fileno(self) -> int: ...


def readable(sock: _HasFileno) -> bool:
    """Whether a read on ``sock`` would return at once (data, or the end of a closed
    connection); a socket that is no longer open counts as readable, as in httpcore."""
    fd = sock.fileno()
    if fd < 0:
        return True
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


class CoalescingBackend(httpcore.AsyncNetworkBackend):
    """``inner``'s connections, each a :class:`_CoalescingStream`."""

    def __init__(self, inner: httpcore.AsyncNetworkBackend) -> None:
        self._inner = inner

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: typing.Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        stream = await self._inner.connect_tcp(
            host, port, timeout=timeout, local_address=local_address, socket_options=socket_options
        )
        return _CoalescingStream(stream)

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: typing.Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        stream = await self._inner.connect_unix_socket(
            path, timeout=timeout, socket_options=socket_options
        )
        return _CoalescingStream(stream)

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


def install(transport: typing.Any) -> bool:
    """Make ``transport`` (an ``httpx.AsyncHTTPTransport``) send each request in one write.
    httpx has no public way to give its pool a network backend: this sets httpcore's pool's
    (httpx 0.28, httpcore 1.0) and returns False, changing nothing, if that attribute moved
    (tests/proxy/test_coalesce.py fails then)."""
    pool = getattr(transport, "_pool", None)
    backend = getattr(pool, "_network_backend", None)
    if not isinstance(backend, httpcore.AsyncNetworkBackend):
        return False
    if not isinstance(backend, CoalescingBackend):
        pool._network_backend = CoalescingBackend(backend)  # type: ignore[union-attr]
    return True
