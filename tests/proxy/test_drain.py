"""``fleetgate proxy``'s drain cut short, in one process: a request still queued when the drain's
time is up is answered 503 naming the gate (retryable, on a new connection) and leaves the wait
list; it never reaches the upstream."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from fleetgate.client import Fleet
from fleetgate.tools.sim._server import Served

from ..conftest import RedisUnderTest
from ._proxy import gate_counts, serve_proxy, upstream_log, wait_idle, wait_until


async def test_a_request_still_queued_when_the_drain_ends_gets_503(
    rut: RedisUnderTest, upstream: Served, fleet: Fleet
) -> None:
    """uvicorn cancels what is still running once the drain's time is up (and would answer a
    cancelled request 500, "Internal Server Error" in text): the proxy answers 503 naming the
    gate, and the request leaves the wait list."""
    gate = fleet.gate("g", floor=1)
    proxy = serve_proxy(rut, upstream, gate_defaults={"floor": 1}, proxy={"drain_seconds": 1})
    url = proxy.__enter__()
    stopping: asyncio.Future[Any] | None = None
    try:
        async with gate.permit(deadline=30), httpx.AsyncClient(base_url=url, timeout=20) as http:
            call = asyncio.ensure_future(http.post("/work?tag=late", content=b"{}"))
            await asyncio.to_thread(
                wait_until, lambda: gate_counts(rut.url, rut.prefix, "g")[1] == 1, 5, "parked"
            )
            stopping = asyncio.ensure_future(asyncio.to_thread(proxy.__exit__, None, None, None))
            r = await call
    finally:
        if stopping is None:
            proxy.__exit__(None, None, None)
        else:
            await stopping
    assert r.status_code == 503, (r.status_code, r.text[:200])
    error = r.json()["error"]
    assert error["type"] == "shutting_down" and error["gate"] == "g"
    # not an overload (another replica can serve it): retryable, on a new connection
    assert r.headers["retry-after"] == "1" and r.headers["connection"] == "close"
    assert "x-should-retry" not in r.headers
    assert upstream_log(upstream).arrivals == []
    await fleet.flush()
    await asyncio.to_thread(wait_idle, rut.url, rut.prefix, "g")
