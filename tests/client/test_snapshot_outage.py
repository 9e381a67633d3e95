"""Reads of a gate in an outage raise fleetgate's :class:`RedisUnavailable`, naming the URL
(without its password: tests/core/test_secrets.py), like every other client call:
``fleet.utilization()``, ``gate.snapshot()`` and ``gate.capacity()``, async and blocking, in both
``on_redis_error`` modes (a read has no fallback). Before: redis-py's ``ConnectionError``, which
``except FleetgateError`` missed."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from fleetgate.client import Fleet, RedisUnavailable, SyncFleet
from fleetgate.errors import FleetgateError
from fleetgate.tools.redisproc import RedisProcess


def _assert_mapped(exc: BaseException, proc: RedisProcess) -> None:
    assert isinstance(exc, RedisUnavailable) and isinstance(exc, FleetgateError)
    assert f"Redis at {proc.url} is unreachable" in str(exc), str(exc)
    assert exc.__cause__ is not None  # redis-py's error, kept as the cause


@pytest.mark.parametrize("mode", ["fair_share", "fail"])
async def test_async_reads_in_an_outage_raise_redis_unavailable(
    own_redis: RedisProcess, mode: str
) -> None:
    async with Fleet(
        own_redis.url,
        registry=CollectorRegistry(),
        heartbeat_interval=0.2,
        on_redis_error=mode,  # type: ignore[arg-type]
    ) as fleet:
        gate = fleet.gate("reads", floor=3)
        async with gate.permit(deadline=10):
            pass
        assert (await fleet.utilization("reads")).limit == 3  # reads work while Redis does
        own_redis.kill()
        for read in (fleet.utilization("reads"), gate.snapshot(), gate.capacity()):
            with pytest.raises(FleetgateError) as caught:
                await asyncio.wait_for(read, 10)
            _assert_mapped(caught.value, own_redis)
        own_redis.start()  # and again once it answers (a fresh, empty server)
        assert (await gate.snapshot()).limit == 3


def test_blocking_reads_in_an_outage_raise_redis_unavailable(own_redis: RedisProcess) -> None:
    with SyncFleet(own_redis.url, registry=CollectorRegistry(), heartbeat_interval=0.2) as fleet:
        gate = fleet.gate("reads", floor=3)
        with gate.permit(deadline=10):
            pass
        assert fleet.utilization("reads").limit == 3
        own_redis.kill()
        with pytest.raises(FleetgateError) as caught:
            fleet.utilization("reads")
        _assert_mapped(caught.value, own_redis)
        with pytest.raises(FleetgateError) as caught:
            gate.capacity()
        _assert_mapped(caught.value, own_redis)
