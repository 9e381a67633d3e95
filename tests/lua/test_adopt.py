"""``adopt.lua`` against a real redis-server: which leases a pod back from an outage keeps,
counts again, or is told it lost (the units may have gone to another pod)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aredis

from fleetgate.keys import GateKeys
from fleetgate.scripts import GRANTED, PARKED, GateScripts
from fleetgate.settings import GateSettings
from fleetgate.tools.redisproc import RedisProcess

SHORT = GateSettings(floor=1, ceiling=1, lease_ms=50, waiter_ms=5000)
LONG = GateSettings(floor=2, ceiling=2, lease_ms=10_000)


@pytest.fixture
async def r(own_redis: RedisProcess) -> AsyncIterator[aredis.Redis]:
    client = aredis.Redis.from_url(own_redis.url, decode_responses=True)
    yield client
    await client.aclose()


async def test_an_unrenewed_lease_nobody_reaped_is_kept(r: aredis.Redis) -> None:
    """Writes were refused past the lease's TTL (NOREPLICAS, OOM): nothing reaped it, so
    nobody took its units. Kept and renewed, not lapsed, not counted twice."""
    scripts, keys = GateScripts(r), GateKeys.of("fg", "kept")
    a = await scripts.acquire(keys, "p:1", 1000, SHORT)
    assert a.status == GRANTED
    await asyncio.sleep(0.1)  # expired, and no script ran
    reply = await scripts.adopt(keys, [], [("p:1", a.expires_at)], a.fencing_token)
    assert reply.lapsed == [] and reply.added == 0
    assert await r.zscore(keys.holders, "p:1") == reply.expires_at > a.expires_at
    # Still one unit held: another pod parks.
    assert (await scripts.acquire(keys, "q:1", 1000, SHORT)).status == PARKED


async def test_a_lease_reaped_and_granted_to_another_pod_lapses(r: aredis.Redis) -> None:
    """Cut off past its TTL: reaped, its unit granted to q. Not counted again; reported."""
    scripts, keys = GateScripts(r), GateKeys.of("fg", "lapsed")
    a = await scripts.acquire(keys, "p:1", 1000, SHORT)
    await asyncio.sleep(0.1)
    assert (await scripts.acquire(keys, "q:1", 1000, SHORT)).status == GRANTED  # reaps p:1
    reply = await scripts.adopt(keys, ["p:2"], [("p:1", a.expires_at)], a.fencing_token)
    assert reply.lapsed == ["p:1"] and reply.added == 1  # the local p:2 is always counted
    assert set(await r.zrange(keys.holders, 0, -1)) == {"q:1", "p:2"}


async def test_a_lease_missing_before_its_expiry_is_counted_again(r: aredis.Redis) -> None:
    """Missing although its renewal time is ahead (the gate lost it, or its release overtook
    the adoption): counted again, as the heartbeat does."""
    scripts, keys = GateScripts(r), GateKeys.of("fg", "missing")
    a = await scripts.acquire(keys, "p:1", 1000, LONG)
    assert await scripts.release(keys, "p:1")
    reply = await scripts.adopt(keys, [], [("p:1", a.expires_at)], a.fencing_token)
    assert reply.lapsed == [] and reply.added == 1
    assert await r.zrange(keys.holders, 0, -1) == ["p:1"]


async def test_a_wiped_gate_under_its_fence_counts_every_lease_again(r: aredis.Redis) -> None:
    """Redis restarted empty: nothing was granted since, the recovery fence holds, so even a
    lease whose renewal time passed during the outage is counted again."""
    scripts, keys = GateScripts(r), GateKeys.of("fg", "wiped")
    a = await scripts.acquire(keys, "p:1", 1000, SHORT)
    await r.flushall()
    await asyncio.sleep(0.1)
    reply = await scripts.adopt(keys, [], [("p:1", a.expires_at)], a.fencing_token, fence_ms=2000)
    assert reply.lapsed == [] and reply.added == 1
    # The same lease after the fence ended, reaped and missing again: lapsed.
    await r.flushall()
    await asyncio.sleep(0.1)
    late = await scripts.adopt(keys, [], [("p:1", a.expires_at)], a.fencing_token, fence_ms=0)
    assert late.lapsed == ["p:1"] and late.added == 0
