"""Fleet-wide claims checked across several OS processes against a real redis-server: the cap,
FIFO order, a killed holder's or waiter's place, and the cap of processes sharing a pod_id."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Iterator

import pytest
import redis
from prometheus_client import CollectorRegistry

from fleetgate.admission import member_id
from fleetgate.client import Fleet
from fleetgate.keys import GateKeys
from fleetgate.tools.redisproc import RedisProcess

from .. import _workers
from .._workers import wait_for
from ..conftest import RedisUnderTest

ctx = mp.get_context("spawn")


@pytest.fixture
def r(rut: RedisUnderTest) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(rut.url, decode_responses=True)
    yield client
    client.close()


def test_cap_holds_across_processes(rut: RedisUnderTest, r: redis.Redis) -> None:
    keys = GateKeys.of(rut.prefix, "cap")
    probe = f"{rut.prefix}:probe"
    with ctx.Pool(4) as pool:
        peaks = pool.starmap(_workers.hammer, [(rut.url, rut.prefix, "cap", 50, 0.001, probe)] * 4)
    assert max(peaks) <= 4, peaks
    assert max(peaks) >= 2, "the gate serialised everything: cap never approached"
    assert r.zcard(keys.holders) == 0
    assert r.zcard(keys.waiters) == 0 and r.zcard(keys.waiters) == 0
    assert int(r.hget(keys.stats, "granted") or 0) == 200


@pytest.mark.long
def test_fifo_order_across_processes(rut: RedisUnderTest, r: redis.Redis) -> None:
    keys = GateKeys.of(rut.prefix, "fifo")
    record = f"{rut.prefix}:order"
    blocker = r  # holds the only permit through the scripts' own key layout
    procs = []

    async def hold() -> tuple[Fleet, object]:
        fleet = Fleet(rut.url, prefix=rut.prefix, registry=CollectorRegistry())
        await fleet.start()
        lease = await fleet.gate("fifo", floor=1).acquire()
        return fleet, lease

    loop = asyncio.new_event_loop()
    fleet, lease = loop.run_until_complete(hold())
    try:
        for i in range(4):
            p = ctx.Process(
                target=_workers.park_and_record, args=(rut.url, rut.prefix, "fifo", record, 0.02)
            )
            p.start()
            procs.append(p)
            wait_for(lambda i=i: blocker.zcard(keys.waiters) == i + 1, 20)
        parked = [
            int(x.split(":")[0].rsplit("-", 2)[1])
            for x in map(member_id, r.zrange(keys.lanes, 0, -1))
        ]
        loop.run_until_complete(lease.release())  # type: ignore[attr-defined]
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
    finally:
        loop.run_until_complete(fleet.close())
        loop.close()
    granted = [int(x) for x in r.lrange(record, 0, -1)]
    assert granted == [p.pid for p in procs] == parked


def _spawn_holder(rut: RedisUnderTest, r: redis.Redis, gate: str, lease_ms: int, waiter_ms: int):  # type: ignore[no-untyped-def]
    ready = f"{rut.prefix}:ready:{gate}"
    p = ctx.Process(
        target=_workers.hold_forever,
        args=(rut.url, rut.prefix, gate, ready, lease_ms, waiter_ms),
    )
    p.start()
    wait_for(lambda: r.llen(ready) >= 1, 20)
    return p


@pytest.mark.long
def test_killed_holder_permit_goes_to_next_waiter(rut: RedisUnderTest, r: redis.Redis) -> None:
    keys = GateKeys.of(rut.prefix, "kill-holder")
    lease_ms = 1000
    p = _spawn_holder(rut, r, "kill-holder", lease_ms, 5000)
    wait_for(lambda: r.zcard(keys.holders) == 1, 10)

    async def next_waiter() -> float:
        async with Fleet(rut.url, prefix=rut.prefix, registry=CollectorRegistry()) as fleet:
            gate = fleet.gate("kill-holder", floor=1)
            task = asyncio.create_task(gate.acquire(deadline=30))
            await asyncio.sleep(0.2)
            assert not task.done()
            os.kill(p.pid, signal.SIGKILL)
            t0 = time.monotonic()
            lease = await task
            took = time.monotonic() - t0
            await lease.release()
            return took

    took = asyncio.run(next_waiter())
    p.join(5)
    print(f"re-grant after holder SIGKILL: {took * 1000:.0f} ms (lease TTL {lease_ms} ms)")
    assert took <= lease_ms / 1000 + 1.0
    assert int(r.hget(keys.stats, "expired_leases") or 0) == 1


@pytest.mark.long
def test_killed_waiter_leaves_queue(rut: RedisUnderTest, r: redis.Redis) -> None:
    keys = GateKeys.of(rut.prefix, "kill-waiter")
    waiter_ms = 1000

    async def scenario() -> float:
        async with Fleet(rut.url, prefix=rut.prefix, registry=CollectorRegistry()) as fleet:
            gate = fleet.gate("kill-waiter", floor=1, waiter_ms=waiter_ms)
            held = await gate.acquire()
            p = _spawn_holder(rut, r, "kill-waiter", 10_000, waiter_ms)
            wait_for(lambda: r.zcard(keys.waiters) == 1, 10)
            behind = asyncio.create_task(gate.acquire(deadline=30))
            while r.zcard(keys.waiters) < 2:
                await asyncio.sleep(0.01)
            os.kill(p.pid, signal.SIGKILL)
            t0 = time.monotonic()
            while r.zcard(keys.waiters) != 1:  # the dead entry is reaped, ours is the head
                await asyncio.sleep(0.01)
            took = time.monotonic() - t0
            await held.release()
            lease = await asyncio.wait_for(behind, 5)
            await lease.release()
            p.join(5)
            return took

    took = asyncio.run(scenario())
    print(f"queue moved after waiter SIGKILL: {took * 1000:.0f} ms (waiter TTL {waiter_ms} ms)")
    assert took <= waiter_ms / 1000 + 1.0
    assert int(r.hget(keys.stats, "abandoned_waiters") or 0) == 1


@pytest.mark.slow
def test_processes_sharing_a_pod_id_keep_the_cap(
    rut: RedisUnderTest, sync_redis: redis.Redis
) -> None:
    """Two processes given the same pod_id ($HOSTNAME with two workers), limit 2.

    Each process mints lease ids of its own (a pod key unique per process): sharing lease ids
    and holder entries, they would run 3.
    """
    peaks = _workers.run_pods(
        2,
        url=rut.url,
        prefix=rut.prefix,
        gate="shared-id",
        probe_url=rut.url,
        probe=f"{rut.prefix}:probe",
        tasks=4,
        loops=25,
        hold_s=0.02,
        pod_id="worker",
        floor=2,
        barrier=(f"{rut.prefix}:ready", 2),
    )
    print(f"[fault] shared pod_id: peak {max(peaks)} under limit 2")
    assert max(peaks) <= 2, f"{max(peaks)} running under a limit of 2"
    keys = GateKeys.of(rut.prefix, "shared-id")
    assert sync_redis.zcard(keys.holders) == 0 and sync_redis.zcard(keys.waiters) == 0


async def test_pod_key_is_unique_per_process_whatever_the_label(own_redis: RedisProcess) -> None:
    async with (
        Fleet(own_redis.url, pod_id="worker", registry=CollectorRegistry()) as a,
        Fleet(own_redis.url, pod_id="worker", registry=CollectorRegistry()) as b,
    ):
        assert a.pod_id == b.pod_id == "worker"
        assert a.pod_key != b.pod_key and a.pod_key.startswith("worker")
        la, lb = await a.gate("g", floor=2).acquire(), await b.gate("g", floor=2).acquire()
        assert la.id != lb.id
        assert await a.redis.zcard(a.gate("g").keys.holders) == 2
        await la.release()
        await lb.release()
