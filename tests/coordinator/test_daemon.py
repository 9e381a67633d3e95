"""The coordinator in-process against real Redis and a metrics stub: AIMD end to end, reaper,
warm resume, static path."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aredis
from prometheus_client import CollectorRegistry

from fleetgate.client import Fleet
from fleetgate.keys import GateKeys
from fleetgate.scripts import GateScripts
from fleetgate.settings import GateSettings
from fleetgate.tools.sim import serve_in_thread

from .._stub import StubValues, metrics_stub
from ..conftest import RedisUnderTest
from ._coordinator import POLL, config, eventually, running


async def limit_of(r: aredis.Redis, keys: GateKeys) -> int:
    return (await GateScripts(r).snapshot(keys)).limit


@pytest.mark.long
async def test_targets_rise_fall_and_decay_to_floor(
    rut: RedisUnderTest, async_redis: aredis.Redis
) -> None:
    # The engine runs what the 40 workers send (the controller increases only when the server
    # runs near the target, not on permits the fleet holds alone).
    values = StubValues(running=40, waiting_capacity=0)
    keys = GateKeys.of(rut.prefix, "llm")
    with serve_in_thread(metrics_stub(values)) as served:
        cfg = config(rut, f"{served.url}/metrics")
        async with Fleet(rut.url, prefix=rut.prefix, registry=CollectorRegistry()) as fleet:
            gate = fleet.gate("llm")
            stop_load = asyncio.Event()

            async def worker() -> None:  # always more work than the limit: near-full
                while not stop_load.is_set():
                    async with gate.permit(deadline=30):
                        await asyncio.sleep(0.02)

            workers = [asyncio.create_task(worker()) for _ in range(40)]
            async with running(cfg) as coord:
                await eventually(
                    lambda: async_redis.hexists(keys.target, "value"), 5, "a published target"
                )
                await eventually(lambda: _gt(limit_of(async_redis, keys), 30), 10, "ramp above 30")
                epoch = int(await async_redis.hget(keys.target, "epoch") or 0)
                assert epoch >= 1
                assert coord.election.is_leader
                # The engine saturates: capacity-waiting > 0 while running 12.
                values.running, values.waiting_capacity = 12, 5
                await eventually(lambda: _le(limit_of(async_redis, keys), 16), 5, "back-off")
                assert await limit_of(async_redis, keys) >= 4  # never below the floor
                util = await async_redis.hgetall(keys.util)
                assert util["saturated"] == "1" and util["metrics_ok"] == "1"
                assert util["reason"] in {"decrease", "hold_cooldown", "hold_hysteresis"}
                # The fixed gate is registered but never gets a target.
                rk = GateKeys.of(rut.prefix, "rerank")
                assert await async_redis.hget(rk.cfg, "floor") == "3"
                # (its target hash holds only the leader's epoch: the fence of its cfg writes)
                assert await async_redis.hget(rk.target, "value") is None
                assert await async_redis.hget(rk.target, "epoch") == str(epoch)
            # Coordinator stopped: the lease of the target runs out, the limit decays to floor
            # (3 polls plus one leader takeover: config.target_ttl, 3.8 s here).
            ttl = cfg.coordinator.target_ttl
            took = await eventually(
                lambda: _eq(limit_of(async_redis, keys), 4), ttl + 2, "decay to the floor"
            )
            assert took <= ttl + 1.0
            stop_load.set()
            await asyncio.gather(*workers)
    leader = await async_redis.get(f"{rut.prefix}:leader")
    assert leader is None  # resigned at once on shutdown


async def test_garbage_metrics_hold_then_floor(
    rut: RedisUnderTest, async_redis: aredis.Redis
) -> None:
    keys = GateKeys.of(rut.prefix, "llm")
    values = StubValues()
    with serve_in_thread(metrics_stub(values)) as served:
        async with running(config(rut, f"{served.url}/nothing-here")):
            await eventually(lambda: async_redis.exists(keys.util), 5, "a snapshot")
            await asyncio.sleep(3 * POLL)
            util = await async_redis.hgetall(keys.util)
            assert util["metrics_ok"] == "0" and util["error"]
            assert await limit_of(async_redis, keys) == 4
            assert not await async_redis.hexists(keys.target, "value")  # (only the epoch)


async def test_a_blind_leader_publishes_the_floor_after_unknown_reset_polls(
    rut: RedisUnderTest, async_redis: aredis.Redis
) -> None:
    """A target outlives a leader takeover (config.target_ttl), so a leader that cannot read a
    server must not wait for its last target to run out: after unknown_reset_polls unknown polls
    it publishes the floor, not the last target until it expires."""
    keys = GateKeys.of(rut.prefix, "llm")
    with serve_in_thread(metrics_stub(StubValues())) as served:
        cfg = config(rut, f"{served.url}/nothing-here")  # every scrape fails: blind
        await async_redis.hset(keys.util, "state", '{"target":40,"slow_start":false}')
        sec, _ = await async_redis.time()
        live = {"value": 40, "expires_at": (sec + 60) * 1000}  # live for a minute
        await async_redis.hset(keys.target, mapping=live)  # type: ignore[arg-type]
        async with running(cfg):
            assert await limit_of(async_redis, keys) == 40  # resumed, held while unknown
            polls = cfg.coordinator.target_ttl_polls
            took = await eventually(
                lambda: _eq(limit_of(async_redis, keys), 4), polls * POLL + 3, "the floor"
            )
            assert took <= polls * POLL + 1.0 < cfg.coordinator.target_ttl
            target = await async_redis.hgetall(keys.target)
            assert int(target["value"]) == 4 and int(target["epoch"]) >= 1
            assert (await async_redis.hgetall(keys.util))["reason"] in {"reset", "hold_unknown"}


async def test_reaper_reclaims_crashed_holder_without_clients(
    rut: RedisUnderTest, async_redis: aredis.Redis
) -> None:
    keys = GateKeys.of(rut.prefix, "rerank")
    scripts = GateScripts(async_redis)
    d = GateSettings(floor=1, ceiling=1, lease_ms=300)
    await async_redis.sadd(f"{rut.prefix}:gates", "rerank")
    assert (await scripts.acquire(keys, "dead:1", 10_000, d)).status == 1
    assert (await scripts.acquire(keys, "alive:1", 10_000, d)).status == 2
    async with running(config(rut, None)):
        # The coordinator re-registers cfg (floor 3) and its reaper reclaims the dead lease.
        await eventually(
            lambda: _eq(async_redis.zscore(keys.holders, "dead:1"), None), 5, "reaping"
        )
    assert await async_redis.zscore(keys.holders, "alive:1") is not None
    assert await async_redis.hget(keys.stats, "expired_leases") == "1"


async def test_adaptive_off_is_the_static_path(
    rut: RedisUnderTest, async_redis: aredis.Redis
) -> None:
    values = StubValues(running=0, waiting_capacity=0)
    keys = GateKeys.of(rut.prefix, "llm")
    with serve_in_thread(metrics_stub(values)) as served:
        async with running(config(rut, f"{served.url}/metrics", adaptive=False)):
            await eventually(lambda: async_redis.exists(keys.util), 5, "a snapshot")
            await asyncio.sleep(3 * POLL)
            assert not await async_redis.hexists(keys.target, "value")  # (only the epoch)
            assert await limit_of(async_redis, keys) == 4
            assert (await async_redis.hgetall(keys.util))["reason"] == "static"


async def test_new_leader_resumes_stored_state(
    rut: RedisUnderTest, async_redis: aredis.Redis
) -> None:
    keys = GateKeys.of(rut.prefix, "llm")
    values = StubValues()
    with serve_in_thread(metrics_stub(values)) as served:
        cfg = config(rut, f"{served.url}/metrics")
        # A previous leader's state: target 40, out of slow start, its target still live.
        state = '{"target":40,"slow_start":false}'
        await async_redis.hset(keys.util, mapping={"state": state})
        sec, _ = await async_redis.time()
        live = {"value": 40, "expires_at": (sec + 30) * 1000}
        await async_redis.hset(keys.target, mapping=live)  # type: ignore[arg-type]
        async with running(cfg) as coord:
            await eventually(lambda: _published_after(async_redis, keys, sec), 5, "a target")
            # Idle engine: hold, so the resumed value is what gets published, not the floor.
            assert int(await async_redis.hget(keys.target, "value") or 0) == 40
            assert coord.states["llm"].slow_start is False


async def test_a_state_whose_target_ran_out_restarts_from_the_floor(
    rut: RedisUnderTest, async_redis: aredis.Redis
) -> None:
    """Every coordinator was down for longer than the target's TTL: the fleet is at the floor.
    The stored state must not hand a backlog its old target (400) in one poll: the new leader
    starts from the floor, keeping the capacity it had learnt."""
    keys = GateKeys.of(rut.prefix, "llm")
    with serve_in_thread(metrics_stub(StubValues())) as served:
        cfg = config(rut, f"{served.url}/metrics")
        state = '{"target":40,"slow_start":false,"capacity":48.0}'
        await async_redis.hset(keys.util, mapping={"state": state})
        sec, _ = await async_redis.time()
        lapsed = {"value": 40, "expires_at": (sec - 3600) * 1000}
        await async_redis.hset(keys.target, mapping=lapsed)  # type: ignore[arg-type]
        async with running(cfg) as coord:
            await eventually(lambda: _published_after(async_redis, keys, sec), 5, "a target")
            assert int(await async_redis.hget(keys.target, "value") or 0) == 4  # the floor
            assert coord.states["llm"].capacity == 48.0


async def _published_after(r: aredis.Redis, keys: GateKeys, sec: int) -> bool:
    expires = await r.hget(keys.target, "expires_at")
    return expires is not None and sec * 1000 < float(expires) < (sec + 20) * 1000


async def _gt(aw, v) -> bool:  # type: ignore[no-untyped-def]
    return bool(await aw > v)


async def _le(aw, v) -> bool:  # type: ignore[no-untyped-def]
    return bool(await aw <= v)


async def _eq(aw, v) -> bool:  # type: ignore[no-untyped-def]
    return bool(await aw == v)
