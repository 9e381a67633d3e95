"""The asyncio client against a real redis-server (single process; fleet tests live elsewhere)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import redis.asyncio as aredis
from prometheus_client import CollectorRegistry

from fleetgate.admission import member_id
from fleetgate.client import (
    ConfigError,
    DeadlineExceeded,
    Fleet,
    LeaseLost,
    Overloaded,
    SyncFleet,
)
from fleetgate.settings import GateSettings

from ..conftest import RedisUnderTest


def sample(registry: CollectorRegistry, name: str, gate: str) -> float:
    """The sum of the gate's series of ``name`` (over priorities and tenants, if labelled)."""
    return sum(
        s.value
        for family in registry.collect()
        for s in family.samples
        if s.name == name and s.labels.get("gate") == gate
    )


async def test_permit_grants_and_releases(fleet: Fleet, async_redis: aredis.Redis) -> None:
    gate = fleet.gate("bge-m3", floor=2)
    async with gate.permit() as a, gate.permit() as b:
        assert a.id != b.id and b.token > a.token
        assert await async_redis.zcard(gate.keys.holders) == 2
    await fleet.flush()  # a release leaves with the gate's next call; flush sends it now
    assert await async_redis.zcard(gate.keys.holders) == 0
    assert await gate.capacity() == 2


async def test_a_release_goes_before_the_next_acquire_in_one_call(
    fleet: Fleet, async_redis: aredis.Redis
) -> None:
    """Release without waiting for Redis, yet ordered: one process's sequential permits on a
    gate of limit 1 never park behind their own previous permit, and each cycle after the
    first costs one script call (release + acquire together)."""
    gate = fleet.gate("seq", floor=1, ceiling=1)
    async with gate.permit():
        pass
    await fleet.flush()
    before = await _script_calls(async_redis)
    for _ in range(50):
        async with gate.permit():
            pass
    await fleet.flush()
    calls = await _script_calls(async_redis) - before
    stats = await async_redis.hgetall(gate.keys.stats)
    assert int(stats.get("parked", 0)) == 0
    assert int(stats["granted"]) == int(stats["released"]) == 51
    await fleet.flush()
    assert await async_redis.zcard(gate.keys.holders) == 0
    # 50 acquires, each carrying the previous release, and the last release alone; the
    # heartbeat may add a few calls of its own meanwhile.
    assert 51 <= calls <= 51 + 5, calls


async def _script_calls(r: aredis.Redis) -> int:
    stats = await r.info("commandstats")
    return int(stats.get("cmdstat_fcall", {}).get("calls", 0))


async def test_parked_caller_gets_handoff_in_fifo_order(fleet: Fleet) -> None:
    gate = fleet.gate("g", floor=1)
    order: list[int] = []
    first = await gate.acquire()

    async def worker(i: int) -> None:
        async with gate.permit(deadline=10):
            order.append(i)
            await asyncio.sleep(0.01)

    tasks = []
    for i in range(5):
        tasks.append(asyncio.create_task(worker(i)))
        await asyncio.sleep(0.02)  # park in a known order
    await first.release()
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2, 3, 4]


async def test_overloaded_fails_fast_and_counts(
    fleet: Fleet, registry: CollectorRegistry, async_redis: aredis.Redis
) -> None:
    gate = fleet.gate("small", floor=1, max_queued=1)
    held = await gate.acquire()
    parked = asyncio.create_task(gate.acquire(deadline=5))
    await asyncio.sleep(0.1)
    called = False
    with pytest.raises(Overloaded, match="wait list is full"):
        async with gate.permit():
            called = True
    assert not called
    assert await async_redis.zcard(gate.keys.waiters) == 1
    assert sample(registry, "fleetgate_client_rejected_total", "small") == 1
    await held.release()
    lease = await parked
    await lease.release()


async def test_deadline_while_parked_leaves_queue(
    fleet: Fleet, registry: CollectorRegistry, async_redis: aredis.Redis
) -> None:
    gate = fleet.gate("slow", floor=1)
    held = await gate.acquire()
    with pytest.raises(DeadlineExceeded, match="150 ms"):
        async with gate.permit(deadline=0.15):
            pytest.fail("must not run")
    await fleet.runtime.drain(timeout=5.0)  # the cancel leaves in the background (0.25 s wait)
    assert await async_redis.zcard(gate.keys.waiters) == 0
    assert await async_redis.zcard(gate.keys.holders) == 1
    assert sample(registry, "fleetgate_client_deadline_exceeded_total", "slow") == 1
    await held.release()


async def test_deadline_mid_call_cancels_and_releases(
    fleet: Fleet, async_redis: aredis.Redis
) -> None:
    gate = fleet.gate("mid", floor=1)
    with pytest.raises(DeadlineExceeded) as err:
        async with gate.permit(deadline=0.1):
            await asyncio.sleep(5)
    assert isinstance(err.value, TimeoutError)
    await fleet.flush()
    assert await async_redis.zcard(gate.keys.holders) == 0


async def test_failure_inside_permit_releases(fleet: Fleet, async_redis: aredis.Redis) -> None:
    gate = fleet.gate("f", floor=1)
    with pytest.raises(RuntimeError):
        async with gate.permit():
            raise RuntimeError("boom")
    await fleet.flush()
    assert await async_redis.zcard(gate.keys.holders) == 0


async def test_release_is_idempotent(fleet: Fleet, async_redis: aredis.Redis) -> None:
    gate = fleet.gate("i", floor=2)
    a = await gate.acquire()
    b = await gate.acquire()
    await a.release()
    await a.release()
    assert await async_redis.zrange(gate.keys.holders, 0, -1) == [b.id]
    await b.release()


async def test_lease_renewed_beyond_ttl(fleet: Fleet, async_redis: aredis.Redis) -> None:
    gate = fleet.gate("renew", floor=1, lease_ms=600)
    async with gate.permit(deadline=None) as lease:
        await asyncio.sleep(1.5)
        assert not lease.is_lost
        assert await async_redis.zscore(gate.keys.holders, lease.id) is not None


async def test_lost_lease_sets_event(
    fleet: Fleet, registry: CollectorRegistry, async_redis: aredis.Redis
) -> None:
    gate = fleet.gate("lost", floor=1, lease_ms=300)
    with pytest.raises(LeaseLost):  # on leaving the block (test_lease_lost.py)
        async with gate.permit() as lease:
            # The whole process stalls past the lease TTL (a GC pause, a frozen VM): the lease
            # expires in Redis before any renewal, so the next heartbeat reports it lost. (A
            # lease that vanished before its renewal time had passed would be counted again
            # instead: tests/lua/test_transitions.py, the heartbeat adopting leases.)
            time.sleep(0.5)  # blocking the loop is the point
            await asyncio.wait_for(lease.lost.wait(), 2)
    assert sample(registry, "fleetgate_client_lease_lost_total", "lost") == 1


async def test_lost_wakeup_recovered_by_heartbeat(fleet: Fleet, async_redis: aredis.Redis) -> None:
    gate = fleet.gate("w", floor=1)
    held = await gate.acquire()
    task = asyncio.create_task(gate.acquire(deadline=10))
    await asyncio.sleep(0.1)
    # Grant by hand without a wake message: only the heartbeat can tell the waiter.
    [waiter_id] = [member_id(m) for m in await async_redis.zrange(gate.keys.lanes, 0, -1)]
    await held.release()
    await async_redis.delete(gate.keys.wake(fleet.pod_key))
    lease = await asyncio.wait_for(task, 2)
    assert lease.id == waiter_id
    await lease.release()


async def test_utilization_snapshot(fleet: Fleet) -> None:
    gate = fleet.gate("u", floor=3, max_queued=7)
    async with gate.permit():
        util = await fleet.utilization("u")
    assert (util.limit, util.in_flight, util.queued, util.max_queued) == (3, 1, 0, 7)
    assert util.current_target == 3 and util.target is None and util.metrics_ok is False
    assert set(util.to_dict()) >= {"running", "waiting_capacity", "saturated", "metrics_url"}


@pytest.mark.parametrize("name", ["", "a{b}", "x\ny", "é" * 101])
def test_bad_gate_names_refused(name: str) -> None:
    f = Fleet("redis://127.0.0.1:1/0")
    with pytest.raises(ConfigError):
        f.gate(name)


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"floor": 0}, "floor"),
        ({"max_queued": -1}, "max_queued"),
        ({"floor": 4, "ceiling": 2}, "ceiling"),
        ({"max_queued_per_tenant": -1}, "max_queued_per_tenant"),
        ({"shed_below": 101}, "shed_below"),
        ({"tenant_weights": {"a{": 2}}, r"tenant_weights\['a\{'\]"),
        ({"tenant_weights": {"a": 0}}, r"tenant_weights\['a'\]"),
    ],
)
def test_bad_gate_settings_name_the_field(settings: dict[str, Any], field: str) -> None:
    f = Fleet("redis://127.0.0.1:1/0")
    with pytest.raises(ConfigError, match=rf"^gate 'g': {field}: "):
        f.gate("g", **settings)


def test_gate_takes_the_admission_settings() -> None:
    f = Fleet("redis://127.0.0.1:1/0")
    gate = f.gate("g", max_queued_per_tenant=5, tenant_weights={"search": 3}, shed_below=-2)
    d = gate.defaults
    assert (d.max_queued_per_tenant, d.shed_below, dict(d.tenant_weights)) == (5, -2, {"search": 3})
    assert f.gate("g", shed_below=50) is gate  # the first call for a name fixes the settings
    assert f.gate("plain").defaults == GateSettings()


def test_sync_gate_takes_the_admission_settings(rut: RedisUnderTest) -> None:
    with SyncFleet(rut.url, prefix=rut.prefix, registry=CollectorRegistry()) as fleet:
        gate = fleet.gate("sync-adm", floor=2, tenant_weights={"a": 2}, shed_below=-1)
        d = gate.gate.defaults
        assert (d.floor, d.shed_below, dict(d.tenant_weights)) == (2, -1, {"a": 2})
        with pytest.raises(ConfigError, match=r"^gate 'bad': max_queued_per_tenant: "):
            fleet.gate("bad", max_queued_per_tenant=-1)


def test_sync_fleet_permit(rut: RedisUnderTest) -> None:
    with SyncFleet(rut.url, prefix=rut.prefix, registry=CollectorRegistry()) as fleet:
        gate = fleet.gate("sync", floor=1)
        with gate.permit(deadline=5) as lease:
            assert lease.token >= 1
            assert fleet.utilization("sync").in_flight == 1
            with pytest.raises(DeadlineExceeded):
                gate.acquire(deadline=0.2)
        assert fleet.utilization("sync").in_flight == 0
        assert fleet.utilization("sync").queued == 0
