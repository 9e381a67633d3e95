"""Who is granted first, against a real redis-server (the fleet across several OS processes
where it matters): strict bands and FIFO within a tenant, tenants' shares of a band, the
per-tenant bound, heavy heads reserved for and oversize ones waiting, the sheddable band.
See docs/admission.md."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import redis
import redis.asyncio as aredis
from prometheus_client import CollectorRegistry

from fleetgate.client import Fleet
from fleetgate.errors import ConfigError, Overloaded
from fleetgate.keys import GateKeys
from fleetgate.scripts import GateScripts
from fleetgate.settings import GateSettings

from ..conftest import RedisUnderTest
from . import _admission_workers as workers
from ._admission import ctx, publish_cfg


async def test_strict_bands_and_fifo_within_a_tenant(rut: RedisUnderTest) -> None:
    """Two processes park 2 x 40 priority-0 calls; priority-10 calls made meanwhile are granted
    before any priority-0 call that was waiting, in their own arrival order."""
    keys = GateKeys.of(rut.prefix, "bands")
    with ctx.Pool(2) as pool:
        flood = pool.starmap_async(
            workers.flood, [(rut.url, rut.prefix, "bands", 2, 40, 0.05, 0, None)] * 2
        )
        r = aredis.Redis.from_url(rut.url, decode_responses=True)
        # One worker alone parks 38 (its 40 at limit 2; with holds of 50 ms its batch lasts 1 s,
        # the two together 2 s): wait for 30, not for both, which a slow spawn of the second
        # process under load may never let overlap with the first.
        give_up = time.monotonic() + 60
        while await r.zcard(keys.waiters) < 30:
            assert not flood.ready(), f"the flood ended before 30 calls waited: {flood.get()}"
            assert time.monotonic() < give_up, "the flood never parked 30 calls"
            await asyncio.sleep(0.01)
        async with Fleet(rut.url, prefix=rut.prefix, registry=CollectorRegistry()) as fleet:
            gate = fleet.gate("bands", floor=2, ceiling=2)
            seq_before = int(await r.get(keys.seq) or 0)

            async def high(i: int) -> int:
                await asyncio.sleep(0.001 * i)
                async with gate.permit(deadline=30, priority=10, tenant="search") as lease:
                    await asyncio.sleep(0.01)
                    return lease.token

            high_tokens = await asyncio.gather(*(high(i) for i in range(10)))
        low = [t for out in flood.get(60) for t in out["tokens"]]
        await r.aclose()
    # Every priority-0 grant after the first high one was issued came after the last high one,
    # except the ones already granted before (tokens below seq_before) and at most the two
    # slots that were free or freeing when the high calls arrived.
    lows_between = [t for t in low if min(high_tokens) < t < max(high_tokens)]
    assert len(lows_between) <= 2, (lows_between, high_tokens, seq_before)
    assert high_tokens == sorted(high_tokens)  # FIFO within the tenant's line


def _share(grants_a: list[tuple[float, int]], grants_b: list[tuple[float, int]]) -> float:
    """B's share of the units granted while both tenants had calls granted (the window both
    were backlogged: from the later first grant to the earlier last grant)."""
    start = max(grants_a[0][0], grants_b[0][0])
    end = min(grants_a[-1][0], grants_b[-1][0])
    a = sum(w for t, w in grants_a if start <= t <= end)
    b = sum(w for t, w in grants_b if start <= t <= end)
    return b / (a + b)


@pytest.mark.parametrize(
    ("tenant_weights", "expected"), [(None, 0.5), ("heavy}1}light}3", 0.75)], ids=["1:1", "1:3"]
)
async def test_two_tenants_share_a_band(
    rut: RedisUnderTest, tenant_weights: str | None, expected: float
) -> None:
    """Tenant 'heavy' parks 100 calls per slot, tenant 'light' keeps one per slot waiting: while
    both are backlogged 'light' gets half the units (3/4 with tenant weights 1:3)."""
    keys = GateKeys.of(rut.prefix, "share")
    r = aredis.Redis.from_url(rut.url, decode_responses=True)
    if tenant_weights:
        await publish_cfg(rut.url, keys, {"tenant_weights": tenant_weights})
    with ctx.Pool(2) as pool:
        heavy = pool.apply_async(
            workers.tenant_load, (rut.url, rut.prefix, "share", 4, "heavy", 400, 1600, 0.005)
        )
        while await r.zcard(keys.waiters) < 300:
            await asyncio.sleep(0.01)
        light = pool.apply_async(
            workers.tenant_load, (rut.url, rut.prefix, "share", 4, "light", 8, 120, 0.005)
        )
        grants_heavy, grants_light = heavy.get(120), light.get(120)
    await r.aclose()
    assert grants_heavy[-1][0] > grants_light[-1][0], "heavy drained before light finished"
    share = _share(grants_heavy, grants_light)
    assert abs(share - expected) <= 0.05, share


def test_noisy_tenant_hits_its_bound_and_nobody_else(rut: RedisUnderTest, r: redis.Redis) -> None:
    """max_queued_per_tenant = 20: the noisy tenant's 200 calls get Overloaded past its bound
    while another tenant's calls made at the same time are never rejected."""
    keys = GateKeys.of(rut.prefix, "noisy")
    asyncio.run(publish_cfg(rut.url, keys, {"max_queued_per_tenant": 20}))
    with ctx.Pool(2) as pool:
        noisy = pool.apply_async(
            workers.flood, (rut.url, rut.prefix, "noisy", 2, 200, 0.01, 0, "noisy")
        )
        quiet = pool.apply_async(
            workers.flood, (rut.url, rut.prefix, "noisy", 2, 15, 0.01, 0, "quiet")
        )
        n, q = noisy.get(60), quiet.get(60)
    assert n["overloaded"] >= 150, n["overloaded"]
    assert q["overloaded"] == 0 and len(q["tokens"]) == 15
    assert int(r.hget(keys.stats, "rejected_tenant") or 0) == n["overloaded"]


async def test_a_bound_removed_from_the_config_is_removed_in_redis(
    fleet: Fleet, async_redis: aredis.Redis
) -> None:
    """publish.lua deletes a field sent as '' (an unset max_queued_per_tenant): the default
    (max_queued) applies again instead of the old bound staying in Redis."""
    keys = fleet.gate("unset").keys
    with_bound = GateSettings(max_queued_per_tenant=3).as_cfg()
    assert await GateScripts(async_redis).publish(keys, 1, 60_000, None, with_bound, {})
    assert await async_redis.hget(keys.cfg, "max_queued_per_tenant") == "3"
    without = GateSettings().as_cfg()
    assert await GateScripts(async_redis).publish(keys, 1, 60_000, None, without, {})
    assert await async_redis.hget(keys.cfg, "max_queued_per_tenant") is None
    assert (await fleet.gate("unset").snapshot()).max_queued_per_tenant == 1000


async def test_heavy_head_is_not_starved(fleet: Fleet) -> None:
    """A weight-8 call at limit 8 among a stream of weight-1 calls: the free units are reserved
    for it, so it is granted after about one hold, not never."""
    gate = fleet.gate("heavy", floor=8, ceiling=8)
    stop = asyncio.Event()

    rng = random.Random(7)

    async def light() -> None:  # holds of different lengths: the units come back one by one
        while not stop.is_set():
            async with gate.permit(deadline=30):
                await asyncio.sleep(rng.uniform(0.005, 0.03))

    lights = [asyncio.create_task(light()) for _ in range(16)]
    await asyncio.sleep(0.2)
    t0 = time.monotonic()
    reserved: set[str] = set()
    granted = asyncio.Event()

    async def peek() -> None:
        while not granted.is_set():
            snap = await gate.snapshot()
            reserved.update(lane.reserved for lane in snap.lanes if lane.reserved)
            await asyncio.sleep(0.002)

    peeker = asyncio.create_task(peek())
    async with gate.permit(deadline=10, weight=8, tenant="bulk") as lease:
        granted.set()
        waited = time.monotonic() - t0
        assert lease.weight == 8
        assert (await gate.snapshot()).units == 8  # nothing else runs beside it
    await peeker
    stop.set()
    await asyncio.gather(*lights)
    assert waited < 1.0, waited
    assert reserved == {lease.id}  # the free units were kept for it meanwhile


async def test_oversize_head_waits_for_the_limit_without_blocking_others(
    fleet: Fleet, async_redis: aredis.Redis
) -> None:
    """Weight 6 with the limit at its floor (4, ceiling 8): it waits in `big` while other calls
    keep being served; once the target reaches 6 it is granted. Above the ceiling: ConfigError."""
    gate = fleet.gate("big", floor=4, ceiling=8)
    with pytest.raises(ConfigError, match="weight"):
        await gate.acquire(weight=9)
    task = asyncio.create_task(gate.acquire(deadline=10, weight=6, tenant="bulk"))
    while await async_redis.zcard(gate.keys.big) == 0:
        await asyncio.sleep(0.01)
    for _ in range(8):  # others pass meanwhile
        async with gate.permit(deadline=1):
            pass
    assert not task.done()
    assert await GateScripts(async_redis).set_target(gate.keys, 6, epoch=1, ttl_ms=60_000)
    lease = await asyncio.wait_for(task, 5)
    assert lease.weight == 6
    await lease.release()


async def test_sheddable_band_never_parks(fleet: Fleet, async_redis: aredis.Redis) -> None:
    """Priority below shed_below (0) gets Overloaded at once when the gate is full, and is
    granted like anyone else when it is not."""
    gate = fleet.gate("shed", floor=1, ceiling=1)
    async with gate.permit(priority=-5):
        pass
    held = await gate.acquire()
    for _ in range(5):
        with pytest.raises(Overloaded, match="shed_below"):
            await gate.acquire(priority=-5)
        assert await async_redis.zcard(gate.keys.waiters) == 0
    await held.release()
    assert int(await async_redis.hget(gate.keys.stats, "shed") or 0) == 5
