"""Coordinators for the tests: in-process (:func:`config_with` a config that polls every
:data:`POLL` s, :func:`running`, :func:`eventually`) and as ``fleetgate coordinator`` OS
processes (:func:`start`; the ``procs`` fixture of the room's conftest reaps them)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from prometheus_client import CollectorRegistry

from fleetgate.coordinator.config import Config
from fleetgate.coordinator.daemon import Coordinator

from ..conftest import RedisUnderTest

POLL = 0.3


def config_with(rut: RedisUnderTest, gates: str, *, adaptive: bool = True) -> Config:
    """A test coordinator's config (polls every POLL s, no jitter, metrics on a free port) with
    the ``[[gates]]`` tables ``gates``."""
    return Config.from_toml_text(
        f"""
[redis]
url = "{rut.url}"
prefix = "{rut.prefix}"
[coordinator]
poll_interval = {POLL}
poll_jitter = 0.0
leader_ttl = 2.0
metrics_listen = "127.0.0.1:0"
scrape_timeout = 0.25
adaptive = {"true" if adaptive else "false"}
{gates}""",
        env={},
    )


def config(rut: RedisUnderTest, metrics_url: str | None, *, adaptive: bool = True) -> Config:
    """Two gates: ``llm`` (floor 4, ceiling 64, its signals at ``metrics_url``) and a fixed
    ``rerank`` (floor 3)."""
    source = f'metrics_url = "{metrics_url}"' if metrics_url else ""
    gates = f"""
[[gates]]
name = "llm"
floor = 4
ceiling = 64
max_queued = 1000
{source}
[[gates]]
name = "rerank"
floor = 3
"""
    return config_with(rut, gates, adaptive=adaptive)


@asynccontextmanager
async def running(cfg: Config) -> AsyncIterator[Coordinator]:
    """A coordinator running on this loop for the block, stopped and awaited after it."""
    stop = asyncio.Event()
    coord = Coordinator(cfg, registry=CollectorRegistry())
    task = asyncio.create_task(coord.run(stop))
    try:
        yield coord
    finally:
        stop.set()
        await task


async def eventually(check: Callable[[], object], timeout: float, what: str) -> float:
    """Seconds until ``check()`` (awaited if a coroutine) is true; fails naming ``what`` after
    ``timeout``."""
    start = time.monotonic()
    while True:
        value = check()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def start(config: Path, cid: str) -> subprocess.Popen[bytes]:
    """``fleetgate coordinator --config <config> --id <cid>`` as a child process (stderr piped)."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fleetgate.cli",
            "coordinator",
            "--config",
            str(config),
            "--id",
            cid,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
