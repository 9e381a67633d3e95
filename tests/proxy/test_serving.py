"""``fleetgate proxy`` in one process, over real Redis and real HTTP on loopback: the answers it
gives (429, 504, 4xx for hostile input, upstream answers passed through), streaming, the
admission order set by headers, and that no path leaks a permit.

The proxy runs on a thread of its own (:func:`fleetgate.proxy.serve_in_thread`), the upstream
on another (:func:`fleetgate.tools.sim._server.serve_in_thread`); the test's own fleet takes
permits of the same gate where a test needs the gate held.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from fleetgate.client import Fleet
from fleetgate.proxy import serve_in_thread
from fleetgate.tools.redisproc import free_port
from fleetgate.tools.sim._server import Served

from ..conftest import RedisUnderTest
from ._proxy import (
    gate_counts,
    proxy_config,
    serve_proxy,
    upstream_log,
    wait_idle,
    wait_until,
)
from ._wire import send_raw, status_of

# -- answers ----------------------------------------------------------------------------------


def test_forwards_and_passes_upstream_answers_through(
    rut: RedisUnderTest, upstream: Served
) -> None:
    with serve_proxy(rut, upstream) as url, httpx.Client(base_url=url, timeout=10) as http:
        ok = http.post("/work?tag=a", json={"x": 1})
        assert ok.status_code == 200 and ok.json() == {"tag": "a"}
        assert re.fullmatch(r"1\.1 fleetgate-[0-9a-f]{8}", ok.headers["via"]), ok.headers
        for code in (400, 404, 500, 503):
            r = http.post(f"/status/{code}", content=b"{}")
            assert r.status_code == code
            assert r.content == b'{"upstream": "said so"}'
            assert r.headers["x-upstream"] == "yes" and r.headers["retry-after"] == "7"
        assert http.get("/healthz").json()["status"] == "ok"
    wait_idle(rut.url, rut.prefix, "g")


def test_hop_by_hop_and_fleetgate_headers_are_not_forwarded_and_secrets_not_logged(
    rut: RedisUnderTest, upstream: Served, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="fleetgate.proxy.access")
    headers = {
        "Connection": "keep-alive, X-Hop",
        "X-Hop": "private",
        "Keep-Alive": "timeout=5",
        "Authorization": "Bearer sk-very-secret",
        "X-Fleetgate-Tenant": "a",
        "X-Fleetgate-Priority": "0",
    }
    with serve_proxy(rut, upstream) as url, httpx.Client(base_url=url, timeout=10) as http:
        r = http.post("/echo?api_key=also-secret&x=1", content=b"hello", headers=headers)
    assert r.status_code == 200
    seen = r.json()
    assert seen["body"] == "hello" and seen["query"] == "api_key=also-secret&x=1"
    assert seen["headers"]["authorization"] == "Bearer sk-very-secret"  # end to end: forwarded
    for name in ("x-hop", "keep-alive", "x-fleetgate-tenant", "x-fleetgate-priority"):
        assert name not in seen["headers"], name
    assert re.fullmatch(r"1\.1 fleetgate-[0-9a-f]{8}", seen["headers"]["via"]), seen
    assert seen["headers"]["x-forwarded-for"] == "127.0.0.1"
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "fleetgate.proxy.access"]
    assert any('"POST /echo" 200' in line for line in lines), lines
    text = "\n".join(rec.getMessage() for rec in caplog.records)
    assert "sk-very-secret" not in text and "also-secret" not in text


def test_429_when_the_wait_list_is_full(rut: RedisUnderTest, upstream: Served) -> None:
    async def scenario(url: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            calls = [http.post("/work?ms=400", content=b"{}") for _ in range(6)]
            return await asyncio.gather(*calls)

    with serve_proxy(rut, upstream, gate_defaults={"floor": 1, "max_queued": 2}) as url:
        answers = asyncio.run(scenario(url))
    codes = sorted(r.status_code for r in answers)
    assert codes == [200, 200, 200, 429, 429, 429], codes
    for r in answers:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1" and r.headers["x-fleetgate-gate"] == "g"
            error = r.json()["error"]
            assert error["type"] == "overloaded" and error["gate"] == "g"
            assert "wait list is full" in error["message"] and error["retry_after_s"] == 1
    assert upstream_log(upstream).peak == 1
    wait_idle(rut.url, rut.prefix, "g")


@pytest.mark.parametrize("cap", [60, 3])
async def test_429_at_once_for_a_deadline_the_queue_cannot_meet(
    rut: RedisUnderTest, upstream: Served, fleet: Fleet, cap: int
) -> None:
    """A request whose deadline the gate's measured drain says it would miss gets 429 at once
    (not a 504 after its deadline), not to be retried at once, with a Retry-After from the
    estimate (spread, capped by the route's max_retry_after_s)."""
    import redis

    gate = fleet.gate("g", floor=1)
    held = await gate.acquire()
    parked = [asyncio.create_task(gate.acquire(deadline=60)) for _ in range(5)]
    r = redis.Redis.from_url(rut.url, decode_responses=True)
    while (await gate.snapshot()).queued < 5:
        await asyncio.sleep(0.02)
    sec, usec = r.time()
    # a drain of 1 grant/s measured (100 over 100 s): the 6th in line starts in ~6 s or later
    r.hset(gate.keys.adm, "dr:100", f"100,100000,{sec * 1000 + usec // 1000}")
    r.close()
    route = {"gate_defaults": {"floor": 1}, "max_retry_after_s": cap}
    with serve_proxy(rut, upstream, **route) as url:
        async with httpx.AsyncClient(base_url=url) as http:
            t0 = time.monotonic()
            resp = await http.post("/work", headers={"X-Fleetgate-Deadline-Ms": "2000"})
            took = time.monotonic() - t0
    assert resp.status_code == 429 and took < 1.0, (resp.status_code, took)
    assert resp.headers["x-should-retry"] == "false"
    error = resp.json()["error"]
    assert "expected wait" in error["message"] and "deadline" in error["message"]
    # the bound on the 6th start, (6 + sqrt 6) s, past the 2 s deadline, x 1..1.5, rounded up,
    # at most the cap
    late = 6 + math.sqrt(6) - 2
    seconds = int(resp.headers["retry-after"])
    assert min(math.ceil(late), cap) <= seconds <= min(math.ceil(1.5 * late), cap), seconds
    await held.release()
    for task in parked:  # each is granted once the one before it is released
        await (await task).release()
    await fleet.flush()
    wait_idle(rut.url, rut.prefix, "g")


async def test_504_when_the_deadline_expires_while_queued(
    rut: RedisUnderTest, upstream: Served, fleet: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="fleetgate.proxy.access")
    gate = fleet.gate("g", floor=1)
    with serve_proxy(rut, upstream, gate_defaults={"floor": 1}) as url:
        async with gate.permit(deadline=30), httpx.AsyncClient(base_url=url) as http:
            t0 = time.monotonic()
            r = await http.post("/work", headers={"X-Fleetgate-Deadline-Ms": "300"})
            took = time.monotonic() - t0
        assert r.status_code == 504 and 0.25 < took < 3.0, (r.status_code, took)
        error = r.json()["error"]
        assert error["type"] == "deadline_exceeded" and error["gate"] == "g"
        assert "300 ms" in error["message"] and "queued" in error["message"]
        assert "retr" not in error["message"]  # the proxy retries nothing

        # the proxy's thread logs the line after the answer is sent: it may come a moment later
        def lines() -> list[str]:
            return [m.getMessage() for m in caplog.records if '"POST /work" 504' in m.getMessage()]

        for _ in range(100):
            if lines():
                break
            await asyncio.sleep(0.02)
        [line] = lines()
        assert f" 504 {len(r.content)}B " in line  # its own body counted, not 0B
        assert upstream_log(upstream).arrivals == []  # the work was never started
    await fleet.flush()
    wait_idle(rut.url, rut.prefix, "g")


def test_504_when_the_upstream_does_not_answer_in_time(
    rut: RedisUnderTest, upstream: Served
) -> None:
    with serve_proxy(rut, upstream, deadline_ms=400) as url, httpx.Client(base_url=url) as http:
        r = http.get("/hang")
        assert r.status_code == 504 and r.json()["error"]["gate"] == "g"
        assert "before the upstream's response headers" in r.json()["error"]["message"]
        wait_until(lambda: upstream_log(upstream).cancelled == 1, 5, "the upstream call cancelled")
    wait_idle(rut.url, rut.prefix, "g")


def test_502_when_the_upstream_is_down(rut: RedisUnderTest) -> None:
    dead = Served(f"http://127.0.0.1:{free_port()}", None)  # type: ignore[arg-type]
    with serve_proxy(rut, dead) as url, httpx.Client(base_url=url) as http:
        r = http.get("/work")
        assert r.status_code == 502
        error = r.json()["error"]
        assert error["type"] == "upstream_error" and error["gate"] == "g"
    wait_idle(rut.url, rut.prefix, "g")


# -- disconnects ---------------------------------------------------------------------------------


async def test_a_caller_that_disconnects_while_queued_leaves_the_queue(
    rut: RedisUnderTest, upstream: Served, fleet: Fleet
) -> None:
    gate = fleet.gate("g", floor=1)
    with serve_proxy(rut, upstream, gate_defaults={"floor": 1}) as url:
        async with gate.permit(deadline=30), httpx.AsyncClient(base_url=url) as http:
            call = asyncio.ensure_future(http.post("/work?tag=gone", content=b"{}"))
            await asyncio.to_thread(
                wait_until, lambda: gate_counts(rut.url, rut.prefix, "g")[1] == 1, 5, "parked"
            )
            call.cancel()  # the connection closes
            await asyncio.gather(call, return_exceptions=True)
            await asyncio.to_thread(
                wait_until, lambda: gate_counts(rut.url, rut.prefix, "g")[1] == 0, 5, "left"
            )
        await fleet.flush()
        await asyncio.to_thread(wait_idle, rut.url, rut.prefix, "g")
        await asyncio.sleep(0.2)
        assert upstream_log(upstream).arrivals == []  # no permit consumed, the work never started
        metrics = await asyncio.to_thread(lambda: httpx.get(url + "/metrics").text)
    assert 'fleetgate_proxy_client_disconnects_total{phase="queued",route="/"} 1.0' in metrics


async def test_a_caller_that_disconnects_mid_stream_cancels_the_upstream(
    rut: RedisUnderTest, upstream: Served
) -> None:
    with serve_proxy(rut, upstream) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            async with http.stream("GET", "/sse?n=200&ms=50") as r:
                assert r.status_code == 200
                lines = r.aiter_lines()
                assert (await anext(lines)).startswith("data: ")
                assert gate_counts(rut.url, rut.prefix, "g")[0] == 1  # held while it streams
            # leaving the block closed the connection mid-stream
        await asyncio.to_thread(
            wait_until, lambda: upstream_log(upstream).cancelled == 1, 5, "upstream cancelled"
        )
        await asyncio.to_thread(wait_idle, rut.url, rut.prefix, "g")
        metrics = await asyncio.to_thread(lambda: httpx.get(url + "/metrics").text)
    assert 'fleetgate_proxy_client_disconnects_total{phase="response",route="/"} 1.0' in metrics


async def test_sse_passes_through_chunk_by_chunk_in_order(
    rut: RedisUnderTest, upstream: Served
) -> None:
    got: list[tuple[float, str]] = []
    with serve_proxy(rut, upstream) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            async with http.stream("POST", "/sse?n=6&ms=150", json={"stream": True}) as r:
                assert r.headers["content-type"].startswith("text/event-stream")
                async for line in r.aiter_lines():
                    if line:
                        got.append((time.monotonic(), line))
        wait_idle(rut.url, rut.prefix, "g")
    sent = upstream_log(upstream).sse_sent
    events = [json.loads(line[6:])["i"] for _, line in got[:-1]]
    assert events == list(range(6)) and got[-1][1] == "data: [DONE]"
    # each event reaches the caller as it is sent, not when the stream ends
    delays = [at - sent[i] for i, (at, _) in enumerate(got[:-1])]
    assert max(delays) < 0.1, delays
    assert got[0][0] < sent[-1]  # the first event arrived before the last was sent


# -- admission order by headers ---------------------------------------------------------------


async def _queue_in_order(
    url: str, rut: RedisUnderTest, fleet: Fleet, calls: list[tuple[str, dict[str, str]]]
) -> list[int]:
    """Hold the gate, park ``calls`` in this order through the proxy, release, return the
    statuses; the upstream records the order it was reached in."""
    gate = fleet.gate("g", floor=1, max_queued=100)
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        tasks = []
        async with gate.permit(deadline=30):
            for n, (tag, headers) in enumerate(calls, 1):
                tasks.append(
                    asyncio.ensure_future(
                        http.post(f"/work?tag={tag}&ms=30", content=b"{}", headers=headers)
                    )
                )
                await asyncio.to_thread(
                    wait_until,
                    lambda n=n: gate_counts(rut.url, rut.prefix, "g")[1] == n,
                    5,
                    f"{n} parked",
                )
        answers = await asyncio.gather(*tasks)
    return [a.status_code for a in answers]


async def test_priority_header_changes_the_order(
    rut: RedisUnderTest, upstream: Served, fleet: Fleet
) -> None:
    route = {"gate_defaults": {"floor": 1}, "min_priority": 0, "max_priority": 10}
    with serve_proxy(rut, upstream, **route) as url:
        calls = [(f"low{i}", {}) for i in range(3)]
        calls.append(("high", {"X-Fleetgate-Priority": "10"}))
        calls.append(("clamped", {"X-Fleetgate-Priority": "50"}))  # 50 -> the route's 10
        assert await _queue_in_order(url, rut, fleet, calls) == [200] * 5
    assert upstream_log(upstream).arrivals == ["high", "clamped", "low0", "low1", "low2"]


async def test_tenant_header_shares_a_band_fairly(
    rut: RedisUnderTest, upstream: Served, fleet: Fleet
) -> None:
    route = {"gate_defaults": {"floor": 1}, "tenants": ["a", "b"]}
    with serve_proxy(rut, upstream, **route) as url:
        calls = [(f"a{i}", {"X-Fleetgate-Tenant": "a"}) for i in range(4)]
        calls += [(f"b{i}", {"X-Fleetgate-Tenant": "b"}) for i in range(2)]
        calls += [("x0", {"X-Fleetgate-Tenant": "x"})]  # not allowed: the default tenant
        assert await _queue_in_order(url, rut, fleet, calls) == [200] * 7
    order = upstream_log(upstream).arrivals
    # FIFO would serve a0..a3 first; fair queuing alternates the backlogged tenants
    assert [t[0] for t in order[:6]].count("b") == 2 and order.index("b1") < order.index("a3")
    assert sorted(order) == sorted(tag for tag, _ in calls)


# -- routing --------------------------------------------------------------------------------


def test_routes_by_path_and_model(rut: RedisUnderTest, upstream: Served) -> None:
    routes = [
        {"path": "/v1", "models": ["m1"], "upstream": upstream.url, "gate": "g1", "name": "m1"},
        {"path": "/v1", "models": ["m2"], "upstream": upstream.url, "gate": "g2", "name": "m2"},
        {"path": "/work", "upstream": upstream.url, "gate": "g3", "name": "work"},
    ]
    config = proxy_config(rut.url, rut.prefix, upstream.url, routes=routes)
    with serve_in_thread(config) as url, httpx.Client(base_url=url, timeout=10) as http:
        assert http.post("/v1/echo", json={"model": "m2"}).status_code == 404  # upstream's 404
        assert http.post("/work", json={"model": "m1"}).status_code == 200
        r = http.post("/v1/x", json={"model": "other"})
        assert r.status_code == 404 and r.json()["error"]["type"] == "no_route"
        assert "model 'other'" in r.json()["error"]["message"]
        assert http.post("/nowhere", content=b"").json()["error"]["type"] == "no_route"
        metrics = http.get("/metrics").text
    assert 'fleetgate_proxy_requests_total{route="m2",status="404"} 1.0' in metrics
    assert 'fleetgate_proxy_requests_total{route="work",status="200"} 1.0' in metrics
    assert 'fleetgate_proxy_requests_total{route="",status="404"} 2.0' in metrics
    assert "fleetgate_client_granted_total" in metrics  # the client metrics are there too


def test_strip_path_forwards_the_rest_of_the_path(rut: RedisUnderTest, upstream: Served) -> None:
    routes = [
        {"path": "/rerank", "upstream": upstream.url, "gate": "g1", "strip_path": True},
        {"path": "/keep", "upstream": upstream.url, "gate": "g2"},
    ]
    config = proxy_config(rut.url, rut.prefix, upstream.url, routes=routes)
    with serve_in_thread(config) as url, httpx.Client(base_url=url, timeout=10) as http:
        r = http.post("/rerank/echo?q=1%202", content=b"{}")
        assert r.status_code == 200 and r.json()["path"] == "/echo", r.text
        assert r.json()["query"] == "q=1%202"
        assert http.post("/rerank", content=b"{}").status_code == 404  # upstream's "/": none
        assert http.post("/keep/echo", content=b"{}").status_code == 404  # forwarded whole
        # The prefix percent-encoded in the caller's path: it routed (decoded) but cannot be
        # cut from the raw path, so a clear 400 and no permit left behind.
        r = http.post("/re%72ank/echo", content=b"{}")
        assert r.status_code == 400 and r.json()["error"]["type"] == "bad_request", r.text
    wait_idle(rut.url, rut.prefix, "g1")


# -- hostile input ----------------------------------------------------------------------------


@pytest.mark.parametrize("parser", ["httptools", "h11"])
def test_hostile_input_gets_a_clear_4xx_never_a_500_nor_a_leaked_permit(
    rut: RedisUnderTest, upstream: Served, parser: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if parser == "h11":  # the HTTP parser without the fast extra
        monkeypatch.setattr("fleetgate.proxy.server._http_protocol", lambda: "h11")
    proxy = {"max_header_bytes": 4096, "max_request_bytes": 64 * 1024}
    route = {"proxy": proxy, "max_priority": 10, "tenants": ["*"], "max_weight": 4}
    statuses: list[int] = []
    with serve_proxy(rut, upstream, **route) as url, httpx.Client(base_url=url, timeout=10) as http:

        def bad(status: int, *args: Any, **kwargs: Any) -> dict[str, Any]:
            r = http.request(*args, **kwargs)
            statuses.append(r.status_code)
            assert r.status_code == status, (args, kwargs.get("headers"), r.text[:300])
            error: dict[str, Any] = r.json()["error"]
            return error

        for name, value, wanted in [
            ("X-Fleetgate-Priority", "urgent", "X-Fleetgate-Priority: expected an integer"),
            ("X-Fleetgate-Priority", "-101", "X-Fleetgate-Priority"),
            ("X-Fleetgate-Weight", "0", "X-Fleetgate-Weight: expected an integer >= 1"),
            ("X-Fleetgate-Weight", "99999999999999999999", "X-Fleetgate-Weight"),
            ("X-Fleetgate-Deadline-Ms", "0", "X-Fleetgate-Deadline-Ms"),
            ("X-Fleetgate-Deadline-Ms", "soon", "X-Fleetgate-Deadline-Ms"),
            ("X-Fleetgate-Tenant", "a}b", "X-Fleetgate-Tenant: tenant 'a}b' contains '}'"),
        ]:
            error = bad(400, "POST", "/work", content=b"{}", headers={name: value})
            assert error["type"] == "bad_header" and wanted in error["message"]
        error = bad(431, "GET", "/work", headers={"X-Big": "y" * 5000})
        assert error["type"] == "headers_too_large"
        error = bad(413, "POST", "/echo", content=b"z" * (65 * 1024))
        assert error["type"] == "body_too_large"

        def chunks() -> Iterator[bytes]:
            for _ in range(100):
                yield b"c" * 1024

        assert bad(413, "POST", "/echo", content=chunks())["type"] == "body_too_large"
        assert http.post("/echo", content=b"ok").status_code == 200  # the proxy still serves

        # what httpx would not send: raw bytes on a socket
        for data, wanted in [
            (b"GET /work/../admin HTTP/1.1\r\nHost: x\r\n\r\n", 400),
            (b"GET /work/%2e%2e/admin HTTP/1.1\r\nHost: x\r\n\r\n", 400),
            (b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999\r\n\r\n", 413),
            (b"GET /work HTTP/1.1\r\nHost: x\r\nX-Huge: " + b"h" * 20_000 + b"\r\n\r\n", 431),
            (b"NOT HTTP AT ALL\r\n\r\n", 400),
            (
                b"GET /work HTTP/1.1\r\nHost: x\r\nX-Fleetgate-Weight: 1\r\n"
                b"X-Fleetgate-Weight: 2\r\n\r\n",
                400,
            ),
            (b"GET /work HTTP/1.1\r\nHost: x\r\nX-Fleetgate-Tenant: \xff\xfe\r\n\r\n", 200),
        ]:
            answer = send_raw(url, data)
            statuses.append(status_of(answer))
            assert status_of(answer) == wanted, (data[:60], answer[:300])
        # a head that never ends: cut once it is past the limit (httptools: 431, h11: 400)
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(b"GET /work HTTP/1.1\r\nHost: x\r\n")
            with contextlib.suppress(OSError):
                for _ in range(100):
                    s.sendall(b"X-More: " + b"m" * 1000 + b"\r\n")
            answer = s.recv(65536)
            assert status_of(answer) in (400, 431), answer[:300]
            statuses.append(status_of(answer))
        # a body announced and never sent: the caller gives up, the permit comes back
        send_raw(
            url, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc", read=False
        )
    assert 500 not in statuses
    wait_idle(rut.url, rut.prefix, "g")


def test_a_too_large_upstream_response_is_refused(rut: RedisUnderTest, upstream: Served) -> None:
    proxy = {"max_response_bytes": 1024 * 1024}
    with serve_proxy(rut, upstream, proxy=proxy) as url, httpx.Client(base_url=url) as http:
        r = http.get("/big?mb=2")
        assert r.status_code == 502 and r.json()["error"]["type"] == "response_too_large"
        assert http.get("/big?mb=1").status_code == 200
    wait_idle(rut.url, rut.prefix, "g")


def test_redis_down_serves_under_the_fair_share(upstream: Served) -> None:
    """No Redis at all: the client's fair-share fallback serves (1 permit per pod until it has
    counted its peers), and /healthz fails: a proxy that never reached Redis is not ready (a
    wrong URL looks like this), while one in an outage after it did is (fallback true)."""
    config = proxy_config(f"redis://127.0.0.1:{free_port()}/0", "p", upstream.url)
    with serve_in_thread(config) as url, httpx.Client(base_url=url, timeout=15) as http:
        assert http.post("/work?tag=a", content=b"{}").status_code == 200
        health = http.get("/healthz")
        assert health.status_code == 503
        assert health.json()["status"] == "redis_never_reached"
        assert health.json()["fallback"] is True
        metrics = http.get("/metrics").text
    assert 'fleetgate_client_fallback{gate="g"} 1.0' in metrics
