"""The coordinator's lean GET: the ordinary cases, keep-alive, and the same refusals as httpx.

Hostile servers (slow-loris, 100 MB bodies, gzip bombs, redirect loops, header floods) are in
``test_hostile_servers.py``, which runs every case against both scrape paths.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from fleetgate.coordinator.scrape.httpget import LeanHttp

from ..._certs import make_certs
from ._metrics_server import VLLM_TEXT


@pytest.mark.parametrize(
    ("path", "needle", "status"),
    [
        ("/missing", "HTTP 404", 404),
        ("/redirect", "HTTP 302 redirect to '/metrics' refused", 302),
        ("/other", "HTTP 500", 500),
        ("/big", "body of 100000 bytes exceeds the 65536-byte cap", 200),
        ("/endless", "cap; aborted", 200),
        ("/latin1", "UTF-8", 200),
    ],
)
async def test_failures_match_the_httpx_path(
    server_url: str, path: str, needle: str, status: int
) -> None:
    http = LeanHttp()
    result = await http.get(server_url + path, timeout=3.0, max_bytes=64 * 1024)
    await http.aclose()
    assert not result.ok and result.text is None and result.status == status
    assert result.error is not None and needle in result.error


async def test_trickle_times_out(server_url: str) -> None:
    http = LeanHttp()
    result = await http.get(f"{server_url}/trickle", timeout=0.5, max_bytes=1 << 20)
    assert not result.ok and result.error == "timed out after 0.5 s" and result.elapsed < 1.5


async def test_refused_connection_and_bad_urls() -> None:
    http = LeanHttp()
    refused = await http.get("http://127.0.0.1:1/metrics", timeout=2, max_bytes=1024)
    assert not refused.ok and refused.error and "Error" in refused.error
    bad = await http.get("ftp://host/metrics", timeout=2, max_bytes=1024)
    assert not bad.ok and bad.error is not None and bad.error.startswith("InvalidURL")


class _Raw:
    """An asyncio HTTP/1.1 server whose responses the test scripts, counting connections."""

    def __init__(self) -> None:
        self.connections = 0
        self.requests: list[bytes] = []
        self.responses: list[bytes] = []
        self.close_after = False
        self.url = ""
        self.handlers: set[asyncio.Task[None]] = set()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.handlers.add(asyncio.current_task())  # type: ignore[arg-type]
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.requests.append(head)
                response = self.responses.pop(0)
                if not response:  # hang up on this request without an answer
                    break
                writer.write(response)
                await writer.drain()
                if self.close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()  # TLS: the close_notify exchange needs loop turns

    async def shut(self, server: asyncio.Server) -> None:
        """Close ``server`` and wait for its connections to close (Python 3.11's
        ``wait_closed`` does not): a socket still closing when the test's loop closes leaks."""
        server.close()
        await server.wait_closed()
        if self.handlers:
            await asyncio.wait(self.handlers, timeout=5)


@pytest.fixture
async def raw() -> AsyncIterator[_Raw]:
    state = _Raw()
    server = await asyncio.start_server(state.handle, "127.0.0.1", 0)
    state.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield state
    finally:
        await state.shut(server)


def _ok(body: bytes, extra: str = "") -> bytes:
    return f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


async def test_keep_alive_reuses_one_connection(raw: _Raw) -> None:
    raw.responses = [_ok(VLLM_TEXT.encode()) for _ in range(3)]
    http = LeanHttp()
    for _ in range(3):
        result = await http.get(f"{raw.url}/metrics", timeout=2, max_bytes=1 << 20)
        assert result.ok and result.text == VLLM_TEXT and result.status == 200
    await http.aclose()
    assert raw.connections == 1
    first = raw.requests[0].decode()
    assert first.startswith("GET /metrics HTTP/1.1\r\n")
    assert f"Host: {raw.url.removeprefix('http://')}\r\n" in first
    assert "Accept-Encoding: identity\r\n" in first


async def test_chunked_and_close_delimited_bodies(raw: _Raw) -> None:
    raw.responses = [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: y\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end",
    ]
    raw.close_after = False
    http = LeanHttp()
    chunked = await http.get(f"{raw.url}/a", timeout=2, max_bytes=1024)
    assert chunked.ok and chunked.text == "hello world"
    raw.close_after = True
    closed = await http.get(f"{raw.url}/b", timeout=2, max_bytes=1024)
    assert closed.ok and closed.text == "until the end"
    await http.aclose()


async def test_idle_connection_closed_by_the_server_is_replaced(raw: _Raw) -> None:
    raw.responses = [_ok(b"one"), _ok(b"two")]
    raw.close_after = True  # the server hangs up after each response, keep-alive or not
    http = LeanHttp()
    assert (await http.get(f"{raw.url}/m", timeout=2, max_bytes=1024)).text == "one"
    await asyncio.sleep(0.05)
    second = await http.get(f"{raw.url}/m", timeout=2, max_bytes=1024)
    await http.aclose()
    assert second.ok and second.text == "two" and raw.connections == 2


async def test_reused_connection_dropped_at_the_request_is_retried_once(raw: _Raw) -> None:
    raw.responses = [_ok(b"one"), b"", _ok(b"two"), b"", b""]
    http = LeanHttp()
    assert (await http.get(f"{raw.url}/m", timeout=2, max_bytes=1024)).text == "one"
    second = await http.get(f"{raw.url}/m", timeout=2, max_bytes=1024)
    assert second.ok and second.text == "two" and raw.connections == 2
    # A fresh connection that is dropped is an error, not a retry.
    third = await http.get(f"{raw.url}/m", timeout=2, max_bytes=1024)
    await http.aclose()
    assert not third.ok and third.error is not None and "IncompleteReadError" in third.error


@pytest.mark.parametrize(
    ("response", "needle"),
    [
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", "Transfer-Encoding 'gzip'"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", "bad Content-Length"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "bad chunk size"),
        (b"SPDY/9 200 OK\r\n\r\n", "malformed status line"),
        (b"HTTP/1.1 200 OK\r\n no-name\r\n\r\n", "malformed header line"),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"".join(b"400\r\n" + b"a" * 1024 + b"\r\n" for _ in range(3)),
            "cap; aborted",
        ),
    ],
)
async def test_protocol_errors_are_failures(raw: _Raw, response: bytes, needle: str) -> None:
    raw.responses = [response]
    http = LeanHttp()
    result = await http.get(f"{raw.url}/m", timeout=2, max_bytes=2048)
    await http.aclose()
    assert not result.ok and result.error is not None and needle in result.error


async def test_https_verifies_the_server(tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is needed to make test certificates")
    certs = make_certs(tmp_path)
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    served.load_cert_chain(certs.server_crt, certs.server_key)
    state = _Raw()
    state.responses = [_ok(b"tls ok")]
    server = await asyncio.start_server(state.handle, "127.0.0.1", 0, ssl=served)
    url = f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}/metrics"
    try:
        trusted = LeanHttp(ssl.create_default_context(cafile=str(certs.ca)))
        ok = await trusted.get(url, timeout=5, max_bytes=1024)
        await trusted.aclose()
        stranger = LeanHttp(ssl.create_default_context(cafile=str(certs.other_ca)))
        refused = await stranger.get(url, timeout=5, max_bytes=1024)
        await stranger.aclose()
    finally:
        await state.shut(server)
    assert ok.ok and ok.text == "tls ok"
    assert (
        not refused.ok
        and refused.error is not None
        and "CERTIFICATE_VERIFY_FAILED" in refused.error
    )


def test_a_url_that_is_no_ascii_is_sent_encoded() -> None:
    """A non-ASCII path and query are percent-encoded and a non-ASCII host IDNA-encoded, as
    httpx sends them; the request line is ASCII (it raised UnicodeEncodeError, failing the poll
    of every gate)."""
    from fleetgate.coordinator.scrape.httpget import _request

    origin, request = _request("http://bücher.example:8000/métrics?a=é")
    assert origin == ("http", "xn--bcher-kva.example", 8000)
    assert request.startswith(b"GET /m%C3%A9trics?a=%C3%A9 HTTP/1.1\r\n")
    assert b"\r\nHost: xn--bcher-kva.example:8000\r\n" in request
