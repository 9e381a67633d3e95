"""Revocation through ``fleetgate proxy``: a request of priority 0 holds the gate's only unit
with a long upstream call (one that never answers, or a long stream); a call of priority 10
(the test's own fleet) waits past the gate's ``revoke_after``. The proxy learns at its heartbeat
that the request's permit is revoked and cuts the upstream call: before the answer began, a 503
not to be retried at once (``x-should-retry: false``, ``Retry-After``); a stream already under
way ends where it was (a 503 cannot follow a 200). The permit goes back and the higher call
starts; nothing leaks."""

from __future__ import annotations

import asyncio
import time

import httpx

from fleetgate.client import Fleet
from fleetgate.tools.sim._server import Served

from ..conftest import RedisUnderTest
from ._proxy import gate_counts, serve_proxy, upstream_log, wait_idle, wait_until

SETTINGS = {"floor": 1, "revoke_after": 0.3}


async def _held_by_the_proxy(rut: RedisUnderTest) -> None:
    await asyncio.to_thread(
        wait_until, lambda: gate_counts(rut.url, rut.prefix, "g")[0] == 1, 10, "the proxy holds"
    )


async def test_a_revoked_permit_cuts_the_upstream_call_with_a_503(
    rut: RedisUnderTest, upstream: Served, fleet: Fleet
) -> None:
    gate = fleet.gate("g", **SETTINGS)
    with serve_proxy(rut, upstream, gate_defaults=SETTINGS) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            call = asyncio.ensure_future(http.get("/hang"))  # never answers
            await _held_by_the_proxy(rut)
            t0 = time.monotonic()
            async with gate.permit(deadline=20, priority=10):
                took = time.monotonic() - t0
            r = await call
    print(f"[proxy revocation] the priority-10 call waited {took:.3f} s; {r.status_code}")
    assert took < 5.0  # not the hour the upstream call would have taken
    assert r.status_code == 503, r.text
    assert r.headers["x-should-retry"] == "false" and int(r.headers["retry-after"]) >= 1
    error = r.json()["error"]
    assert (
        error["type"] == "revoked" and error["gate"] == "g" and "revoke_after" in error["message"]
    )
    wait_until(lambda: upstream_log(upstream).cancelled == 1, 5, "the upstream call cancelled")
    await fleet.flush()
    wait_idle(rut.url, rut.prefix, "g")


async def test_a_revoked_stream_ends_where_it_was(
    rut: RedisUnderTest, upstream: Served, fleet: Fleet
) -> None:
    gate = fleet.gate("g", **SETTINGS)
    events = 0
    with serve_proxy(rut, upstream, gate_defaults=SETTINGS) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:

            async def stream() -> tuple[int, bool]:
                nonlocal events
                async with http.stream("GET", "/sse?n=200&ms=50") as resp:
                    status, complete = resp.status_code, False
                    try:
                        async for line in resp.aiter_lines():
                            events += line.startswith("data: {")
                            complete = complete or line == "data: [DONE]"
                    except httpx.HTTPError:
                        pass  # the stream was cut
                return status, complete

            call = asyncio.ensure_future(stream())
            await _held_by_the_proxy(rut)
            t0 = time.monotonic()
            async with gate.permit(deadline=20, priority=10):
                took = time.monotonic() - t0
            status, complete = await call
    print(f"[proxy revocation] stream: {events} of 200 events, waited {took:.3f} s")
    assert status == 200 and not complete  # begun, then ended short of its [DONE]
    assert 0 < events < 200 and took < 5.0  # 200 events take 10 s
    wait_until(lambda: upstream_log(upstream).cancelled == 1, 5, "the upstream stream cancelled")
    await fleet.flush()
    wait_idle(rut.url, rut.prefix, "g")
