"""What the coordinator writes to its log per poll : no line per scrape."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Literal

import pytest
from prometheus_client import CollectorRegistry

from fleetgate.coordinator.daemon import Coordinator
from fleetgate.tools.sim import serve_in_thread

from .._stub import StubValues, metrics_stub
from ..conftest import RedisUnderTest
from ._coordinator import POLL, config


@pytest.fixture
def httpx_level_unset() -> Iterator[None]:
    """Leave the httpx logger as a fresh process has it (NOTSET), and restore it afterwards."""
    httpx_log = logging.getLogger("httpx")
    saved = httpx_log.level
    httpx_log.setLevel(logging.NOTSET)
    yield
    httpx_log.setLevel(saved)


async def run_polls(coord: Coordinator, polls: int) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(coord.run(stop))
    try:
        await asyncio.sleep(polls * POLL + 0.5)
    finally:
        stop.set()
        await task


@pytest.mark.parametrize("http", ["lean", "httpx"])
async def test_no_log_line_per_scrape(
    rut: RedisUnderTest,
    caplog: pytest.LogCaptureFixture,
    httpx_level_unset: None,
    http: Literal["lean", "httpx"],
) -> None:
    caplog.set_level(logging.INFO)  # what `fleetgate coordinator` runs at
    with serve_in_thread(metrics_stub(StubValues(running=2))) as served:
        caplog.clear()  # (the stub's own start-up check polls /health through httpx)
        coord = Coordinator(
            config(rut, f"{served.url}/metrics"), registry=CollectorRegistry(), http=http
        )
        await run_polls(coord, 5)
    lines = [r.getMessage() for r in caplog.records]
    assert not [m for m in lines if "HTTP Request" in m], lines
    assert not [r for r in caplog.records if r.name.startswith("httpx")]


async def test_scrape_errors_logged_once_per_transition(
    rut: RedisUnderTest, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="fleetgate")
    with serve_in_thread(metrics_stub(StubValues(running=2))) as served:
        cfg = config(rut, f"{served.url}/nothing-here")  # 404 on every poll
        coord = Coordinator(cfg, registry=CollectorRegistry())
        await run_polls(coord, 6)
    unusable = [
        r for r in caplog.records if "metrics unusable" in r.getMessage() and r.levelno >= 20
    ]
    assert len(unusable) == 1, [r.getMessage() for r in unusable]
    assert unusable[0].levelno == logging.WARNING
