"""The Lua scripts against a real redis-server, one transition at a time."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aredis

from fleetgate.admission import class_member, lane_class, member_id
from fleetgate.keys import GateKeys
from fleetgate.observed import encode_report, tally
from fleetgate.scripts import GRANTED, PARKED, REJECTED, GateScripts
from fleetgate.settings import GateSettings
from fleetgate.tools.redisproc import RedisProcess

from ..conftest import RedisUnderTest

# the scripts against each server of the matrix (tests/_servers.py)
pytestmark = pytest.mark.servers


@pytest.fixture
def keys(rut: RedisUnderTest) -> GateKeys:
    return GateKeys.of(rut.prefix, "rerank/nemo-500m")


@pytest.fixture
def scripts(async_redis: aredis.Redis) -> GateScripts:
    return GateScripts(async_redis)


async def queue_ids(r: aredis.Redis, keys: GateKeys) -> list[str]:
    """The waiters' ids in their lanes' order (FIFO for the default lane)."""
    return [member_id(m) for m in await r.zrange(keys.lanes, 0, -1)]


D2 = GateSettings(floor=2, ceiling=8, max_queued=3, lease_ms=10_000, waiter_ms=5_000)


async def test_grant_park_reject_and_fifo_handoff(
    scripts: GateScripts, keys: GateKeys, async_redis: aredis.Redis
) -> None:
    a = await scripts.acquire(keys, "p1:1", 1000, D2)
    b = await scripts.acquire(keys, "p2:1", 1000, D2)
    assert (a.status, b.status) == (GRANTED, GRANTED)
    assert b.token > a.token
    parked = [await scripts.acquire(keys, f"p{i}:2", 1000, D2) for i in (1, 2, 3)]
    assert [p.status for p in parked] == [PARKED] * 3
    assert [p.position for p in parked] == [1, 2, 3]
    full = await scripts.acquire(keys, "p4:1", 1000, D2)
    assert full.status == REJECTED and full.bound == 3
    assert await async_redis.zcard(keys.waiters) == 3
    assert await async_redis.hget(keys.stats, "rejected") == "1"

    # Releasing hands the slot to the head waiter inside the same script and wakes its pod.
    assert await scripts.release(keys, "p1:1") is True
    assert await async_redis.zscore(keys.holders, "p1:2") is not None
    [wake] = await async_redis.lrange(keys.wake("p1"), 0, -1)
    assert wake.startswith("p1:2=") and int(wake.partition("=")[2]) > b.token
    assert await async_redis.pttl(keys.wake("p1")) > 0
    # Double release frees nothing more.
    assert await scripts.release(keys, "p1:1") is False
    assert await async_redis.zcard(keys.holders) == 2
    assert await queue_ids(async_redis, keys) == ["p2:2", "p3:2"]


async def test_no_barging_when_someone_is_parked(
    scripts: GateScripts, keys: GateKeys, async_redis: aredis.Redis
) -> None:
    d = GateSettings(floor=1, ceiling=1)
    assert (await scripts.acquire(keys, "a:1", 1000, d)).status == GRANTED
    assert (await scripts.acquire(keys, "b:1", 1000, d)).status == PARKED
    # Make a slot free without hand-off by deleting the holder behind the scripts' back.
    await async_redis.zrem(keys.holders, "a:1")
    # A newcomer sees the queue first: the head is granted, the newcomer parks behind.
    c = await scripts.acquire(keys, "c:1", 1000, d)
    assert c.status == PARKED
    assert await async_redis.zrange(keys.holders, 0, -1) == ["b:1"]


async def test_max_queued_zero_fails_fast_when_full(scripts: GateScripts, keys: GateKeys) -> None:
    d = GateSettings(floor=1, ceiling=1, max_queued=0)
    assert (await scripts.acquire(keys, "a:1", 1000, d)).status == GRANTED
    assert (await scripts.acquire(keys, "a:2", 1000, d)).status == REJECTED


async def test_cancel_leaves_queue_or_releases_raced_grant(
    scripts: GateScripts, keys: GateKeys, async_redis: aredis.Redis
) -> None:
    d = GateSettings(floor=1, ceiling=1)
    await scripts.acquire(keys, "a:1", 1000, d)
    b = await scripts.acquire(keys, "b:1", 1000, d)
    await scripts.acquire(keys, "c:1", 1000, d)
    assert await scripts.cancel(keys, "b:1", class_member("", b.token, "b:1")) == 1
    assert await queue_ids(async_redis, keys) == ["c:1"]
    await scripts.release(keys, "a:1")  # c granted
    assert await scripts.cancel(keys, "c:1") == 2  # the grant raced in: released
    assert await async_redis.zcard(keys.holders) == 0
    assert await scripts.cancel(keys, "c:1") == 0


async def test_expired_lease_is_reaped_and_late_release_frees_nothing(
    scripts: GateScripts, keys: GateKeys, async_redis: aredis.Redis
) -> None:
    d = GateSettings(floor=1, ceiling=1, lease_ms=100, waiter_ms=5000)
    await scripts.acquire(keys, "a:1", 1000, d)
    assert (await scripts.acquire(keys, "b:1", 5000, d)).status == PARKED
    await asyncio.sleep(0.2)
    # Any call reaps the expired lease and hands the slot to b.
    hb = await scripts.heartbeat(keys, "a", 3000, [("a:1", 0)], [])
    assert hb.lost_leases == ["a:1"]
    assert await async_redis.zrange(keys.holders, 0, -1) == ["b:1"]
    assert await scripts.release(keys, "a:1") is False
    assert await async_redis.zrange(keys.holders, 0, -1) == ["b:1"]
    assert await async_redis.hget(keys.stats, "expired_leases") == "1"


async def test_heartbeat_reports_granted_waiters_and_renews(
    scripts: GateScripts, keys: GateKeys, async_redis: aredis.Redis
) -> None:
    d = GateSettings(floor=1, ceiling=1, waiter_ms=300)
    await scripts.acquire(keys, "a:1", 1000, d)
    b = await scripts.acquire(keys, "b:1", 10_000, d)
    member = class_member("", b.token, "b:1")
    before = await async_redis.zscore(keys.waiters, member)
    await asyncio.sleep(0.05)
    hb = await scripts.heartbeat(keys, "b", 3000, [], [(member, 10_000)])
    assert hb.granted_waiters == [] and hb.lost_waiters == []
    assert await async_redis.zscore(keys.waiters, member) > before
    await scripts.release(keys, "a:1")
    [wake] = await async_redis.lrange(keys.wake("b"), 0, -1)
    hb = await scripts.heartbeat(keys, "b", 3000, [], [(member, 10_000)])
    assert hb.granted_waiters == ["b:1"]
    # the grant's token as the heartbeat tells it: fresh, above the one the wake carried
    assert hb.granted_tokens[0] > int(wake.partition("=")[2]) > b.token
    assert hb.live_pods == 1


async def test_set_target_epoch_fencing_growth_and_expiry(
    scripts: GateScripts, keys: GateKeys, async_redis: aredis.Redis
) -> None:
    d = GateSettings(floor=1, ceiling=4)
    await scripts.acquire(keys, "a:1", 1000, d)
    for i in range(3):
        assert (await scripts.acquire(keys, f"w:{i}", 5000, d)).status == PARKED
    assert await scripts.set_target(keys, 3, epoch=5, ttl_ms=300) is True
    assert await async_redis.zcard(keys.holders) == 3  # growth handed off at once
    assert await scripts.set_target(keys, 4, epoch=4, ttl_ms=300) is False  # stale epoch
    assert await async_redis.hget(keys.target, "value") == "3"
    assert await scripts.set_target(keys, 100, epoch=5, ttl_ms=60_000) is True
    assert (await scripts.snapshot(keys)).limit == 4  # clamped to the ceiling
    assert await scripts.set_target(keys, 2, epoch=6, ttl_ms=100) is True
    await asyncio.sleep(0.15)
    assert (await scripts.snapshot(keys)).limit == 1  # expired target -> floor


async def test_inspect_snapshot(scripts: GateScripts, keys: GateKeys) -> None:
    snap = await scripts.snapshot(keys)
    assert snap.holders == 0 and snap.head == [] and snap.leases == []
    d = GateSettings(floor=1, ceiling=1)
    await scripts.acquire(keys, "a:1", 1000, d)
    await scripts.acquire(keys, "b:1", 1000, d)
    snap = await scripts.snapshot(keys)
    assert (snap.holders, snap.queued, snap.limit) == (1, 1, 1)
    assert [w.id for w in snap.head] == ["b:1"]
    assert [h.id for h in snap.leases] == ["a:1"]
    assert snap.cfg["floor"] == "1"


async def test_scripts_write_only_the_keys_gate_keys_names(
    scripts: GateScripts, keys: GateKeys, async_redis: aredis.Redis
) -> None:
    """The scripts get the gate's base name alone and derive every key (lua/lib_gate.lua): each key
    they write is one GateKeys names, and each data key GateKeys names is the one written."""
    d = GateSettings(floor=1, ceiling=4, max_queued=3, lease_ms=10_000, waiter_ms=5_000)
    assert (await scripts.acquire(keys, "pa:1", 5_000, d)).status == GRANTED
    b = await scripts.acquire(keys, "pb:2", 5_000, d)
    assert b.status == PARKED
    assert (await scripts.acquire(keys, "pc:3", 5_000, d)).status == PARKED
    # weight 3 above the limit (1): its lane waits in big
    assert (await scripts.acquire_many(keys, [("pd:4w3", 5_000, "100}t")], d))[0].status == PARKED
    # the list is full: priority 10 evicts the newest waiter of band 0 (pc:3)
    [e] = await scripts.acquire_many(keys, [("pe:5b090", 5_000, lane_class(10, None))], d)
    assert e.status == PARKED
    assert await async_redis.lrange(keys.wake("pc"), 0, -1) == ["pc:3=x"]
    await scripts.heartbeat(keys, "pb", 10_000, [], [(class_member("", b.token, "pb:2"), 5_000)])
    await scripts.publish(
        keys, epoch=1, ttl_ms=10_000, target=1, cfg={"tenant_weights": "t}2"}, util={"running": 1}
    )
    # hands the slot to pe:5 (band 10), wakes pe; the call's report goes to fg:{G}:obs
    assert await scripts.release_many(keys, ["pa:1"], tally([encode_report("ok", 0.01)])) == 1
    found = {k async for k in async_redis.scan_iter(match=f"{keys.base}:*")}
    assert found == {*keys.data_keys(), keys.wake("pc"), keys.wake("pe")}
    assert await async_redis.zrange(keys.holders, 0, -1) == ["pe:5b090"]
    assert sorted(await queue_ids(async_redis, keys)) == ["pb:2", "pd:4w3"]
    [wake] = await async_redis.lrange(keys.wake("pe"), 0, -1)
    assert wake.startswith("pe:5b090=")


@pytest.fixture
async def r(own_redis: RedisProcess) -> AsyncIterator[aredis.Redis]:
    client = aredis.Redis.from_url(own_redis.url, decode_responses=True)
    yield client
    await client.aclose()


async def test_heartbeat_adopts_leases_the_gate_lost_before_they_expired(
    r: aredis.Redis,
) -> None:
    scripts = GateScripts(r)
    keys = GateKeys.of("fg", "wiped")
    d = GateSettings(floor=2, ceiling=2, lease_ms=5000)
    a = await scripts.acquire(keys, "p:1", 1000, d)
    b = await scripts.acquire(keys, "p:2", 1000, d)
    await r.flushall()  # a restart without persistence
    await asyncio.sleep(0.005)  # the renewal below must land in a later millisecond than the grant
    hb = await scripts.heartbeat(
        keys, "p", 10_000, [("p:1", a.expires_at), ("p:2", 0)], [], max_token=b.token, defaults=d
    )
    # p:1 was seen renewed to a time still ahead: the gate lost it, so it counts again. p:2's
    # expiry is unknown to the pod: reported lost (it may have expired).
    assert hb.adopted == ["p:1"] and hb.lost_leases == ["p:2"]
    assert await r.zrange(keys.holders, 0, -1) == ["p:1"]
    assert hb.pod_new and hb.expires_at > a.expires_at
    # A lease whose renewal time has passed is lost, never revived.
    await asyncio.sleep(0.05)
    past = await scripts.heartbeat(keys, "p", 10_000, [("p:3", 1)], [], defaults=d)
    assert past.lost_leases == ["p:3"] and past.adopted == []


async def test_handoff_skips_waiters_that_died_beyond_one_reap(r: aredis.Redis) -> None:
    """100 parked waiters die at once (more than one reap removes), then a slot frees: it goes
    to the live waiter behind them, not to a dead head (where it would idle for a lease TTL).
    """
    scripts = GateScripts(r)
    keys = GateKeys.of("fg", "dead-heads")
    d = GateSettings(floor=1, ceiling=1, max_queued=1000)
    assert (await scripts.acquire(keys, "holder:1", 1000, d)).status == 1
    for i in range(100):
        assert (await scripts.acquire(keys, f"dead:{i}", 100, d)).status == PARKED
    assert (await scripts.acquire(keys, "live:1", 60_000, d)).status == PARKED
    await asyncio.sleep(0.2)  # every dead waiter's entry has expired
    assert await scripts.release(keys, "holder:1")
    assert await r.zrange(keys.holders, 0, -1) == ["live:1"]
    [wake] = await r.lrange(keys.wake("live"), 0, -1)
    assert wake.partition("=")[0] == "live:1"  # <id>=<token>
    assert await r.zcard(keys.waiters) == 0 and await r.zcard(keys.waiters) == 0
    assert int(await r.hget(keys.stats, "abandoned_waiters") or 0) == 100
