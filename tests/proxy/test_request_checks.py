"""``fleetgate proxy``'s checks of a request before it goes upstream: the
caller's forwarding headers (trusted only from a configured proxy), transfer codings it does not
understand (501), Tomcat-style ``..;`` segments (400), a request that comes back to the same
proxy (508), and the ``Trailer`` header of a body whose trailers are dropped."""

from __future__ import annotations

import json

import httpx
import pytest

from fleetgate.tools.sim._server import Served

from ..conftest import RedisUnderTest
from ._proxy import serve_proxy, upstream_log, wait_idle
from ._wire import send_raw, status_of

FORGED = {
    "forwarded": "for=6.6.6.6;host=evil.example;proto=https",
    "x-real-ip": "6.6.6.6",
    "x-forwarded-host": "evil.example",
    "x-forwarded-for": "6.6.6.6",
}


def test_forwarding_headers_of_an_untrusted_peer_do_not_reach_the_upstream(
    rut: RedisUnderTest, upstream: Served
) -> None:
    """Forwarded, X-Real-IP and X-Forwarded-Host do not go upstream as the caller wrote them (an
    upstream that reads them would take the caller's word for its address or host)."""
    with serve_proxy(rut, upstream) as url, httpx.Client(base_url=url, timeout=10) as http:
        seen = http.get("/echo", headers=FORGED).json()["headers"]
    for name in ("forwarded", "x-real-ip", "x-forwarded-host"):
        assert name not in seen, (name, seen)
    assert seen["x-forwarded-for"] == "127.0.0.1"  # the peer's address, not the caller's word
    wait_idle(rut.url, rut.prefix, "g")


@pytest.mark.parametrize("trusted", [["127.0.0.1"], ["127.0.0.0/8", "10.0.0.0/8"]])
def test_forwarding_headers_of_a_trusted_proxy_pass(
    rut: RedisUnderTest, upstream: Served, trusted: list[str]
) -> None:
    proxy = {"trusted_proxies": trusted}
    with (
        serve_proxy(rut, upstream, proxy=proxy) as url,
        httpx.Client(base_url=url, timeout=10) as http,
    ):
        seen = http.get("/echo", headers=FORGED).json()["headers"]
    for name in ("forwarded", "x-real-ip", "x-forwarded-host"):
        assert seen[name] == FORGED[name], (name, seen)
    assert seen["x-forwarded-for"] == "6.6.6.6, 127.0.0.1"  # the chain, the peer appended
    wait_idle(rut.url, rut.prefix, "g")


def test_an_unknown_transfer_coding_is_refused(
    rut: RedisUnderTest, upstream: Served, parser: str
) -> None:
    """RFC 9112 6.1: a coding the proxy does not understand -> 501 (h11 refuses it itself,
    400), never forwarded as identity with the coding silently dropped."""
    with serve_proxy(rut, upstream) as url:
        for coding in (b"gzip, chunked", b"chunked, chunked", b"deflate"):
            answer = send_raw(
                url,
                b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: " + coding + b"\r\n\r\n"
                b"5\r\nhello\r\n0\r\n\r\n",
            )
            # the parsers refuse some themselves (400); what reaches the app is 501
            expected = (501,) if (parser, coding) == ("httptools", b"gzip, chunked") else (400, 501)
            assert status_of(answer) in expected, (coding, answer[:300])
    assert upstream_log(upstream).headers == []
    wait_idle(rut.url, rut.prefix, "g")


@pytest.mark.parametrize(
    "path",
    [
        b"/v1/chat/..;/admin",
        b"/v1/chat/..;jsessionid=1/admin",
        b"/v1/.;/admin",
        b"/v1/chat/%2e%2e;/admin",
        b"/v1/chat/..%3b/admin",
    ],
)
def test_dot_segments_with_path_parameters_are_refused(
    rut: RedisUnderTest, upstream: Served, path: bytes
) -> None:
    """A Java caller on Tomcat/Spring resolves ``/v1/chat/..;/admin`` to ``/v1/admin``: the
    proxy must not route it as ``/v1/chat``."""
    with serve_proxy(rut, upstream) as url:
        answer = send_raw(url, b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status_of(answer) == 400, (path, answer[:300])
    assert upstream_log(upstream).headers == []


def test_a_request_that_comes_back_through_the_same_proxy_gets_508(
    rut: RedisUnderTest, upstream: Served
) -> None:
    with serve_proxy(rut, upstream) as url, httpx.Client(base_url=url, timeout=10) as http:
        own = http.get("/echo").json()["headers"]["via"]  # what this proxy adds
        looped = http.get("/echo", headers={"via": f"1.0 lb, {own}"})
        assert looped.status_code == 508, looped.text
        assert looped.json()["error"]["type"] == "loop_detected"
        other = http.get("/echo", headers={"via": "1.1 fleetgate-other, 1.1 lb"})
        assert other.status_code == 200  # another fleetgate proxy: a chain, not a loop
        assert other.json()["headers"]["via"] == f"1.1 fleetgate-other, 1.1 lb, {own}"
    assert len(upstream_log(upstream).headers) == 2
    wait_idle(rut.url, rut.prefix, "g")


def test_the_trailer_header_is_not_forwarded(
    rut: RedisUnderTest, upstream: Served, parser: str
) -> None:
    """The trailers themselves are dropped, and so is the header announcing them."""
    with serve_proxy(rut, upstream) as url:
        answer = send_raw(
            url,
            b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
            b"Trailer: X-Checksum\r\n\r\n5\r\nhello\r\n0\r\nX-Checksum: 1\r\n\r\n",
        )
    assert status_of(answer) == 200, answer[:300]
    seen = json.loads(answer.partition(b"\r\n\r\n")[2])
    assert seen["body"] == "hello"
    assert "trailer" not in seen["headers"] and "x-checksum" not in seen["headers"]
    wait_idle(rut.url, rut.prefix, "g")
