"""What ``fleetgate proxy`` forwards, and how (real Redis, real HTTP on loopback): what one
caller sends never reaches another host or another caller, framing the proxy cannot forward
faithfully is refused, every framing an upstream may use passes through, upstream connections
are kept alive, a streaming route streams the body on, an Upgrade is forwarded as plain HTTP,
and no log line carries a query string."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterator

import httpx
import pytest

from fleetgate.proxy import serve_in_thread
from fleetgate.tools.sim._server import Served
from fleetgate.tools.sim._server import serve_in_thread as serve_app

from ..conftest import RedisUnderTest
from ._proxy import (
    counting_upstream,
    proxy_config,
    serve_proxy,
    upstream_app,
    upstream_log,
    wait_idle,
)
from ._wire import send_raw, status_of


@pytest.fixture
def elsewhere() -> Iterator[Served]:
    """Another server on loopback: one the proxy must never be made to call."""
    with serve_app(upstream_app()) as served:
        yield served


def test_a_request_target_not_starting_with_a_slash_is_refused(
    rut: RedisUnderTest, upstream: Served, elsewhere: Served
) -> None:
    """``GET @host:port/x`` would make the upstream URL ``http://up:port@host:port/x``: a host
    of the caller's choosing (the upstream's address as its user name). Refused, with ``*``
    and a path without its slash."""
    hostport = elsewhere.url.removeprefix("http://")
    with serve_proxy(rut, upstream) as url:
        for target in (f"@{hostport}/echo", "*", "echo"):
            data = f"GET {target} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
            answer = send_raw(url, data)
            assert status_of(answer) == 400, (target, answer[:300])
        # absolute-form: refused, or (an HTTP parser that takes its path) the upstream's path
        send_raw(url, f"GET http://{hostport}/echo HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    assert upstream_log(elsewhere).headers == []
    wait_idle(rut.url, rut.prefix, "g")


def test_content_length_with_transfer_encoding_is_refused(
    rut: RedisUnderTest, upstream: Served
) -> None:
    """RFC 9112 6.3: both framings at once is the request-smuggling shape; the proxy would
    forward the caller's Content-Length beside a body of another length."""
    with serve_proxy(rut, upstream) as url:
        data = (
            b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
        )
        answer = send_raw(url, data)
        assert status_of(answer) == 400, answer[:300]  # the proxy's (h11) or httptools' own
    assert upstream_log(upstream).headers == []
    wait_idle(rut.url, rut.prefix, "g")


def test_cookies_of_one_caller_never_reach_another(rut: RedisUnderTest, upstream: Served) -> None:
    """The upstream's Set-Cookie goes to the caller that got it; the proxy keeps no cookie jar
    (with one, as httpx's client keeps, alice's session would go upstream with bob's next
    request)."""
    with serve_proxy(rut, upstream) as url:
        with httpx.Client(base_url=url, timeout=10) as alice:
            r = alice.get("/cookie?v=alice")
            assert r.headers["set-cookie"].startswith("session=alice")
        with httpx.Client(base_url=url, timeout=10) as bob:
            seen = [bob.post("/echo", content=b"hi").json()["headers"] for _ in range(10)]
    assert all("cookie" not in headers for headers in seen), seen
    wait_idle(rut.url, rut.prefix, "g")


def test_no_log_line_has_the_query_string(
    rut: RedisUnderTest, upstream: Served, caplog: pytest.LogCaptureFixture
) -> None:
    """``fleetgate proxy`` logs at INFO: its lines name the path, never the query string
    (``?api_key=...``), which httpx's own INFO line of every upstream URL would carry."""
    caplog.set_level(logging.DEBUG)
    with serve_proxy(rut, upstream) as url, httpx.Client(base_url=url, timeout=10) as http:
        assert http.post("/echo?api_key=sk-secret-in-query", content=b"x").status_code == 200
    # the proxy's own records (the test's client logs its URLs on this thread)
    text = "\n".join(r.getMessage() for r in caplog.records if r.threadName == "fleetgate-proxy")
    assert "/echo" in text and "sk-secret-in-query" not in text
    wait_idle(rut.url, rut.prefix, "g")


def test_a_sampled_access_log_keeps_every_failure(
    rut: RedisUnderTest, upstream: Served, caplog: pytest.LogCaptureFixture
) -> None:
    """With ``access_log_sample = 3``: one line for the first of every 3 exchanges answered
    below 400, and a line for every exchange answered 400 or above."""
    caplog.set_level(logging.INFO)
    proxy = {"access_log_sample": 3}
    with serve_proxy(rut, upstream, proxy=proxy) as url, httpx.Client(base_url=url) as http:
        for i in range(7):
            assert http.post("/echo", content=f"ok {i}".encode()).status_code == 200
        for _ in range(2):
            assert http.get("/status/503").status_code == 503
    lines = [r.getMessage() for r in caplog.records if r.name == "fleetgate.proxy.access"]
    assert len([line for line in lines if " 200 " in line]) == 3, lines  # exchanges 1, 4, 7
    assert len([line for line in lines if " 503 " in line]) == 2, lines
    wait_idle(rut.url, rut.prefix, "g")


def test_one_date_header(rut: RedisUnderTest, upstream: Served) -> None:
    """The upstream's Date passes through, and no second one is added (uvicorn adds one to
    every response by default)."""
    with serve_proxy(rut, upstream) as url:
        answer = send_raw(url, b"GET /work HTTP/1.1\r\nHost: x\r\n\r\n")
        head = answer.partition(b"\r\n\r\n")[0].lower()
        assert status_of(answer) == 200 and head.count(b"\r\ndate:") == 1, head
        answer = send_raw(url, b"GET /nowhere/.. HTTP/1.1\r\nHost: x\r\n\r\n")  # the proxy's own
        head = answer.partition(b"\r\n\r\n")[0].lower()
        assert status_of(answer) == 400 and head.count(b"\r\ndate:") == 1, head
    wait_idle(rut.url, rut.prefix, "g")


def test_upstream_connections_are_reused(rut: RedisUnderTest) -> None:
    """40 calls, one upstream connection: the handler lets its reader return the connection to
    the pool once the body is forwarded (cancelling the reader then would open a new connection
    per request, and the call's outcome would never be reported)."""
    with counting_upstream() as (up, counts):
        config = proxy_config(rut.url, rut.prefix, up)
        with serve_in_thread(config) as url, httpx.Client(base_url=url, timeout=10) as http:
            for _ in range(40):
                assert http.post("/x", content=b"{}").status_code == 200
    assert counts == [1, 40], counts  # one connection, kept alive
    wait_idle(rut.url, rut.prefix, "g")


def _scripted(head: bytes) -> tuple[bytes, bool]:
    """Answers by path: the framings an upstream may use, and two it must not."""
    path = head.split(b" ", 2)[1]
    if path == b"/chunked":
        return (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
            False,
        )
    if path == b"/until-close":  # no length: the body ends with the connection
        return b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it", True
    if path == b"/head":
        return b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n", False
    if path == b"/continue":
        return b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok", False
    if path == b"/extra":  # a second, unasked-for answer behind the first
        return b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}" + (
            b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\nforged"
        ), False
    if path == b"/garbage":
        return b"NOT HTTP AT ALL\r\n\r\n", True
    return b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}", False


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_upstream_framings_pass_through_and_bad_ones_get_502(
    rut: RedisUnderTest, loop: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every framing an upstream may use passes through; garbage is a 502; bytes the upstream
    sent past an answer never answer anyone (httpcore would pool that connection: the proxy
    closes it), on asyncio's loop and on uvloop (the fast extra's)."""
    if loop == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        monkeypatch.setattr(asyncio, "new_event_loop", uvloop.new_event_loop)
    with counting_upstream(_scripted) as (up, counts):
        config = proxy_config(rut.url, rut.prefix, up)
        with serve_in_thread(config) as url, httpx.Client(base_url=url, timeout=10) as http:
            for _ in range(3):
                assert http.get("/chunked").content == b"hello"
                assert http.get("/until-close").content == b"all of it"
                r = http.head("/head")
                assert r.status_code == 200 and r.headers["content-length"] == "5"
                assert http.get("/continue").content == b"ok"
                assert http.get("/extra").content == b"{}"
                # the forged answer never reaches anyone: the connection was not reused
                assert [http.get("/x").content for _ in range(3)] == [b"{}"] * 3
                r = http.get("/garbage")
                assert r.status_code == 502 and r.json()["error"]["type"] == "upstream_error"
            assert http.get("/x").content == b"{}"
    assert counts[1] == 3 * 9 + 1
    wait_idle(rut.url, rut.prefix, "g")


def test_a_body_still_arriving_is_streamed_upstream_on_a_streaming_route(
    rut: RedisUnderTest, upstream: Served
) -> None:
    """A route with ``stream_uploads`` takes the permit first and streams the body on as it
    arrives (by default the body is read whole first: ``test_request_bodies.py``)."""

    def chunks() -> Iterator[bytes]:
        for i in range(50):
            time.sleep(0.002)
            yield f"{i:04d}".encode()

    with (
        serve_proxy(rut, upstream, stream_uploads=True) as url,
        httpx.Client(base_url=url, timeout=10) as http,
    ):
        seen = http.post("/echo", content=chunks()).json()
        assert seen["body"] == "".join(f"{i:04d}" for i in range(50))
        assert seen["headers"].get("transfer-encoding") == "chunked"
    wait_idle(rut.url, rut.prefix, "g")


def test_the_metrics_path_is_never_forwarded(rut: RedisUnderTest, upstream: Served) -> None:
    with serve_proxy(rut, upstream) as url, httpx.Client(base_url=url, timeout=10) as http:
        r = http.post("/metrics", content=b"x")
        assert r.status_code == 405 and r.headers["allow"] == "GET, HEAD"
        assert http.get("/metrics").status_code == 200
    assert upstream_log(upstream).headers == []
    wait_idle(rut.url, rut.prefix, "g")


@pytest.mark.parametrize("parser", ["httptools", "h11"])
def test_an_upgrade_request_is_forwarded_as_plain_http_body_and_all(
    rut: RedisUnderTest, upstream: Served, parser: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``curl --http2 http://...`` asks to upgrade to h2c, body included. The proxy upgrades
    nothing (RFC 9110 7.8: a server may ignore Upgrade): it forwards a plain request without the
    Upgrade headers. httptools takes everything after such a head for the new protocol: the
    body must not be dropped (the upstream getting Content-Length: 0)."""
    if parser == "h11":
        monkeypatch.setattr("fleetgate.proxy.server._http_protocol", lambda: "h11")
    with serve_proxy(rut, upstream) as url:
        for _ in range(2):
            answer = send_raw(
                url,
                b"POST /echo?x=1 HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
                b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\nContent-Length: 5\r\n"
                b"\r\nhello",
            )
            assert status_of(answer) == 200, answer[:300]
            seen = json.loads(answer.partition(b"\r\n\r\n")[2])
            assert seen["body"] == "hello" and seen["query"] == "x=1"
            assert "upgrade" not in seen["headers"] and "http2-settings" not in seen["headers"]
        answer = send_raw(
            url,
            b"GET /echo HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
        )
        assert status_of(answer) == 200, answer[:300]
    wait_idle(rut.url, rut.prefix, "g")
