"""``fleetgate proxy`` on HTTP edge cases: a pipelined caller that leaves, upstream answers
uvicorn cannot send or that carry a stale ``Content-Length``, bodiless answers declaring a large
length, request trailers, ``X-Forwarded-For`` from a loopback caller, and an upstream cut
mid-body."""

from __future__ import annotations

import json
import logging
import socket
import time

import httpx
import pytest

from fleetgate.tools.sim._server import Served

from ..conftest import RedisUnderTest
from ._proxy import (
    counting_upstream,
    gate_counts,
    serve_proxy,
    upstream_log,
    wait_idle,
    wait_until,
)
from ._wire import send_raw, status_of


def test_a_pipelined_caller_that_leaves_frees_its_permit(
    rut: RedisUnderTest, upstream: Served, parser: str
) -> None:
    """A caller that sends two requests in one write and closes frees both permits: uvicorn
    (httptools) marks only the newest request as disconnected, so the first would keep its
    permit (and its upstream call) until the upstream answered -- here never."""
    with serve_proxy(rut, upstream.url) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(b"GET /hang HTTP/1.1\r\nHost: x\r\n\r\nGET /work HTTP/1.1\r\nHost: x\r\n\r\n")
            wait_until(
                lambda: upstream_log(upstream).running == 1, 5, "the first call at the upstream"
            )
            assert gate_counts(rut.url, rut.prefix, "g")[0] == 1
        t0 = time.monotonic()
        wait_idle(rut.url, rut.prefix, "g", timeout=5)
        assert time.monotonic() - t0 < 2.0
        wait_until(lambda: upstream_log(upstream).cancelled == 1, 5, "the upstream call cancelled")
        assert upstream_log(upstream).arrivals == []  # the second request never went upstream


def _odd(head: bytes) -> tuple[bytes, bool]:
    path = head.split(b" ", 2)[1]
    if path == b"/status-600":  # h11 reads 100-999; uvicorn can send 100-599 only
        return b"HTTP/1.1 600 Custom\r\ncontent-length: 2\r\n\r\n{}", False
    if path == b"/304":  # RFC 9110 8.6: a 304 may say the representation's length
        return b'HTTP/1.1 304 Not Modified\r\ncontent-length: 1234\r\netag: "v1"\r\n\r\n', False
    if path == b"/204":
        return b"HTTP/1.1 204 No Content\r\ncontent-length: 99\r\n\r\n", False
    if path == b"/head-big":  # the answer to HEAD: the length of a GET's body, no body
        return b"HTTP/1.1 200 OK\r\ncontent-length: 4194304\r\n\r\n", False
    if path == b"/cut":  # promises 10 bytes, sends 3 and closes
        return b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc", True
    if path == b"/te-and-cl":  # RFC 9112 6.3: chunked wins; a proxy must drop the length
        return (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 3\r\n\r\n"
            b"5\r\nhello\r\n0\r\n\r\n",
            False,
        )
    return b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}", False


def test_odd_upstream_answers(rut: RedisUnderTest, parser: str) -> None:
    with (
        counting_upstream(_odd) as (up, _),
        serve_proxy(rut, up, proxy={"max_response_bytes": 1024 * 1024}) as url,
        httpx.Client(base_url=url, timeout=10) as http,
    ):
        for _ in range(2):  # and the connection to the caller stays usable after each
            r = http.get("/status-600")
            assert r.status_code == 502 and r.json()["error"]["type"] == "upstream_error"
            r = http.get("/304")
            assert r.status_code == 304 and r.content == b"" and r.headers["etag"] == '"v1"'
            r = http.get("/204")
            assert r.status_code == 204 and r.content == b""
            r = http.head("/head-big")  # above max_response_bytes, but no body follows
            assert r.status_code == 200 and r.headers["content-length"] == "4194304"
            r = http.get("/te-and-cl")
            assert r.status_code == 200 and r.content == b"hello"
            assert "content-length" not in r.headers
            assert http.get("/x").content == b"{}"
    wait_idle(rut.url, rut.prefix, "g")


def test_request_trailers_are_not_forwarded_as_headers(
    rut: RedisUnderTest, upstream: Served, parser: str
) -> None:
    """RFC 9110 6.5.1: trailer fields are not merged into the header section (httptools
    appends them to the request's headers; the proxy does not forward them)."""
    with serve_proxy(rut, upstream.url) as url:
        answer = send_raw(
            url,
            b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5\r\nhello\r\n0\r\nX-Trailer: yes\r\nAuthorization: Bearer from-trailer\r\n\r\n",
        )
        assert status_of(answer) == 200, answer[:300]
        seen = json.loads(answer.partition(b"\r\n\r\n")[2])
        assert seen["body"] == "hello"
        assert "x-trailer" not in seen["headers"] and "authorization" not in seen["headers"]
    wait_idle(rut.url, rut.prefix, "g")


def test_a_loopback_caller_cannot_forge_its_address(
    rut: RedisUnderTest, upstream: Served, parser: str
) -> None:
    """uvicorn trusts X-Forwarded-For/-Proto from loopback by default: a caller there could
    set the address the proxy logs and appends. The proxy sends the peer it sees (a chain only
    from a trusted proxy: ``test_request_checks.py``)."""
    with serve_proxy(rut, upstream.url) as url, httpx.Client(base_url=url, timeout=10) as http:
        r = http.get("/echo", headers={"x-forwarded-for": "6.6.6.6", "x-forwarded-proto": "https"})
        headers = r.json()["headers"]
        assert headers["x-forwarded-for"] == "127.0.0.1", headers
        assert "x-forwarded-proto" not in headers
    wait_idle(rut.url, rut.prefix, "g")


def test_an_upstream_cut_mid_body_is_logged_once_as_such(
    rut: RedisUnderTest, parser: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The caller gets a truncated body (its client sees the error); the access log says why,
    and uvicorn's ERROR about a response not completed (the proxy cut it on purpose) is not
    logged."""
    caplog.set_level(logging.INFO)
    with counting_upstream(_odd) as (up, _), serve_proxy(rut, up) as url:
        with httpx.Client(base_url=url, timeout=10) as http, pytest.raises(httpx.HTTPError):
            http.get("/cut")
        wait_idle(rut.url, rut.prefix, "g")
    uvicorn_errors = [r for r in caplog.records if r.name.startswith("uvicorn")]
    assert not [r for r in uvicorn_errors if r.levelno >= logging.ERROR], uvicorn_errors
    access = [r.getMessage() for r in caplog.records if r.name == "fleetgate.proxy.access"]
    assert any("/cut" in line for line in access), access
