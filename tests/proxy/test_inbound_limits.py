"""``fleetgate proxy`` on the caller's side of an exchange, over raw sockets and both request
parsers: time limits on a request's head and body (408), and a prompt 413 for a chunked body
past ``max_request_bytes`` (queued or not)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from fleetgate.client import Fleet
from fleetgate.errors import ConfigError
from fleetgate.proxy.config import ProxySettings
from fleetgate.tools.sim._server import Served

from ..conftest import RedisUnderTest
from ._proxy import (
    counting_upstream,
    gate_counts,
    proxy_config,
    serve_proxy,
    upstream_log,
    wait_idle,
)
from ._wire import connect, status_of, until_closed

pytestmark = pytest.mark.usefixtures("parser")  # every test on both request parsers (conftest)

HEAD_S = 0.5
BODY_S = 0.5
TIMEOUTS = {"head_timeout_s": HEAD_S, "body_timeout_s": BODY_S}


def test_timeouts_have_sane_defaults_and_bounds() -> None:
    settings = ProxySettings()
    assert 0 < settings.head_timeout_s <= 30 and 0 < settings.body_timeout_s <= 30
    for bad in ({"head_timeout_s": 0}, {"body_timeout_s": -1}, {"head_timeout_s": 1e9}):
        with pytest.raises(ConfigError, match=f"proxy.{next(iter(bad))}"):
            proxy_config("redis://127.0.0.1:6379/0", "fg", "http://u", proxy=bad)


def test_a_head_trickled_byte_by_byte_gets_408(
    rut: RedisUnderTest, upstream: Served, caplog: pytest.LogCaptureFixture
) -> None:
    """Bytes that keep coming do not extend the head's time: it counts from the connection's
    start (a head at 1 byte/s is not still open after 40 s)."""
    caplog.set_level(logging.INFO)
    head = b"GET /work HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200
    with serve_proxy(rut, upstream, proxy=TIMEOUTS) as url, connect(url) as s:
        t0 = time.monotonic()
        answer = b""
        s.settimeout(0.05)  # the trickle's pace: a byte per 50 ms, read in between
        for byte in head:
            try:
                s.sendall(bytes([byte]))
                answer = s.recv(65536)
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
            break
        rest, _ = until_closed(s, 5)
        took = time.monotonic() - t0
    answer += rest
    assert status_of(answer) == 408, answer[:200]
    assert b"connection: close" in answer.lower()
    assert HEAD_S * 0.9 < took < HEAD_S + 2, took
    assert upstream_log(upstream).arrivals == []
    lines = [m for r in caplog.records if "no complete request head" in (m := r.getMessage())]
    assert len(lines) == 1, lines  # logged once
    assert not [r for r in caplog.records if r.name.startswith("uvicorn") and r.levelno >= 30]


def test_a_connection_that_sends_nothing_is_closed(rut: RedisUnderTest, upstream: Served) -> None:
    """No request, so no answer: the connection is closed, not kept open for ever."""
    with serve_proxy(rut, upstream, proxy=TIMEOUTS) as url, connect(url) as s:
        answer, closed_after = until_closed(s, HEAD_S + 5)
    assert answer == b"" and closed_after < HEAD_S + 2, (answer, closed_after)


def test_a_kept_alive_connection_gets_the_head_time_from_its_last_answer(
    rut: RedisUnderTest, upstream: Served
) -> None:
    # A longer head time than the file's, so that a loaded machine's late timers (0.5 s of
    # head time measured 0.51-0.56 s here) cannot blur the two readings apart: counted from
    # the end of the first answer, the head times out ~0.8 s after the new bytes; counted from
    # the new bytes, 2 s after.
    head_s = 2.0
    timeouts = {**TIMEOUTS, "head_timeout_s": head_s}
    with serve_proxy(rut, upstream, proxy=timeouts) as url, connect(url) as s:
        s.sendall(b"GET /work HTTP/1.1\r\nHost: x\r\n\r\n")
        first = b""
        while not first.endswith(b'{"tag":""}'):
            first += s.recv(65536)
        assert status_of(first) == 200
        time.sleep(head_s * 0.6)  # most of the head's time used up idle
        s.sendall(b"GET /work HTTP/1.1\r\nHost: x\r\n")
        t0 = time.monotonic()
        answer, _ = until_closed(s, head_s + 5)
    took = time.monotonic() - t0
    assert status_of(answer) == 408, answer[:200]
    assert took < head_s * 0.8, took  # counted from the end of the first answer, not the new bytes


def _held(fleet: Fleet) -> Any:
    return fleet.gate("g", floor=1).permit(deadline=30)


@pytest.mark.parametrize("phase", ["free", "queued", "by_model"])
async def test_a_stalled_body_gets_408(
    rut: RedisUnderTest,
    upstream: Served,
    fleet: Fleet,
    phase: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A body that stops arriving: 408 once ``body_timeout_s`` passes without a byte, whether
    the request waits for a permit, is being forwarded, or is read for its ``model``; no permit
    is kept (``Inbound`` does not wait for ever, nor a queued one until its deadline)."""
    caplog.set_level(logging.INFO, logger="fleetgate.proxy.access")
    route: dict[str, Any] = {"gate_defaults": {"floor": 1}, "proxy": TIMEOUTS}
    if phase == "by_model":
        route["routes"] = [
            {"upstream": upstream.url, "gate": "g", "models": ["m"], "gate_defaults": {"floor": 1}}
        ]
    head = (
        b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
        b"X-Fleetgate-Deadline-Ms: 20000\r\n\r\n"
    )
    with serve_proxy(rut, upstream, **route) as url:
        async with _held_if(fleet, phase == "queued"):
            with connect(url) as s:
                s.sendall(head + b'{"model": "m"')
                t0 = time.monotonic()
                answer, _ = await asyncio.to_thread(until_closed, s, BODY_S + 5)
                took = time.monotonic() - t0
        assert status_of(answer) == 408, answer[:300]
        assert b"connection: close" in answer.lower()
        assert took < BODY_S + 2, took
        await fleet.flush()
        await asyncio.to_thread(wait_idle, rut.url, rut.prefix, "g")
    lines = [r.getMessage() for r in caplog.records if r.name == "fleetgate.proxy.access"]
    assert len([x for x in lines if " 408 " in x]) == 1, lines


@contextlib.asynccontextmanager
async def _held_if(fleet: Fleet, hold: bool) -> AsyncIterator[None]:
    """The gate's one permit held by the test's fleet (when ``hold``)."""
    if not hold:
        yield
        return
    async with _held(fleet):
        yield


def _chunked_over(limit: int) -> bytes:
    """A chunked POST whose body passes ``limit`` (4 chunks of ``limit // 2``), complete."""
    chunk = b"x" * (limit // 2)
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(4)) + b"0\r\n\r\n"
    return (
        b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        b"X-Fleetgate-Deadline-Ms: 3000\r\n\r\n" + body
    )


async def test_an_over_limit_chunked_body_gets_413_at_once_while_queued(
    rut: RedisUnderTest, upstream: Served, fleet: Fleet
) -> None:
    """413 at once, leaving the queue: it does not wait out its deadline (504 after 3 s)
    holding a place in the queue."""
    limit = 4096
    proxy = {"max_request_bytes": limit}
    with serve_proxy(rut, upstream, gate_defaults={"floor": 1}, proxy=proxy) as url:
        async with _held(fleet):
            with connect(url) as s:
                t0 = time.monotonic()
                s.sendall(_chunked_over(limit))
                answer, _ = await asyncio.to_thread(until_closed, s, 6)
                took = time.monotonic() - t0
            assert status_of(answer) == 413, answer[:300]
            assert took < 1.5, took
            assert gate_counts(rut.url, rut.prefix, "g")[1] == 0  # left the queue
        assert upstream_log(upstream).headers == []
        await fleet.flush()
        await asyncio.to_thread(wait_idle, rut.url, rut.prefix, "g")


def test_an_over_limit_chunked_body_gets_413_before_the_upstream(rut: RedisUnderTest) -> None:
    """With the gate free it is refused before it takes a permit and sends its head
    upstream."""
    limit = 4096
    with (
        counting_upstream() as (up, counts),
        serve_proxy(rut, up, proxy={"max_request_bytes": limit}) as url,
        connect(url) as s,
    ):
        s.sendall(_chunked_over(limit))
        answer, _ = until_closed(s, 6)
        assert status_of(answer) == 413, answer[:300]
        assert counts == [0, 0]  # the upstream saw nothing
    wait_idle(rut.url, rut.prefix, "g")
