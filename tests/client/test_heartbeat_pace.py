"""The heartbeat is woken when a gate gets work only if it would sleep past the gate's first
renewal (against a real redis-server).

An idle gate is beaten every registration period (3 heartbeat intervals); a gate with a lease
must be renewed within a third of its TTL. Waking the heartbeat on every idle -> busy change cost
a sequential caller a loop iteration and a re-plan per permit; waking it never would let a
short lease lapse. A short lease set by the gate's config (not the client's) is renewed in time
from its first grant, across processes.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest
import redis
import redis.asyncio as aredis
from prometheus_client import CollectorRegistry

from fleetgate.client import Fleet
from fleetgate.keys import GateKeys

from .. import _workers
from ..conftest import RedisUnderTest


async def test_first_lease_of_an_idle_gate_is_renewed_in_time(
    rut: RedisUnderTest, async_redis: aredis.Redis
) -> None:
    # Idle gates are beaten every 3 s here; the lease lives 0.6 s unless renewed.
    async with Fleet(
        rut.url, prefix=rut.prefix, registry=CollectorRegistry(), heartbeat_interval=1.0
    ) as fleet:
        gate = fleet.gate("pace-first", floor=1, lease_ms=600, waiter_ms=600)
        await asyncio.sleep(0.3)  # the heartbeat has registered the gate and naps ~3 s
        assert fleet.runtime.heartbeat_wakes_at - asyncio.get_running_loop().time() > 1.0
        async with gate.permit(deadline=10.0) as lease:
            await asyncio.sleep(1.5)  # 2.5 TTLs: only renewals keep it
            assert not lease.is_lost
            expiry = await async_redis.zscore(gate.keys.holders, lease.id)
            secs, micros = await async_redis.time()
            # Renewed: its expiry (server ms) still ahead (reaping is lazy, so an entry
            # lingering past its expiry would not show otherwise).
            assert expiry is not None and expiry > secs * 1000 + micros // 1000


async def test_sequential_permits_do_not_wake_the_heartbeat_each_time(
    rut: RedisUnderTest,
) -> None:
    async with Fleet(
        rut.url, prefix=rut.prefix, registry=CollectorRegistry(), heartbeat_interval=1.0
    ) as fleet:
        gate = fleet.gate("pace-seq", floor=1)
        await asyncio.sleep(0.2)
        replan = fleet.runtime.replan
        wakes = 0
        orig_set = replan.set

        def counting_set() -> None:
            nonlocal wakes
            wakes += 1
            orig_set()

        replan.set = counting_set  # type: ignore[method-assign]
        for _ in range(200):
            async with gate.permit(deadline=10.0):
                pass
        # At most about one wake per heartbeat period (plus a few), not one per permit.
        assert wakes <= 10, wakes


SPAWN = multiprocessing.get_context("spawn")


@pytest.mark.slow
def test_short_lease_from_the_gate_config_is_renewed_from_the_first_grant(
    rut: RedisUnderTest, sync_redis: redis.Redis
) -> None:
    """The coordinator's config says lease_ms=300; clients beat every 1 s by default.

    The first renewal is paced by the gate's lease, not the client's default TTL: the holder's
    lease does not lapse after 300 ms, so no second process is granted while it still runs (2
    under limit 1).
    """
    keys = GateKeys.of(rut.prefix, "short")
    sync_redis.hset(
        keys.cfg,
        mapping={"floor": 1, "ceiling": 1, "max_queued": 10, "lease_ms": 300, "waiter_ms": 1000},
    )
    probe = f"{rut.prefix}:probe"
    common = dict(url=rut.url, prefix=rut.prefix, gate="short", probe_url=rut.url, probe=probe)
    with ProcessPoolExecutor(2, mp_context=SPAWN) as ex:
        holder = ex.submit(_workers.hammer_with, **common, hold_s=2.0)  # type: ignore[arg-type]
        other = ex.submit(_workers.hammer_with, **common, hold_s=0.1, after_probe=1)  # type: ignore[arg-type]
        peaks = [holder.result(timeout=60), other.result(timeout=60)]
    print(f"[fault] lease_ms 300 from the config: peak {max(peaks)} under limit 1")
    assert max(peaks) == 1, f"{max(peaks)} running under a limit of 1"
    assert int(sync_redis.hget(keys.stats, "expired_leases") or 0) == 0
