"""Deadline values at every entry point.

``deadline=None`` or ``float("inf")`` means no deadline; NaN, zero, negative numbers and
non-numbers are a :class:`ConfigError` naming the argument, raised before anything reaches Redis.
``inf`` is exercised while parked (the waiter's expiry is derived from the deadline), not only on
a free gate.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest
import redis.asyncio as aredis
from prometheus_client import CollectorRegistry

from fleetgate.client import (
    ConfigError,
    Fleet,
    Gate,
    SyncFleet,
    SyncGate,
    compat,
    map_concurrent,
    map_concurrent_sync,
)
from fleetgate.keys import GateKeys

from ..conftest import RedisUnderTest

BAD = [math.nan, 0, 0.0, -1.0, -math.inf, True, "30"]


async def _one(x: int) -> int:
    return x + 1


async def _batch(xs: Any) -> list[int]:
    return [x + 1 for x in xs]


async def a_permit(g: Gate, dl: Any) -> Any:
    async with g.permit(deadline=dl) as lease:
        return lease.token >= 1


async def a_acquire(g: Gate, dl: Any) -> Any:
    lease = await g.acquire(deadline=dl)
    await lease.release()
    return lease.token >= 1


async def a_map(g: Gate, dl: Any) -> Any:
    return await g.map(_one, [1, 2], deadline=dl) == [2, 3]


async def a_map_batches(g: Gate, dl: Any) -> Any:
    return await g.map_batches(_batch, [1, 2, 3], batch_size=2, deadline=dl) == [2, 3, 4]


ASYNC: dict[str, Callable[[Gate, Any], Awaitable[Any]]] = {
    "permit": a_permit,
    "acquire": a_acquire,
    "map": a_map,
    "map_batches": a_map_batches,
}


def s_permit(g: SyncGate, dl: Any) -> Any:
    with g.permit(deadline=dl) as lease:
        return lease.token >= 1


def s_acquire(g: SyncGate, dl: Any) -> Any:
    lease = g.acquire(deadline=dl)
    g.release(lease)
    return lease.token >= 1


SYNC: dict[str, Callable[[SyncGate, Any], Any]] = {
    "permit": s_permit,
    "acquire": s_acquire,
    "map": lambda g, dl: g.map(_one, [1, 2], deadline=dl) == [2, 3],
    "map_batches": lambda g, dl: (
        g.map_batches(_batch, [1, 2, 3], batch_size=2, deadline=dl) == [2, 3, 4]
    ),
    "map_concurrent_sync": lambda g, dl: map_concurrent_sync(g.name, _one, [1], deadline=dl) == [2],
}


@pytest.fixture
async def fleet(rut: RedisUnderTest) -> AsyncIterator[Fleet]:
    async with Fleet(rut.url, prefix=rut.prefix, registry=CollectorRegistry()) as f:
        yield f


@pytest.fixture
def default_fleet(rut: RedisUnderTest, monkeypatch: pytest.MonkeyPatch) -> Iterator[SyncFleet]:
    """The compat functions' default fleet (``map_concurrent``...; every gate has floor 1)."""
    monkeypatch.setenv("FLEETGATE_REDIS_URL", rut.url)
    monkeypatch.setenv("FLEETGATE_PREFIX", rut.prefix)
    monkeypatch.setenv("FLEETGATE_DEFAULT_FLOOR", "1")
    compat.reset_controllers()
    yield compat._default_fleet()
    compat.reset_controllers()


async def _queue_and_holders(r: aredis.Redis, keys: GateKeys) -> tuple[int, int]:
    return await r.zcard(keys.waiters), await r.zcard(keys.holders)


async def _until_parked(r: aredis.Redis, keys: GateKeys) -> None:
    async with asyncio.timeout(10):
        while await r.zcard(keys.waiters) == 0:
            await asyncio.sleep(0.005)


@pytest.mark.parametrize("entry", list(ASYNC))
async def test_async_inf_is_no_deadline(
    entry: str, fleet: Fleet, async_redis: aredis.Redis
) -> None:
    gate = fleet.gate(f"inf-{entry}".replace("_", "-"), floor=1)
    assert await ASYNC[entry](gate, math.inf) is True  # a free gate
    held = await gate.acquire(deadline=5)
    task = asyncio.create_task(ASYNC[entry](gate, math.inf))  # parks behind `held`
    await _until_parked(async_redis, gate.keys)
    await held.release()
    assert await asyncio.wait_for(task, 10) is True
    assert await _queue_and_holders(async_redis, gate.keys) == (0, 0)


@pytest.mark.parametrize("bad", BAD, ids=repr)
@pytest.mark.parametrize("entry", list(ASYNC))
async def test_async_bad_deadline_is_config_error(
    entry: str, bad: Any, fleet: Fleet, async_redis: aredis.Redis
) -> None:
    gate = fleet.gate(f"bad-{entry}".replace("_", "-"), floor=1)
    with pytest.raises(ConfigError, match="deadline"):
        await ASYNC[entry](gate, bad)
    assert await _queue_and_holders(async_redis, gate.keys) == (0, 0)


async def test_map_concurrent_deadline_values(
    default_fleet: SyncFleet, async_redis: aredis.Redis, rut: RedisUnderTest
) -> None:
    keys = GateKeys.of(rut.prefix, "mc")
    assert await map_concurrent("mc", _one, [1, 2], deadline=math.inf) == [2, 3]
    held = await asyncio.to_thread(compat._gate("mc").acquire, 5)
    task = asyncio.create_task(map_concurrent("mc", _one, [1], deadline=math.inf))
    await _until_parked(async_redis, keys)
    await asyncio.to_thread(compat._gate("mc").release, held)
    assert await asyncio.wait_for(task, 10) == [2]
    for bad in BAD:
        with pytest.raises(ConfigError, match="deadline"):
            await map_concurrent("mc", _one, [1], deadline=bad)
    await asyncio.to_thread(default_fleet.flush)  # the map's releases are sent in the background
    assert await _queue_and_holders(async_redis, keys) == (0, 0)


@pytest.mark.parametrize("entry", list(SYNC))
def test_sync_deadline_values(entry: str, default_fleet: SyncFleet, rut: RedisUnderTest) -> None:
    """The sync twins (on the default fleet, which map_concurrent_sync uses too)."""
    name = f"sync-{entry}".replace("_", "-")
    gate = compat._gate(name)
    r = default_fleet.portal  # reads go through the fleet's loop

    async def state() -> tuple[int, int]:
        return await _queue_and_holders(default_fleet.fleet.redis, gate.gate.keys)

    assert SYNC[entry](gate, math.inf) is True
    held = gate.acquire(deadline=5)
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(SYNC[entry](gate, math.inf)))
    t.start()
    r.call(_until_parked(default_fleet.fleet.redis, gate.gate.keys))
    gate.release(held)
    t.join(10)
    assert out == [True]
    for bad in BAD:
        with pytest.raises(ConfigError, match="deadline"):
            SYNC[entry](gate, bad)
    assert r.call(state()) == (0, 0)
