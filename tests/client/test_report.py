"""The client-observed signal against real Redis: lease.report, gate.map's classification,
and the obs counters adding up across processes."""

from __future__ import annotations

import asyncio
import collections
import multiprocessing as mp
import time

import httpx
import pytest
import redis.asyncio as aredis
from prometheus_client import CollectorRegistry

from fleetgate.client import ConfigError, Fleet, SyncFleet
from fleetgate.keys import GateKeys
from fleetgate.observed import Reading, bucket_of

from ..conftest import RedisUnderTest
from . import _observed_workers

ctx = mp.get_context("spawn")


async def obs(r: aredis.Redis, prefix: str, gate: str) -> Reading:
    return Reading.parse(await r.hgetall(GateKeys.of(prefix, gate).obs))


async def test_report_travels_with_the_release(fleet: Fleet, async_redis: aredis.Redis) -> None:
    gate = fleet.gate("rep", floor=4)
    async with gate.permit() as lease:
        lease.report("ok", 0.25)
    async with gate.permit() as lease:
        lease.report("ok", 0.1)
        lease.report("overloaded")  # a second report replaces the first
    async with gate.permit() as lease:
        await asyncio.sleep(0.05)
        lease.report("ok")  # latency: the time since the grant
    async with gate.permit():
        pass  # no report
    await gate.flush()
    got = await obs(async_redis, fleet.prefix, "rep")
    assert (got.ok, got.overloaded, got.timeout, got.error, got.lat_n) == (2, 1, 0, 0, 2)
    assert 300_000 <= got.lat_us < 400_000
    assert got.buckets[bucket_of(0.25)] == 1
    assert sum(got.buckets.values()) == 2
    stats = await async_redis.hgetall(GateKeys.of(fleet.prefix, "rep").stats)
    assert stats["released"] == "4"


async def test_report_refuses_unknown_outcomes_and_bad_latencies(fleet: Fleet) -> None:
    async with fleet.gate("bad", floor=1).permit() as lease:
        for outcome in ("OK", "429", "", None):
            with pytest.raises(ConfigError, match="outcome"):
                lease.report(outcome)  # type: ignore[arg-type]
        for latency in (-1.0, float("nan"), float("inf"), "1", True):
            with pytest.raises(ConfigError, match="latency"):
                lease.report("ok", latency)  # type: ignore[arg-type]


async def test_reports_ride_with_acquires(fleet: Fleet, async_redis: aredis.Redis) -> None:
    """A release queued behind an acquire of the same gate leaves with the acquire call."""
    gate = fleet.gate("ride", floor=64)

    async def one(i: int) -> None:
        async with gate.permit() as lease:
            await asyncio.sleep(0.001 * (i % 3))
            lease.report("ok" if i % 4 else "timeout", 0.002)

    await asyncio.gather(*(one(i) for i in range(200)))
    await gate.flush()
    got = await obs(async_redis, fleet.prefix, "ride")
    assert (got.ok, got.timeout, got.lat_n, got.lat_us) == (150, 50, 150, 150 * 2000)


async def test_a_broken_obs_key_never_fails_a_release(
    fleet: Fleet, async_redis: aredis.Redis
) -> None:
    keys = GateKeys.of(fleet.prefix, "broken")
    await async_redis.set(keys.obs, "not a hash")
    gate = fleet.gate("broken", floor=1)
    for _ in range(3):
        async with gate.permit() as lease:
            lease.report("ok", 0.1)
    await gate.flush()
    assert await async_redis.zcard(keys.holders) == 0
    assert await async_redis.hget(keys.stats, "released") == "3"


def test_counts_add_up_across_processes(rut: RedisUnderTest) -> None:
    with ctx.Pool(4) as pool:
        sent = pool.starmap(
            _observed_workers.report_many, [(rut.url, rut.prefix, "many", 150, s) for s in range(4)]
        )
    expected: collections.Counter[str] = collections.Counter()
    for part in sent:
        expected.update(part)

    async def read() -> dict[str, str]:
        r = aredis.Redis.from_url(rut.url, decode_responses=True)
        try:
            return await r.hgetall(GateKeys.of(rut.prefix, "many").obs)
        finally:
            await r.aclose()

    stored = {k: int(v) for k, v in asyncio.run(read()).items()}
    assert stored == dict(expected)
    assert sum(stored[o] for o in ("ok", "overloaded", "timeout", "error") if o in stored) == 600


def _transport(status_of: dict[str, int | Exception], delay: float = 0.0) -> httpx.MockTransport:
    async def handle(request: httpx.Request) -> httpx.Response:
        outcome = status_of[request.url.path.strip("/")]
        if delay:
            await asyncio.sleep(delay)
        if isinstance(outcome, Exception):
            raise outcome
        return httpx.Response(outcome, request=request)

    return httpx.MockTransport(handle)


async def test_map_classifies_httpx_responses_and_errors(
    fleet: Fleet, async_redis: aredis.Redis
) -> None:
    plan: dict[str, int | Exception] = {
        "ok": 200,
        "created": 201,
        "busy": 429,
        "unavailable": 503,
        "anthropic": 529,
        "bad": 400,
        "gateway": 504,
        "read-timeout": httpx.ReadTimeout("slow"),
        "connect": httpx.ConnectError("refused"),
    }
    async with httpx.AsyncClient(transport=_transport(plan, 0.02), base_url="http://m") as http:

        async def call(path: str) -> httpx.Response:
            return await http.get(f"/{path}")

        results = await fleet.gate("cls", floor=16).map(
            call, list(plan), retry=False, return_exceptions=True
        )
    assert [r.status_code for r in results[:7]] == [200, 201, 429, 503, 529, 400, 504]
    await fleet.gate("cls").flush()
    got = await obs(async_redis, fleet.prefix, "cls")
    assert (got.ok, got.overloaded, got.timeout, got.error) == (2, 3, 2, 2)
    assert got.lat_n == 2 and 0.02 <= got.lat_us / 2e6 < 1.0


async def test_map_reports_raised_status_errors_and_timeouts(
    fleet: Fleet, async_redis: aredis.Redis
) -> None:
    async with httpx.AsyncClient(
        transport=_transport({"busy": 429, "ok": 200}), base_url="http://m"
    ) as http:

        async def call(path: str) -> int:
            if path == "slow":
                await asyncio.sleep(5)
            response = await http.get(f"/{path}")
            response.raise_for_status()  # a 429 raised: still overloaded
            return response.status_code

        out = await fleet.gate("raised", floor=4).map(
            call, ["ok", "busy", "slow"], retry=False, return_exceptions=True, call_timeout=0.2
        )
    assert out[0] == 200
    assert isinstance(out[1], httpx.HTTPStatusError) and isinstance(out[2], TimeoutError)
    await fleet.gate("raised").flush()
    got = await obs(async_redis, fleet.prefix, "raised")
    assert (got.ok, got.overloaded, got.timeout, got.error) == (1, 1, 1, 0)


async def test_map_retried_overload_is_reported_as_overload(
    fleet: Fleet, async_redis: aredis.Redis
) -> None:
    attempts = {"n": 0}

    async def flaky(_: int) -> httpx.Response:
        attempts["n"] += 1
        req = httpx.Request("GET", "http://m/")
        if attempts["n"] == 1:
            raise httpx.HTTPStatusError(
                "busy", request=req, response=httpx.Response(503, request=req)
            )
        return httpx.Response(200, request=req)

    await fleet.gate("retried", floor=1).map(flaky, [1])
    await fleet.gate("retried").flush()
    got = await obs(async_redis, fleet.prefix, "retried")
    assert attempts["n"] == 2 and (got.ok, got.overloaded) == (0, 1)


async def test_a_cancelled_call_reports_nothing(fleet: Fleet, async_redis: aredis.Redis) -> None:
    gate = fleet.gate("cancel", floor=8)
    started = asyncio.Event()

    async def call(i: int) -> int:
        if i == 0:
            await started.wait()
            raise ValueError("first failure cancels the siblings")
        started.set()
        await asyncio.sleep(10)
        return i

    with pytest.raises(ValueError):
        await gate.map(call, range(5), retry=False)
    # deadline fired mid-call: cancelled, nothing reported either
    from fleetgate.client import DeadlineExceeded

    with pytest.raises(DeadlineExceeded):
        await gate.map(lambda i: asyncio.sleep(10), range(3), deadline=0.2)
    await gate.flush()
    got = await obs(async_redis, fleet.prefix, "cancel")
    assert (got.ok, got.overloaded, got.timeout, got.error) == (0, 0, 0, 1)


def test_sync_face_reports_through_the_async_core(rut: RedisUnderTest) -> None:
    with SyncFleet(rut.url, prefix=rut.prefix, registry=CollectorRegistry()) as fleet:
        gate = fleet.gate("sync", floor=2)
        with gate.permit() as lease:
            time.sleep(0.01)
            lease.report("ok")
        gate.map(lambda i: i, [1, 2, 3])
        fleet.flush()

    async def read() -> Reading:
        r = aredis.Redis.from_url(rut.url, decode_responses=True)
        try:
            return await obs(r, rut.prefix, "sync")
        finally:
            await r.aclose()

    got = asyncio.run(read())
    assert (got.ok, got.lat_n) == (4, 4)
