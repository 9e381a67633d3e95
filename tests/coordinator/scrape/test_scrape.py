"""The bounded scrape over httpx against a real local HTTP server (failures, redirects, caps,
timeouts), signals fetched from several replicas, and the vLLM simulator's exposition."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from fleetgate.coordinator.scrape.signals import Signals, fetch_signals, scrape

from ._metrics_server import VLLM_TEXT


async def test_scrape_ok(server_url: str) -> None:
    async with httpx.AsyncClient() as client:
        result = await scrape(client, f"{server_url}/metrics", timeout=2.0, max_bytes=1 << 20)
    assert result.ok and result.status == 200 and result.error is None
    assert result.text == VLLM_TEXT
    assert result.elapsed >= 0


@pytest.mark.parametrize(
    ("path", "needle"),
    [
        ("/missing", "HTTP 404"),
        ("/redirect", "redirect"),
        ("/other", "HTTP 500"),
        ("/big", "cap"),
        ("/endless", "cap"),
        ("/latin1", "UTF-8"),
    ],
)
async def test_scrape_failures(server_url: str, path: str, needle: str) -> None:
    async with httpx.AsyncClient() as client:
        result = await scrape(client, server_url + path, timeout=3.0, max_bytes=64 * 1024)
    assert not result.ok and result.text is None
    assert result.error is not None and needle in result.error
    assert result.elapsed < 3.0


async def test_scrape_redirect_is_not_followed(server_url: str) -> None:
    async with httpx.AsyncClient(follow_redirects=True) as client:
        result = await scrape(client, f"{server_url}/redirect", timeout=2.0, max_bytes=1 << 20)
    assert not result.ok and result.status == 302


async def test_scrape_slow_body_times_out(server_url: str) -> None:
    # One byte every 0.1 s: httpx's per-read timeout never fires, the total one must.
    async with httpx.AsyncClient() as client:
        start = time.monotonic()
        result = await scrape(client, f"{server_url}/trickle", timeout=0.5, max_bytes=1 << 20)
        took = time.monotonic() - start
    assert not result.ok and result.error is not None and "timed out" in result.error
    assert took < 1.5


async def test_scrape_connection_refused() -> None:
    with socket_on_free_port() as port:
        pass  # closed again: nothing listens there now
    async with httpx.AsyncClient() as client:
        result = await scrape(
            client, f"http://127.0.0.1:{port}/metrics", timeout=2.0, max_bytes=1024
        )
    assert not result.ok and result.error


async def test_fetch_signals_combines_replicas(server_url: str) -> None:
    urls = [f"{server_url}/metrics", f"{server_url}/old/metrics"]
    async with httpx.AsyncClient() as client:
        both = await fetch_signals(client, urls, model_name="llama", timeout=2.0, max_bytes=1 << 20)
        one_down = await fetch_signals(
            client,
            [*urls, f"{server_url}/missing"],
            model_name="llama",
            timeout=2.0,
            max_bytes=1 << 20,
        )
    assert both == Signals(running=112.0, waiting_capacity=12.0, waiting=14.0, kv_cache_usage=0.97)
    assert not one_down.ok and one_down.running is None
    assert one_down.waiting_capacity == 12.0  # proven saturation survives
    assert one_down.error is not None and "/missing: HTTP 404" in one_down.error


class socket_on_free_port:
    """Reserve a free port and release it on exit (a port nothing listens on afterwards)."""

    def __enter__(self) -> int:
        import socket

        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        port: int = self._sock.getsockname()[1]
        return port

    def __exit__(self, *exc: object) -> None:
        self._sock.close()


# --------------------------------------------------------- the project's vLLM simulator (ASGI)


@pytest.mark.parametrize("legacy", [False, True])
async def test_parses_the_vllm_simulator(legacy: bool) -> None:
    """The simulator's exposition, loaded: 2 slots busy, 3 requests queued for capacity."""
    sim = pytest.importorskip("fleetgate.tools.sim.vllm")
    app = sim.build_app(
        sim.VllmSimConfig(model="m", engines=2, capacity=2, service_ms=500, legacy_metrics=legacy)
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://sim") as client:
        calls = [
            asyncio.create_task(client.post("/v1/embeddings", json={"model": "m", "input": "x"}))
            for _ in range(5)
        ]
        expected = Signals(
            running=2.0, waiting_capacity=3.0, waiting=3.0, kv_cache_usage=1.0, preemptions=0.0
        )
        for _ in range(100):  # until all five have arrived (well inside the first 500 ms)
            sig = await fetch_signals(
                client, ["http://sim/metrics"], model_name="m", timeout=2.0, max_bytes=1 << 20
            )
            if sig == expected:
                break
            await asyncio.sleep(0.005)
        other = await fetch_signals(
            client, ["http://sim/metrics"], model_name="other", timeout=2.0, max_bytes=1 << 20
        )
        assert [r.status_code for r in await asyncio.gather(*calls)] == [200] * 5
    assert sig == expected
    assert other == Signals()
