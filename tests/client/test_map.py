"""gate.map: fan-out cap, total deadline, retries inside the permit, fail-fast (real Redis)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from collections.abc import AsyncIterator

import httpx
import pytest
import redis.asyncio as aredis
from prometheus_client import CollectorRegistry
from tenacity import AsyncRetrying, stop_after_attempt, wait_none

from fleetgate.client import (
    ConfigError,
    DeadlineExceeded,
    Fleet,
    FleetgateWarning,
    Overloaded,
    SyncFleet,
    is_transient,
)

from .. import _workers
from ..conftest import RedisUnderTest


class Meter:
    """Counts calls and the peak of concurrent calls."""

    def __init__(self) -> None:
        self.now = self.peak = self.calls = 0

    async def run(self, seconds: float) -> None:
        self.calls += 1
        self.now += 1
        self.peak = max(self.peak, self.now)
        try:
            await asyncio.sleep(seconds)
        finally:
            self.now -= 1


async def granted(r: aredis.Redis, fleet: Fleet, gate: str) -> int:
    return int(await r.hget(fleet.gate(gate).keys.stats, "granted") or 0)


async def test_batches_fan_out_cap_and_order(fleet: Fleet, async_redis: aredis.Redis) -> None:
    gate = fleet.gate("rerank", floor=32)
    meter = Meter()
    passages = [f"p{i}" for i in range(100)]

    async def rerank(batch: list[str]) -> list[str]:
        await meter.run(0.05)
        return [p.upper() for p in batch]

    out = await gate.map_batches(rerank, passages, batch_size=10, max_in_flight=3)
    assert out == [p.upper() for p in passages]
    assert meter.calls == 10 and meter.peak <= 3
    assert meter.peak == 3  # the cap was reached, not an accidental serialisation
    assert await granted(async_redis, fleet, "rerank") == 10


async def test_indexed_batches_merge_to_original_positions(fleet: Fleet) -> None:
    gate = fleet.gate("nim", floor=4)

    async def rank(batch: list[int]) -> list[tuple[int, int]]:
        # A reranker answers (index within the batch, score) sorted by score, not by index.
        return sorted(((i, v * 10) for i, v in enumerate(batch)), key=lambda p: -p[1])

    out = await gate.map_batches(rank, list(range(25)), batch_size=512, indexed=True)
    assert out == [v * 10 for v in range(25)]


async def test_deadline_while_parked_never_calls_fn(
    fleet: Fleet, async_redis: aredis.Redis
) -> None:
    gate = fleet.gate("busy", floor=1)
    held = await gate.acquire()
    called: list[int] = []

    async def fn(x: int) -> int:
        called.append(x)
        return x

    with pytest.raises(DeadlineExceeded, match=r"200 ms.*queue wait, calls and retries"):
        await gate.map(fn, range(5), deadline=0.2)
    assert called == []
    await fleet.runtime.drain(timeout=5.0)  # the cancels leave in the background (0.25 s wait)
    assert await async_redis.zcard(gate.keys.waiters) == 0
    await held.release()


async def test_deadline_mid_call_releases(
    fleet: Fleet, async_redis: aredis.Redis, registry: CollectorRegistry
) -> None:
    gate = fleet.gate("mid", floor=4)
    started = asyncio.Event()

    async def slow(_: int) -> None:
        started.set()
        await asyncio.sleep(10)

    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="300 ms"):
        await gate.map(slow, range(3), deadline=0.3)
    assert time.monotonic() - t0 < 1.5
    assert started.is_set()
    assert await async_redis.zcard(gate.keys.holders) == 0
    assert await async_redis.zcard(gate.keys.waiters) == 0
    assert registry.get_sample_value("fleetgate_client_deadline_exceeded_total", {"gate": "mid"})


async def test_overload_is_never_retried_and_fn_not_called(
    fleet: Fleet, async_redis: aredis.Redis
) -> None:
    gate = fleet.gate("full", floor=1, max_queued=0)
    held = await gate.acquire()
    calls: list[int] = []

    async def fn(x: int) -> int:
        calls.append(x)
        return x

    with pytest.raises(Overloaded):
        await gate.map(fn, [1], retry=AsyncRetrying(stop=stop_after_attempt(5), wait=wait_none()))
    assert calls == []
    assert await async_redis.hget(gate.keys.stats, "rejected") == "1"  # one attempt, not five
    await held.release()


async def test_transient_error_retried_inside_the_permit(
    fleet: Fleet, async_redis: aredis.Redis, registry: CollectorRegistry
) -> None:
    gate = fleet.gate("flaky", floor=2)
    attempts = 0

    async def fn(x: int) -> int:
        nonlocal attempts
        attempts += 1
        if attempts < 3:
            raise TimeoutError("read timeout")
        return x * 2

    assert await gate.map(fn, [21]) == [42]
    assert attempts == 3
    assert await granted(async_redis, fleet, "flaky") == 1  # never re-queued
    assert registry.get_sample_value("fleetgate_client_retries_total", {"gate": "flaky"}) == 2
    calls = registry.get_sample_value("fleetgate_client_calls_per_request_sum", {"gate": "flaky"})
    assert calls == 3


async def test_first_failure_cancels_siblings_and_frees_permits(
    fleet: Fleet, async_redis: aredis.Redis
) -> None:
    gate = fleet.gate("ff", floor=10)  # every call holds a permit when item 0 fails
    finished: list[int] = []

    async def fn(x: int) -> int:
        if x == 0:
            await asyncio.sleep(0.05)
            raise ValueError("bad item")
        await asyncio.sleep(5)
        finished.append(x)
        return x

    t0 = time.monotonic()
    with pytest.raises(ValueError, match="bad item"):
        await gate.map(fn, range(10), max_in_flight=10)
    assert time.monotonic() - t0 < 2
    assert finished == []
    assert await async_redis.zcard(gate.keys.holders) == 0
    assert await async_redis.zcard(gate.keys.waiters) == 0


async def test_return_exceptions_gives_per_item_outcomes(fleet: Fleet) -> None:
    gate = fleet.gate("per-item", floor=2)

    async def fn(x: int) -> int:
        if x % 2:
            raise ValueError(x)
        return x

    out = await gate.map(fn, range(4), retry=False, return_exceptions=True)
    assert out[0] == 0 and out[2] == 2
    assert isinstance(out[1], ValueError) and isinstance(out[3], ValueError)


async def test_sync_fn_and_async_iterable(fleet: Fleet) -> None:
    gate = fleet.gate("mixed", floor=2)

    async def items() -> AsyncIterator[int]:
        for i in range(6):
            yield i

    assert await gate.map(lambda x: x + 1, items()) == [1, 2, 3, 4, 5, 6]


async def test_validation_and_deadline_warning(fleet: Fleet) -> None:
    gate = fleet.gate("v", floor=1)
    with pytest.raises(ConfigError, match="max_in_flight"):
        await gate.map(lambda x: x, [1], max_in_flight=0)
    with pytest.warns(FleetgateWarning, match="shorter than the per-call timeout"):
        await gate.map(lambda x: x, [1], deadline=1.0, call_timeout=5.0)


def test_transient_predicate() -> None:
    request = httpx.Request("POST", "http://x/v1/ranking")
    assert is_transient(TimeoutError())
    assert is_transient(httpx.ReadTimeout("slow", request=request))
    err503 = httpx.HTTPStatusError("503", request=request, response=httpx.Response(503))
    err400 = httpx.HTTPStatusError("400", request=request, response=httpx.Response(400))
    assert is_transient(err503) and not is_transient(err400)
    assert not is_transient(Overloaded("g", 1))
    assert not is_transient(DeadlineExceeded("g", 10))
    assert not is_transient(ValueError())


def test_sync_map(rut: RedisUnderTest) -> None:
    with SyncFleet(rut.url, prefix=rut.prefix, registry=CollectorRegistry()) as fleet:
        gate = fleet.gate("sync-map", floor=2)
        assert gate.map(lambda x: x * x, range(5)) == [0, 1, 4, 9, 16]
        with pytest.raises(DeadlineExceeded):
            gate.map(lambda x: time.sleep(1), range(2), deadline=0.2)
        assert fleet.utilization("sync-map").in_flight == 0


def test_two_processes_share_limit_one(rut: RedisUnderTest) -> None:
    probe = f"{rut.prefix}:probe"
    with mp.get_context("spawn").Pool(2) as pool:
        peaks = pool.starmap(
            _workers.map_with_probe, [(rut.url, rut.prefix, "one", 8, 0.02, probe)] * 2
        )
    assert max(peaks) == 1
