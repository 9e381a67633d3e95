"""``fleetgate proxy`` under a real third-party client, the ``openai`` SDK with its defaults
(2 retries of 408, 409, 429 and every 5xx, waiting ``Retry-After``; ``x-should-retry: false``
obeyed before any status rule). fleetgate's rule is that an overload rejection is never retried
(retrying deepens it): the proxy's 429 and its queued-deadline 504 say so in the header the SDK
reads, and exactly one request reaches the proxy per call (with the SDK's retries: 3)."""

from __future__ import annotations

import asyncio
import re

import httpx
import openai
import pytest

from fleetgate.client import Fleet
from fleetgate.tools.sim._server import Served

from ..conftest import RedisUnderTest
from ._proxy import serve_proxy, upstream_log, wait_idle


def _answered(url: str, status: int) -> int:
    """How many requests the proxy answered with ``status`` (its requests_total)."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    pattern = rf'^fleetgate_proxy_requests_total\{{[^}}]*status="{status}"[^}}]*\}} (\S+)$'
    return sum(int(float(m)) for m in re.findall(pattern, text, re.MULTILINE))


def _chat(url: str, **headers: str) -> openai.APIStatusError:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-test", timeout=20)
    try:
        with pytest.raises(openai.APIStatusError) as caught:
            client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], extra_headers=headers
            )
    finally:
        client.close()
    return caught.value


async def test_the_sdk_sends_one_request_per_call_into_a_full_queue(
    rut: RedisUnderTest, upstream: Served, fleet: Fleet
) -> None:
    gate = fleet.gate("g", floor=1, max_queued=0)
    with serve_proxy(rut, upstream, gate_defaults={"floor": 1, "max_queued": 0}) as url:
        async with gate.permit(deadline=30):
            error = await asyncio.to_thread(_chat, url)
        assert error.status_code == 429
        assert _answered(url, 429) == 1
        assert error.response.headers["x-should-retry"] == "false"
        assert error.response.headers["retry-after"] == "1"  # for clients that back off
    assert upstream_log(upstream).arrivals == []
    await fleet.flush()
    await asyncio.to_thread(wait_idle, rut.url, rut.prefix, "g")


async def test_the_sdk_sends_one_request_per_call_whose_deadline_ran_out_queued(
    rut: RedisUnderTest, upstream: Served, fleet: Fleet
) -> None:
    gate = fleet.gate("g", floor=1)
    with serve_proxy(rut, upstream, gate_defaults={"floor": 1}) as url:
        async with gate.permit(deadline=30):
            error = await asyncio.to_thread(_chat, url, **{"X-Fleetgate-Deadline-Ms": "300"})
        assert error.status_code == 504
        assert _answered(url, 504) == 1
        assert error.response.headers["x-should-retry"] == "false"
    await fleet.flush()
    await asyncio.to_thread(wait_idle, rut.url, rut.prefix, "g")


def test_upstream_answers_are_untouched(rut: RedisUnderTest, upstream: Served) -> None:
    """The upstream's own 429 and 5xx pass through as they are: no x-should-retry of the
    proxy's (the SDK's rules apply as they would without the proxy)."""
    with serve_proxy(rut, upstream) as url, httpx.Client(base_url=url, timeout=10) as http:
        for code in (429, 503, 504):
            r = http.post(f"/status/{code}", content=b"{}")
            assert r.status_code == code and r.headers["x-upstream"] == "yes"
            assert "x-should-retry" not in r.headers and r.headers["retry-after"] == "7"
    wait_idle(rut.url, rut.prefix, "g")
