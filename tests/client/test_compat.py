"""The compat functions (``agent_utilities``' ``model_concurrency`` names) on the default fleet
from the environment (real Redis)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest

from fleetgate.client import (
    ConfigError,
    get_utilization,
    map_concurrent,
    map_concurrent_sync,
    reset_controllers,
    resolve_capacity,
)

from ..conftest import RedisUnderTest


@pytest.fixture(autouse=True)
def default_fleet(rut: RedisUnderTest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("FLEETGATE_REDIS_URL", rut.url)
    monkeypatch.setenv("FLEETGATE_PREFIX", rut.prefix)
    monkeypatch.setenv("FLEETGATE_FLOORS", "seq=1,three=3")
    reset_controllers()
    yield
    reset_controllers()


class Peak:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now = self.peak = 0

    def enter(self) -> None:
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)

    def leave(self) -> None:
        with self.lock:
            self.now -= 1


async def test_capacity_one_is_sequential() -> None:
    peak = Peak()

    async def fn(x: int) -> int:
        peak.enter()
        await asyncio.sleep(0.01)
        peak.leave()
        return x

    assert await map_concurrent("seq", fn, range(8)) == list(range(8))
    assert peak.peak == 1


def test_capacity_k_runs_at_most_k_sync() -> None:
    peak = Peak()

    def fn(x: int) -> int:
        peak.enter()
        time.sleep(0.02)
        peak.leave()
        return -x

    assert map_concurrent_sync("three", fn, range(12)) == [-x for x in range(12)]
    assert peak.peak == 3


async def test_empty_single_and_sync_fn_on_async_path() -> None:
    assert await map_concurrent("three", lambda x: x, []) == []
    assert await map_concurrent("three", lambda x: x * 2, [21]) == [42]
    assert map_concurrent_sync("three", lambda x: x, []) == []


async def test_exceptions_reraised_and_nothing_leaks() -> None:
    async def fn(x: int) -> int:
        if x == 3:
            raise KeyError("three")
        return x

    with pytest.raises(KeyError):
        await map_concurrent("three", fn, range(6))
    with pytest.raises(KeyError):
        map_concurrent_sync("three", lambda x: {}[x], [1])
    util = get_utilization("three")
    assert util["in_flight"] == 0 and util["queued"] == 0


def test_resolve_capacity_and_utilization_fields() -> None:
    assert resolve_capacity("three") == 3
    assert resolve_capacity("unlisted") == 1
    util = get_utilization("three")
    for field in (
        "running",
        "waiting_capacity",
        "current_target",
        "floor",
        "ceiling",
        "metrics_ok",
        "saturated",
        "last_poll",
        "metrics_url",
        "in_flight",
        "queued",
    ):
        assert field in util
    assert util["current_target"] == 3 and util["floor"] == 3


def test_bad_floor_env_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETGATE_FLOORS", "x=zero")
    with pytest.raises(ConfigError, match=r"FLEETGATE_FLOORS\[x\]"):
        resolve_capacity("x")
