"""``fleetgate proxy`` and request bodies, over raw sockets and both request parsers: a permit
means the upstream is working, so a request joins the gate's queue only once its body is
complete; the bytes buffered across connections are bounded; a route may opt into streaming
uploads (permit first, body streamed)."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from fleetgate.errors import ConfigError
from fleetgate.proxy.config import ProxySettings
from fleetgate.tools.sim._server import Served

from ..conftest import RedisUnderTest
from ._proxy import gate_counts, proxy_config, serve_proxy, upstream_log, wait_idle, wait_until
from ._wire import connect, status_of, until_closed

pytestmark = pytest.mark.usefixtures("parser")  # every test on both request parsers (conftest)

ONE = {"floor": 1}  # the gate's limit: one permit fleet-wide


def _head(length: int, deadline_ms: int = 30_000) -> bytes:
    return (
        b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nX-Fleetgate-Deadline-Ms: %d\r\n\r\n" % (length, deadline_ms)
    )


@contextlib.contextmanager
def _trickler(
    url: str, body: bytes, deadline_ms: int = 30_000, first: int = 0
) -> Iterator[tuple[socket.socket, list[int]]]:
    """A caller that sends ``body``'s head and its ``first`` bytes at once, then one byte every
    0.5 s on a thread until the block ends or one byte is left (yields its socket and [bytes
    of the body sent]); the rest of the body is the block's to send."""
    s = connect(url)
    s.sendall(_head(len(body), deadline_ms) + body[:first])
    sent = [first]
    stop = threading.Event()

    def trickle() -> None:
        while not stop.wait(0.5) and sent[0] < len(body) - 1:
            s.sendall(body[sent[0] : sent[0] + 1])
            sent[0] += 1

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    try:
        yield s, sent
    finally:
        stop.set()
        thread.join(5)
        s.close()


def test_a_trickled_body_holds_no_permit(rut: RedisUnderTest, upstream: Served) -> None:
    """Limit 1; a caller sends its body a byte every 0.5 s. It holds no permit and no place in
    the queue while its body is incomplete, so a well-behaved request with a 6 s deadline is
    served at once; the trickler joins the queue once its body is complete, and is served too
    (holding the only permit, the trickler would give the upstream nothing complete, and the
    well-behaved request would get 504 after its 6 s)."""
    body = json.dumps({"input": "x" * 30}).encode()
    with serve_proxy(rut, upstream, gate_defaults=ONE) as url:
        with _trickler(url, body) as (slow, sent):
            time.sleep(1.2)  # a few bytes in
            while_trickling = gate_counts(rut.url, rut.prefix, "g")
            t0 = time.monotonic()
            with httpx.Client(base_url=url, timeout=20) as http:
                good = http.post(
                    "/echo", content=b'{"ok": 1}', headers={"x-fleetgate-deadline-ms": "6000"}
                )
            took = time.monotonic() - t0
            seen_before_the_end = len(upstream_log(upstream).headers)
            slow.sendall(body[sent[0] :])
            answer = _read_answer(slow)
        measured = (while_trickling, good.status_code, round(took, 2), good.text[:200])
        assert while_trickling == (0, 0), measured  # no permit, no place in the queue
        assert good.status_code == 200, measured
        assert took < 2.0, took
        assert seen_before_the_end == 1  # the upstream had only the well-behaved request
        assert status_of(answer) == 200, answer[:300]
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["body"] == body.decode()
    wait_idle(rut.url, rut.prefix, "g")


def _read_answer(s: socket.socket, within: float = 10.0) -> bytes:
    """One whole answer with a Content-Length from ``s``."""
    s.settimeout(within)
    out = b""
    while True:
        head, sep, rest = out.partition(b"\r\n\r\n")
        if sep:
            lengths = [
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            ]
            if lengths and len(rest) >= lengths[0]:
                return out
        chunk = s.recv(65536)
        if not chunk:
            return out
        out += chunk


def test_the_deadline_covers_the_body_read(rut: RedisUnderTest, upstream: Served) -> None:
    """The deadline counts from the request's arrival: a body still incomplete when it passes
    gets 504 (the connection closed: the rest is not read); the gate and the upstream never saw
    the request."""
    with serve_proxy(rut, upstream, gate_defaults=ONE) as url:
        with _trickler(url, b"x" * 40, deadline_ms=1000) as (slow, _):
            t0 = time.monotonic()
            answer, _ = until_closed(slow, 5)
            took = time.monotonic() - t0
            held = gate_counts(rut.url, rut.prefix, "g")
        assert status_of(answer) == 504, answer[:300]
        assert b"connection: close" in answer.lower()
        assert b"before the request body was complete" in answer
        assert 0.9 < took < 2.5, took
        assert held == (0, 0) and upstream_log(upstream).headers == []
    wait_idle(rut.url, rut.prefix, "g")


def _buffered(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    found = re.search(r"^fleetgate_proxy_buffered_body_bytes (\S+)$", text, re.M)
    assert found, text[-2000:]
    return float(found.group(1))


def test_bytes_buffered_across_connections_are_bounded(
    rut: RedisUnderTest, upstream: Served
) -> None:
    """``max_buffered_bytes`` bounds the request body bytes buffered across connections
    (``fleetgate_proxy_buffered_body_bytes``). A declared body that would pass it gets 503 at
    once, a chunked one the moment it would: ``Retry-After``, ``x-should-retry: false`` (an
    overload of this proxy), the connection closed, the gate untouched; a body that fits is
    served beside it."""
    proxy = {"max_request_bytes": 4096, "max_buffered_bytes": 4096}
    body = b"x" * 4000
    with serve_proxy(rut, upstream, gate_defaults=ONE, proxy=proxy) as url:
        with _trickler(url, body, first=3000) as (slow, sent):
            wait_until(lambda: _buffered(url) >= 3000, 5, "the trickler's 3000 bytes buffered")
            with connect(url) as s:  # declared: refused before a byte of it is read
                s.sendall(_head(2000))
                declared, _ = until_closed(s, 5)
            with connect(url) as s:  # chunked: refused as it passes the bound
                s.sendall(
                    b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                    + b"600\r\n"
                    + b"y" * 1536
                    + b"\r\n0\r\n\r\n"
                )
                chunked, _ = until_closed(s, 5)
            with httpx.Client(base_url=url, timeout=10) as http:
                small = http.post("/echo", content=b"z" * 90)
            assert gate_counts(rut.url, rut.prefix, "g") == (0, 0)
            slow.sendall(body[sent[0] :])
            answer = _read_answer(slow)
        for refused in (declared, chunked):
            assert status_of(refused) == 503, refused[:300]
            head = refused.partition(b"\r\n\r\n")[0].lower()
            assert b"retry-after: 1" in head and b"x-should-retry: false" in head, head
            assert b"connection: close" in head and b'"buffers_full"' in refused
        assert small.status_code == 200 and small.json()["body"] == "z" * 90
        assert status_of(answer) == 200, answer[:300]
        wait_until(lambda: _buffered(url) == 0, 5, "every buffered byte given back")
    wait_idle(rut.url, rut.prefix, "g")


def test_a_streaming_route_takes_the_permit_first(rut: RedisUnderTest, upstream: Served) -> None:
    """``stream_uploads = true``: the permit first and the body streamed to the upstream as it
    arrives (for uploads too large to buffer; a slow sender then holds the permit)."""
    body = b"s" * 8
    with serve_proxy(rut, upstream, gate_defaults=ONE, stream_uploads=True) as url:
        with _trickler(url, body) as (slow, sent):
            wait_until(lambda: gate_counts(rut.url, rut.prefix, "g") == (1, 0), 5, "the permit")
            slow.sendall(body[sent[0] :])
            answer = _read_answer(slow)
        assert status_of(answer) == 200, answer[:300]
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["body"] == body.decode()
    wait_idle(rut.url, rut.prefix, "g")


def test_a_body_still_arriving_is_read_whole_before_the_permit(
    rut: RedisUnderTest, upstream: Served
) -> None:
    """By default the upstream gets the whole body at once, framed by its length."""

    def chunks() -> Iterator[bytes]:
        for i in range(50):
            time.sleep(0.002)
            yield f"{i:04d}".encode()

    with serve_proxy(rut, upstream) as url, httpx.Client(base_url=url, timeout=10) as http:
        seen = http.post("/echo", content=chunks()).json()
        assert seen["body"] == "".join(f"{i:04d}" for i in range(50))
        assert seen["headers"].get("content-length") == "200", seen["headers"]
        assert "transfer-encoding" not in seen["headers"]
    wait_idle(rut.url, rut.prefix, "g")


def test_a_trickled_body_on_a_model_route_holds_no_permit_and_its_deadline_counts(
    rut: RedisUnderTest, upstream: Served
) -> None:
    """A route picked by the body's model reads the body first too, within the request's
    deadline (the longest the candidate routes allow it)."""
    route = {"upstream": upstream.url, "gate": "g", "models": ["m"], "gate_defaults": ONE}
    with serve_proxy(rut, upstream, routes=[route]) as url:
        with _trickler(url, b'{"model": "m", "input": "........"}', deadline_ms=1500) as (s, _):
            time.sleep(0.8)
            held = gate_counts(rut.url, rut.prefix, "g")
            answer, _ = until_closed(s, 5)
        assert held == (0, 0)
        assert status_of(answer) == 504, answer[:300]
        assert upstream_log(upstream).headers == []
    wait_idle(rut.url, rut.prefix, "g")


def test_buffering_settings_have_stated_defaults_and_field_named_errors() -> None:
    settings = ProxySettings()
    assert settings.max_buffered_bytes == 256 * 1024 * 1024
    assert settings.max_buffered_bytes >= settings.max_request_bytes
    url = "redis://127.0.0.1:6379/0"
    bad: list[tuple[dict[str, Any], str]] = [
        ({"proxy": {"max_buffered_bytes": 0}}, "proxy.max_buffered_bytes"),
        ({"proxy": {"max_buffered_bytes": "lots"}}, "proxy.max_buffered_bytes"),
        (
            {"proxy": {"max_request_bytes": 2048, "max_buffered_bytes": 1024}},
            "proxy.max_buffered_bytes: 1024 is below max_request_bytes 2048",
        ),
        ({"stream_uploads": "yes"}, "routes[0].stream_uploads"),
        ({"stream_uploads": True, "models": ["m"]}, "routes[0].stream_uploads"),
    ]
    for keys, message in bad:
        with pytest.raises(ConfigError, match=re.escape(message)):
            proxy_config(url, "fg", "http://u", **keys)
    assert proxy_config(url, "fg", "http://u", stream_uploads=True).routes[0].stream_uploads
