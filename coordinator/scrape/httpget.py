"""A lean HTTP/1.1 GET for the coordinator's scrapes, with the guarantees of the httpx path.

Why not httpx here: a scrape through httpx costs ~1.4 ms of CPU on the reference 2-core machine
(request/response models, httpcore's pool, anyio cancel scopes, h11), this GET ~0.1 ms; one
coordinator scrapes a thousand endpoints per poll (figures in ``docs/servers.md``). httpx stays
the project's HTTP client everywhere else, and :func:`~.signals.scrape` (httpx) remains
available; ``Coordinator(http="httpx")`` selects it.

What it does, and refuses, exactly like :func:`~.signals.scrape`:

* one ``GET`` with ``Accept: text/plain;version=0.0.4`` and ``Accept-Encoding: identity``;
* the whole exchange under one total timeout (a server trickling its headers or body byte by
  byte cannot hold the poll);
* status 200 only; a 3xx is a failure naming its Location, never followed;
* a ``Content-Encoding`` other than identity is refused before any body is read (no gzip bomb);
* the body is read raw (Content-Length, chunked, or until close) and the connection is dropped
  as soon as it passes ``max_bytes``; response headers are capped (64 KiB) so a header flood
  fails at once; memory stays bounded whatever the server sends;
* errors come back as a failed :class:`~.signals.ScrapeResult`; only cancellation propagates.

One kept-alive connection per origin (a gate's replicas are distinct origins), reused while the
server keeps it open; a connection the server closed while idle is replaced once, silently.
Proxy environment variables are not honoured (scrapes go to the model servers directly).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ssl
import time

import httpx

from fleetgate._aio import within

from .signals import ScrapeResult, redact

__all__ = ["MAX_HEADER_BYTES", "LeanHttp"]

MAX_HEADER_BYTES = 64 * 1024
_READ = 64 * 1024


#: (scheme, host, port): one kept-alive connection each
_Origin = tuple[str, str, int]


class _Refused(Exception):
    """The response is refused (status, encoding, size): the message is the scrape's error."""

    def __init__(self, error: str, status: int | None = None) -> None:
        super().__init__(error)
        self.status = status


class _Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    def abort(self) -> None:
        """Drop the connection now (RST); the socket closes on the loop's next turn."""
        self.writer.transport.abort()

    async def drop(self) -> None:
        """Drop the connection and wait until the socket is closed, so a server pushing an
        oversized body learns at once that nobody reads it."""
        self.abort()
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()


class LeanHttp:
    """Kept-alive HTTP/1.1 connections of one gate; ``get`` one URL at a time per origin."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self._tls = tls
        self._idle: dict[_Origin, _Conn] = {}

    async def aclose(self) -> None:
        """Close the idle connections."""
        conns, self._idle = list(self._idle.values()), {}
        await asyncio.gather(*(conn.drop() for conn in conns))

    async def get(self, url: str, *, timeout: float, max_bytes: int) -> ScrapeResult:
        """GET ``url`` within ``timeout`` seconds in total, reading at most ``max_bytes``."""
        start = time.monotonic()
        try:
            result = await within(self._get(url, max_bytes), timeout)
        except TimeoutError:
            result = ScrapeResult(url, False, error=f"timed out after {timeout:g} s")
        return ScrapeResult(
            url, result.ok, result.text, result.error, result.status, time.monotonic() - start
        )

    async def _get(self, url: str, max_bytes: int) -> ScrapeResult:
        """The GET, every failure but cancellation a failed result."""
        try:
            origin, request = _request(url)
        except _Refused as exc:
            return ScrapeResult(url, False, error=str(exc))
        try:
            status, body = await self._fetch(origin, request, max_bytes)
        except _Refused as exc:
            return ScrapeResult(url, False, error=str(exc), status=exc.status)
        except asyncio.LimitOverrunError:
            error = f"response headers exceed {MAX_HEADER_BYTES} bytes"
            return ScrapeResult(url, False, error=error)
        except (OSError, EOFError, ValueError, ssl.SSLError) as exc:
            return ScrapeResult(url, False, error=f"{type(exc).__name__}: {exc}".rstrip(": "))
        try:
            return ScrapeResult(url, True, text=body.decode("utf-8"), status=status)
        except UnicodeDecodeError as exc:
            return ScrapeResult(url, False, error=f"body is not UTF-8: {exc}", status=status)

    async def _fetch(self, origin: _Origin, request: bytes, max_bytes: int) -> tuple[int, bytes]:
        """Status and body of one exchange with ``origin``: over its idle connection (once more
        on a fresh one if the server had closed it), else a fresh one. The connection is kept
        for the next GET when the response allows, and dropped on any failure."""
        reused = self._idle.pop(origin, None)
        if reused is not None and (reused.reader.at_eof() or reused.writer.transport.is_closing()):
            reused.abort()  # closed by the server while idle (the usual keep-alive timeout)
            reused = None
        conn = reused
        try:
            if conn is None:
                conn = await self._connect(origin)
            try:
                status, body, keep = await self._exchange(conn, request, max_bytes)
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                partial = isinstance(exc, asyncio.IncompleteReadError) and exc.partial
                if reused is None or partial:
                    raise
                # The server closed the idle connection: one fresh attempt (GET is idempotent).
                conn.abort()
                conn = await self._connect(origin)
                status, body, keep = await self._exchange(conn, request, max_bytes)
        except (_Refused, asyncio.LimitOverrunError, OSError, EOFError, ValueError, ssl.SSLError):
            if conn is not None:
                await conn.drop()
            raise
        except BaseException:  # cancelled or timed out mid-exchange: never reuse the connection
            if conn is not None:
                conn.abort()
            raise
        if keep and origin not in self._idle:
            self._idle[origin] = conn
        else:
            conn.abort()
        return status, body

    async def _connect(self, origin: _Origin) -> _Conn:
        scheme, host, port = origin
        tls = None
        if scheme == "https":
            tls = self._tls or ssl.create_default_context()
        reader, writer = await asyncio.open_connection(
            host,
            port,
            ssl=tls,
            server_hostname=host if tls is not None else None,
            limit=MAX_HEADER_BYTES,
        )
        return _Conn(reader, writer)

    async def _exchange(
        self, conn: _Conn, request: bytes, max_bytes: int
    ) -> tuple[int, bytes, bool]:
        """Send ``request``; return status, body and whether the connection can be reused."""
        conn.writer.write(request)
        await conn.writer.drain()
        head = await conn.reader.readuntil(b"\r\n\r\n")
        lines = head[:-4].split(b"\r\n")
        version, _, rest = lines[0].partition(b" ")
        code = rest[:3]
        if version not in (b"HTTP/1.1", b"HTTP/1.0") or not code.isdigit():
            raise _Refused(f"RemoteProtocolError: malformed status line {lines[0][:80]!r}")
        status = int(code)
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep or not name or name != name.strip() or name[:1] in (b" ", b"\t"):
                raise _Refused(f"RemoteProtocolError: malformed header line {line[:80]!r}")
            key = name.decode("latin-1").lower()
            text = value.strip().decode("latin-1")
            headers[key] = f"{headers[key]}, {text}" if key in headers else text
        if 300 <= status < 400:
            where = redact(headers.get("location", "?"))
            raise _Refused(f"HTTP {status} redirect to {where!r} refused", status)
        if status != 200:
            raise _Refused(f"HTTP {status}", status)
        encoding = headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise _Refused(f"compressed body (Content-Encoding: {encoding[:20]}) refused", status)
        transfer = headers.get("transfer-encoding", "").strip().lower()
        keep = version == b"HTTP/1.1" and "close" not in headers.get("connection", "").lower()
        if transfer:
            if transfer != "chunked":
                raise _Refused(f"Transfer-Encoding {transfer[:20]!r} refused", status)
            return status, await _read_chunked(conn.reader, max_bytes, status), keep
        declared = headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise _Refused(f"RemoteProtocolError: bad Content-Length {declared[:20]!r}")
            size = int(declared)
            if size > max_bytes:
                raise _Refused(f"body of {size} bytes exceeds the {max_bytes}-byte cap", status)
            return status, await conn.reader.readexactly(size), keep
        # Neither length nor chunks: the body runs until the server closes.
        body = bytearray()
        while chunk := await conn.reader.read(_READ):
            body += chunk
            if len(body) > max_bytes:
                raise _Refused(f"body exceeds the {max_bytes}-byte cap; aborted", status)
        return status, bytes(body), False


@functools.lru_cache(maxsize=4096)  # a gate's URLs are the same every poll
def _request(url: str) -> tuple[_Origin, bytes]:
    """The origin of ``url`` and the GET request for it; :class:`_Refused` if it is no
    ``http(s)`` URL with a host."""
    try:
        # httpx's URL model percent-encodes a non-ASCII path and query and IDNA-encodes the
        # host, as httpx itself would send them: the request line is ASCII whatever the config
        parts = httpx.URL(url)
        scheme, host = parts.scheme, parts.raw_host.decode("ascii")
        port = parts.port or (443 if scheme == "https" else 80)
    except (httpx.InvalidURL, ValueError) as exc:
        raise _Refused(f"InvalidURL: {exc}") from None
    if scheme not in ("http", "https") or not host:
        raise _Refused(f"InvalidURL: cannot GET {redact(url)!r}")
    target = parts.raw_path.decode("ascii")
    shown_host = f"[{host}]" if ":" in host else host
    default = port == (443 if scheme == "https" else 80)
    request = (
        f"GET {target} HTTP/1.1\r\n"
        f"Host: {shown_host if default else f'{shown_host}:{port}'}\r\n"
        "Accept: text/plain;version=0.0.4\r\n"
        "Accept-Encoding: identity\r\n"
        "User-Agent: fleetgate-coordinator\r\n"
        "\r\n"
    ).encode("ascii", "strict")
    return (scheme, host, port), request


async def _read_chunked(reader: asyncio.StreamReader, max_bytes: int, status: int) -> bytes:
    body = bytearray()
    while True:
        line = await reader.readuntil(b"\r\n")
        size_text = line[:-2].split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise _Refused(f"RemoteProtocolError: bad chunk size {size_text[:20]!r}") from None
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, then the blank line
                pass
            return bytes(body)
        if len(body) + size > max_bytes:
            raise _Refused(f"body exceeds the {max_bytes}-byte cap; aborted", status)
        body += await reader.readexactly(size)
        if await reader.readexactly(2) != b"\r\n":
            raise _Refused("RemoteProtocolError: chunk not followed by CRLF")
