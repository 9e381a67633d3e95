"""Admission order (weights, priority bands, tenants) against a real redis-server, the fleet
claims across several OS processes. See docs/admission.md."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aredis
from prometheus_client import CollectorRegistry

from fleetgate.admission import member_id
from fleetgate.client import Fleet
from fleetgate.errors import ConfigError, DeadlineExceeded, Overloaded
from fleetgate.keys import GateKeys
from fleetgate.scripts import SCHEMA, GateScripts
from fleetgate.settings import GateSettings

from .._workers import wait_for
from ..conftest import RedisUnderTest
from . import _admission_workers as workers

ctx = mp.get_context("spawn")


@pytest.fixture
def r(rut: RedisUnderTest) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(rut.url, decode_responses=True)
    yield client
    client.close()


def units(r: redis.Redis, keys: GateKeys) -> int:
    """Units held as the scripts count them, read atomically."""
    pipe = r.pipeline(transaction=True)
    pipe.zcard(keys.holders)
    pipe.hget(keys.adm, "extra")
    n, extra = pipe.execute()
    return int(n) + int(extra or 0)


class Sampler:
    """Reads the units held every ~2 ms in a thread; ``peak`` is the highest seen."""

    def __init__(self, url: str, keys: GateKeys) -> None:
        self.r = redis.Redis.from_url(url, decode_responses=True)
        self.keys = keys
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, units(self.r, self.keys))
            self.samples += 1
            time.sleep(0.002)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.r.close()


async def publish_cfg(url: str, keys: GateKeys, cfg: dict[str, object]) -> None:
    """Write gate settings as the coordinator does (publish.lua), leaving the target alone."""
    async with aredis.Redis.from_url(url) as client:
        assert await GateScripts(client).publish(keys, 1, 60_000, None, cfg, {})


def assert_no_trace(r: redis.Redis, keys: GateKeys) -> None:
    """Nothing of a lane, band or tenant is left once nobody holds or waits."""
    assert units(r, keys) == 0
    for key in (keys.lanes, keys.waiters, keys.fair, keys.big):
        assert r.zcard(key) == 0, (key, r.zrange(key, 0, 10))
    assert r.hgetall(keys.adm) == {}


def test_units_never_above_limit_across_processes(rut: RedisUnderTest, r: redis.Redis) -> None:
    """4 processes x 6 loops of random weights (1..8), priorities (-1, 0, 5) and tenants, with
    cancellations and short deadlines: units held never pass the limit, sampled from Redis and
    from an external counter the workers keep around their work; nothing is left after."""
    limit, keys, probe = 16, GateKeys.of(rut.prefix, "units"), f"{rut.prefix}:probe"
    with Sampler(rut.url, keys) as sampler, ctx.Pool(4) as pool:
        outs = pool.starmap(
            workers.random_weights,
            [(rut.url, rut.prefix, "units", limit, 6, 25, probe, seed) for seed in range(4)],
        )
    peak = max(o["peak"] for o in outs)
    assert sampler.peak <= limit, (sampler.peak, peak, outs)
    assert peak <= limit, peak
    assert peak >= limit // 2, f"the cap was never approached (peak {peak})"
    assert sum(o["granted"] for o in outs) >= 300
    assert sum(o["cancelled"] + o["timed_out"] for o in outs) > 0
    wait_for(lambda: units(r, keys) == 0, 10)
    assert_no_trace(r, keys)
    assert int(r.get(probe) or 0) == 0


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


async def test_a_lowered_ceiling_refuses_the_parked_head_and_its_lane_moves_on(
    rut: RedisUnderTest, r: redis.Redis, fleet: Fleet
) -> None:
    """floor = ceiling = 8; another process parks a weight-8 call (no
    deadline) while this one holds a unit; the coordinator lowers floor and ceiling to 4 and
    the unit is released. The heavy call can never be granted now: its caller gets the
    ConfigError an arrival of weight 8 gets, and a weight-1 call of the same lane is granted at
    once (not the heavy head waiting in `big` for ever, and the weight-1 call timing out after
    3 s with 0 of 4 units held)."""
    gate = fleet.gate("lowered", floor=8, ceiling=8)
    held = await gate.acquire()
    with ctx.Pool(1) as pool:
        heavy = pool.apply_async(workers.park_heavy, (rut.url, rut.prefix, "lowered", 8, 8, 20.0))
        await asyncio.to_thread(wait_for, lambda: r.zcard(gate.keys.waiters) == 1, 30)
        published = time.time()
        await publish_cfg(rut.url, gate.keys, {"floor": 4, "ceiling": 4})
        await held.release()
        t0 = time.monotonic()
        try:
            lease = await gate.acquire(deadline=3)
        except DeadlineExceeded:
            pytest.fail(
                f"the weight-1 call timed out after {time.monotonic() - t0:.1f} s with "
                f"{units(r, gate.keys)} of 4 units held"
            )
        granted_ms = (time.monotonic() - t0) * 1000
        assert units(r, gate.keys) == 1
        await lease.release()
        out = await asyncio.to_thread(heavy.get, 30)
    refused_ms = (out["at"] - published) * 1000
    print(f"weight-1 granted in {granted_ms:.0f} ms; heavy caller {out['error']} "
          f"{refused_ms:.0f} ms after the publish")  # fmt: skip
    assert out["error"] == "ConfigError", out
    assert "weight: 8 is above the gate's ceiling (4)" in out["message"]
    assert granted_ms < 1000 and refused_ms < 2000, (granted_ms, refused_ms)
    assert int(r.hget(gate.keys.stats, "too_heavy") or 0) == 1
    wait_for(lambda: units(r, gate.keys) == 0, 5)
    assert_no_trace(r, gate.keys)


async def test_a_refusal_whose_wake_is_lost_reaches_its_caller_by_the_heartbeat(
    fleet: Fleet, r: redis.Redis
) -> None:
    """As above, with the wake of the refusal lost: the pod's next heartbeat reports the waiter
    as too heavy and its caller gets the ConfigError (not Overloaded, not parked again)."""
    gate = fleet.gate("lowered-lost", floor=8, ceiling=8)
    held = await gate.acquire()
    gate._woken = lambda value: None  # type: ignore[method-assign]
    heavy = asyncio.create_task(gate.acquire(deadline=None, weight=8))
    await asyncio.to_thread(wait_for, lambda: r.zcard(gate.keys.waiters) == 1, 10)
    t0 = time.monotonic()
    await publish_cfg(fleet.url, gate.keys, {"floor": 4, "ceiling": 4})
    with pytest.raises(ConfigError, match=r"weight: 8 is above the gate's ceiling \(4\)"):
        await asyncio.wait_for(heavy, 5)
    print(f"heavy caller ConfigError {(time.monotonic() - t0) * 1000:.0f} ms after the publish "
          "(wake lost, heartbeat 0.2 s)")  # fmt: skip
    assert r.zcard(gate.keys.waiters) == 0
    await held.release()


async def test_full_list_evicts_the_lowest_band(fleet: Fleet, async_redis: aredis.Redis) -> None:
    """A list full of priority-0 calls: a priority-10 arrival parks and the newest priority-0
    waiter gets Overloaded (by its wake, or by the heartbeat when the wake is lost)."""
    gate = fleet.gate("evict", floor=1, ceiling=1, max_queued=5)
    held = await gate.acquire()
    low = [asyncio.create_task(gate.acquire(deadline=30)) for _ in range(5)]
    while await async_redis.zcard(gate.keys.waiters) < 5:
        await asyncio.sleep(0.01)
    high = asyncio.create_task(gate.acquire(deadline=30, priority=10))
    done, _ = await asyncio.wait(low, timeout=5, return_when=asyncio.FIRST_COMPLETED)
    [evicted] = done
    assert isinstance(evicted.exception(), Overloaded)
    assert evicted is low[-1]  # the newest
    assert "higher priority" in str(evicted.exception())
    # The wake is lost this time: the heartbeat's eviction record tells the pod.
    orig = gate._woken
    gate._woken = lambda value: None  # type: ignore[method-assign]
    high2 = asyncio.create_task(gate.acquire(deadline=30, priority=10))
    done, _ = await asyncio.wait(low[:-1], timeout=5, return_when=asyncio.FIRST_COMPLETED)
    gate._woken = orig  # type: ignore[method-assign]
    [evicted2] = done
    assert isinstance(evicted2.exception(), Overloaded)
    assert int(await async_redis.hget(gate.keys.stats, "evicted") or 0) == 2
    await held.release()
    for t in (high, high2):
        await (await t).release()
    for t in low[:-2]:
        await (await t).release()


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


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"weight": 0}, "weight"),
        ({"weight": True}, "weight"),
        ({"priority": 101}, "priority"),
        ({"priority": 1.5}, "priority"),
        ({"tenant": "a{b"}, "tenant"),
        ({"tenant": ""}, "tenant"),
    ],
)
async def test_bad_arguments_name_the_argument(
    fleet: Fleet, kwargs: dict[str, object], field: str
) -> None:
    gate = fleet.gate("args")
    with pytest.raises(ConfigError, match=field):
        await gate.acquire(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=field):
        async with gate.permit(**kwargs):  # type: ignore[arg-type]
            pass


def test_killed_process_leaves_no_units(rut: RedisUnderTest, r: redis.Redis) -> None:
    """SIGKILL a process holding heavy leases and waiting in several lanes: after the TTLs and a
    sweep every unit is back and no lane, band or tenant entry is left."""
    keys = GateKeys.of(rut.prefix, "kill")
    proc = ctx.Process(
        target=workers.flood, args=(rut.url, rut.prefix, "kill", 4, 30, 3600, 0, "t1")
    )
    proc.start()
    try:
        wait_for(lambda: r.zcard(keys.waiters) >= 20, 20)
        os.kill(proc.pid or 0, signal.SIGKILL)
        proc.join(10)
    finally:
        if proc.is_alive():
            proc.kill()

    async def sweep_until_empty() -> None:
        async with aredis.Redis.from_url(rut.url) as client:
            scripts = GateScripts(client)
            for _ in range(200):
                await scripts.heartbeat(keys, "", 0, [], [])  # the coordinator's sweep
                if units(r, keys) == 0 and r.zcard(keys.waiters) == 0:
                    return
                await asyncio.sleep(0.1)

    asyncio.run(sweep_until_empty())
    assert_no_trace(r, keys)


# -- schema: rolling upgrades -------------------------------------------------------------------

SCHEMA1 = Path(__file__).parent / "lua_schema1"


def _schema1(r: redis.Redis, name: str) -> object:
    """A script of fleetgate 0.1 (schema 1), as released."""
    lib = (SCHEMA1 / "lib.lua").read_text()
    return r.register_script(lib + "\n" + (SCHEMA1 / f"{name}.lua").read_text())


def test_old_client_is_refused_by_a_schema2_gate(rut: RedisUnderTest, r: redis.Redis) -> None:
    """A 0.1 client's acquire on a gate this version registered fails (WRONGTYPE on the fenced
    queue key, whose value says why) before it can grant: no unit is miscounted."""
    keys = GateKeys.of(rut.prefix, "fence")

    async def new_client() -> None:
        async with Fleet(rut.url, prefix=rut.prefix, registry=CollectorRegistry()) as fleet:
            await fleet.gate("fence", floor=2, ceiling=2).acquire(weight=2)  # held: leaked

    asyncio.run(new_client())
    assert r.hget(keys.cfg, "schema") == str(SCHEMA)
    before = r.zrange(keys.holders, 0, -1, withscores=True)
    old_acquire = _schema1(r, "acquire")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        old_acquire(keys=[keys.base], args=[1, 8, 100, 10_000, 5_000, 0, "old:1", 1000])
    assert r.zrange(keys.holders, 0, -1, withscores=True) == before
    assert "older than 0.2" in r.get(keys.queue)


async def test_newer_schema_is_refused_clearly(fleet: Fleet, async_redis: aredis.Redis) -> None:
    gate = fleet.gate("future")
    async with gate.permit():
        pass
    await async_redis.hset(gate.keys.cfg, "schema", SCHEMA + 1)
    before = await async_redis.hgetall(gate.keys.stats)
    with pytest.raises(ConfigError, match=r"schema 3.*upgrade"):
        await gate.acquire()
    assert await async_redis.hgetall(gate.keys.stats) == before


def test_schema1_gate_is_converted_with_its_waiters_in_order(
    rut: RedisUnderTest, r: redis.Redis
) -> None:
    """A gate run by 0.1 scripts with parked callers: the first call of this version converts it
    (waiters kept, in FIFO order) and hands off in that order."""
    keys = GateKeys.of(rut.prefix, "convert")
    acquire = _schema1(r, "acquire")
    args = [1, 8, 100, 10_000, 60_000, 0]
    assert acquire(keys=[keys.base], args=[*args, "o:1", 60_000])[4] == 1  # granted
    for i in range(2, 6):
        assert acquire(keys=[keys.base], args=[*args, f"o:{i}", 60_000])[4] == 2  # parked
    assert r.type(keys.queue) == "zset"

    async def release_old_holder() -> int:
        async with aredis.Redis.from_url(rut.url) as client:
            return await GateScripts(client).release_many(keys, ["o:1"])

    assert asyncio.run(release_old_holder()) == 1
    assert r.hget(keys.cfg, "schema") == str(SCHEMA) and r.type(keys.queue) == "string"
    assert r.zrange(keys.holders, 0, -1) == ["o:2"]
    assert [member_id(m) for m in r.zrange(keys.lanes, 0, -1)] == ["o:3", "o:4", "o:5"]
    assert r.zcard(keys.fair) == 1


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


async def test_a_malformed_class_is_refused_before_anything_is_written(
    async_redis: aredis.Redis, rut: RedisUnderTest
) -> None:
    """The scripts check what the client library would never send (a class outside 000..200,
    a brace in the tenant): an error, and the release in the same call is not applied."""
    keys = GateKeys.of(rut.prefix, "malformed")
    scripts = GateScripts(async_redis)
    d = GateSettings(floor=2, ceiling=2)
    [held] = await scripts.acquire_many(keys, [("p:1", 1000, "")], d)
    before = await async_redis.zrange(keys.holders, 0, -1)
    for cls in ("201}x", "abc", "090}a}b"):
        with pytest.raises(Exception, match="request class"):
            await scripts.acquire_many(keys, [("p:2", 1000, cls)], d, releases=["p:1"])
        assert await async_redis.zrange(keys.holders, 0, -1) == before == ["p:1"]
    assert held.status == 1
