"""A pod's cost to Redis does not grow with its gates, against a real
redis-server: one wake connection per pod (standalone), a bounded pool, a gate added while the
blocking pop waits is woken at once."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import redis.asyncio as aredis
from prometheus_client import CollectorRegistry

from fleetgate.client import Fleet

from ..conftest import RedisUnderTest


def _fleet(rut: RedisUnderTest, name: str, **kw: object) -> Fleet:
    return Fleet(
        rut.url,
        prefix=rut.prefix,
        registry=CollectorRegistry(),
        redis_options={"client_name": name},
        **kw,  # type: ignore[arg-type]
    )


async def _conns(r: aredis.Redis, name: str) -> int:
    return sum(1 for c in await r.client_list() if c.get("name") == name)


async def _parked(r: aredis.Redis, keys: list[str]) -> bool:
    return all([await r.zcard(k) == 1 for k in keys])


async def test_one_wake_connection_for_many_gates(
    rut: RedisUnderTest, async_redis: aredis.Redis
) -> None:
    n = 30
    pod, peer = f"pod-{uuid.uuid4().hex[:6]}", f"peer-{uuid.uuid4().hex[:6]}"
    async with _fleet(rut, pod) as waiter, _fleet(rut, peer) as holder:
        names = [f"g{i}" for i in range(n)]
        held = [await holder.gate(g, floor=1, ceiling=1).acquire() for g in names]
        parked = [
            asyncio.create_task(waiter.gate(g, floor=1, ceiling=1).acquire(deadline=20))
            for g in names
        ]
        queues = [waiter.gate(g).keys.waiters for g in names]
        for _ in range(500):
            if await _parked(async_redis, queues):
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        # pool (bounded) + ONE wake listener, whatever the number of gates
        assert await _conns(async_redis, pod) <= 8 + 1
        assert len(waiter._wakes.tasks) == 1
        for i, lease in enumerate(held):
            t0 = time.monotonic()
            await lease.release()
            got = await asyncio.wait_for(parked[i], 1.0)  # the wake list, not the heartbeat
            assert time.monotonic() - t0 < 0.5
            await got.release()


async def test_a_gate_added_while_the_pop_blocks_is_woken_at_once(rut: RedisUnderTest) -> None:
    # wake_block long and the heartbeat slow: only the re-armed pop can deliver in time
    async with (
        _fleet(rut, "w", wake_block=30.0, heartbeat_interval=5.0) as waiter,
        _fleet(rut, "h") as holder,
    ):
        for name in ("first", "second", "third"):
            held = await holder.gate(name, floor=1, ceiling=1).acquire()
            parked = asyncio.create_task(waiter.gate(name, floor=1, ceiling=1).acquire(deadline=20))
            await asyncio.sleep(0.1)  # parked, the pop blocked (with the earlier gates only)
            await held.release()
            lease = await asyncio.wait_for(parked, 1.0)
            await lease.release()
        assert len(waiter._wakes.tasks) == 1


async def test_a_busy_gate_does_not_starve_another_gates_wake(rut: RedisUnderTest) -> None:
    async with _fleet(rut, "w2") as waiter, _fleet(rut, "h2") as holder:
        busy = waiter.gate("busy", floor=1, ceiling=1)
        quiet_h = await holder.gate("quiet", floor=1, ceiling=1).acquire()
        stop = asyncio.Event()

        async def churn() -> None:
            while not stop.is_set():
                async with busy.permit(deadline=5):
                    await asyncio.sleep(0)

        churners = [asyncio.create_task(churn()) for _ in range(4)]
        parked = asyncio.create_task(waiter.gate("quiet", floor=1, ceiling=1).acquire(deadline=5))
        await asyncio.sleep(0.2)
        await quiet_h.release()
        lease = await asyncio.wait_for(parked, 1.0)
        await lease.release()
        stop.set()
        await asyncio.gather(*churners)


# -- renewals: heartbeat_many.lua and the batched heartbeat ---------------------------------


async def test_heartbeat_many_equals_one_heartbeat_per_gate(rut: RedisUnderTest) -> None:
    """heartbeat_many.lua is heartbeat.lua per gate: same renewals, grants, lost ids, pods."""
    from fleetgate._redis import connect
    from fleetgate.keys import GateKeys
    from fleetgate.scripts import GRANTED, PARKED, GateScripts, HeartbeatRequest
    from fleetgate.settings import GateSettings

    client = connect(rut.url)
    scripts = GateScripts(client)
    d = GateSettings(floor=1, ceiling=1)
    reqs = []
    for i in range(7):
        keys = GateKeys.of(rut.prefix, f"hm{i}")
        assert (await scripts.acquire(keys, "p:1", 5000, d)).status == GRANTED
        assert (await scripts.acquire(keys, "p:2", 5000, d)).status == PARKED
        if i % 2:  # a hand-off the pod did not hear of: the heartbeat reports it granted
            assert await scripts.release(keys, "p:1")
        # an unknown lease (never granted, renewal time passed): lost
        reqs.append(HeartbeatRequest(keys, "p", 10_000, [("p:1", 0), ("p:9", 0)], [("p:2", 3000)]))
    # each gate is 2 units (3 ids): one gate per call, 3 per call, all in one call
    for units, per_call in ((2, 1), (6, 3), (40, 7)):
        calls0 = await _script_calls(client)
        replies = await scripts.heartbeats(reqs, units=units)
        assert await _script_calls(client) - calls0 == -(-len(reqs) // per_call)
        for i, r in enumerate(replies):
            assert not isinstance(r, Exception)
            assert r.live_pods == 1 and r.limit == 1 and r.holders == 1
            assert r.queued == (0 if i % 2 else 1)
            if i % 2:
                assert r.lost_leases == ["p:1", "p:9"] and r.granted_waiters == ["p:2"]
            else:
                assert r.lost_leases == ["p:9"] and r.granted_waiters == []
    await client.aclose()


async def test_a_broken_gate_does_not_stop_the_other_gates_renewals(
    rut: RedisUnderTest, async_redis: aredis.Redis
) -> None:
    from fleetgate._redis import connect
    from fleetgate.errors import GateStateError
    from fleetgate.keys import GateKeys
    from fleetgate.scripts import GateScripts, HeartbeatRequest
    from fleetgate.settings import GateSettings

    client = connect(rut.url)
    scripts = GateScripts(client)
    d = GateSettings(floor=2, ceiling=2)
    keys = [GateKeys.of(rut.prefix, f"br{i}") for i in range(4)]
    for k in keys:
        await scripts.acquire(k, "p:1", 5000, d)
    await async_redis.delete(keys[2].holders)
    await async_redis.set(keys[2].holders, "not a zset")
    reqs = [HeartbeatRequest(k, "p", 10_000, [("p:1", 0)], []) for k in keys]
    replies = await scripts.heartbeats(reqs)
    assert isinstance(replies[2], GateStateError)
    for i in (0, 1, 3):
        r = replies[i]
        assert not isinstance(r, Exception) and r.lost_leases == [] and r.holders == 1
    await client.aclose()


async def _script_calls(r: aredis.Redis) -> int:
    stats = await r.info("commandstats")
    return sum(
        int(v["calls"])
        for k, v in stats.items()
        if k in ("cmdstat_evalsha", "cmdstat_eval", "cmdstat_fcall")
    )


@pytest.mark.long
async def test_many_held_and_idle_gates_cost_few_calls(
    rut: RedisUnderTest, own_redis: object
) -> None:
    """100 gates, a lease held on each: <= 10 script calls/s; then idle: <= 2 calls/s (the
    fleet alone on a private server, heartbeat at its default 1 s)."""
    url = own_redis.url  # type: ignore[attr-defined]
    r = aredis.Redis.from_url(url, decode_responses=True)
    async with Fleet(url, prefix="pc", registry=CollectorRegistry()) as fleet:
        leases = await asyncio.gather(
            *(fleet.gate(f"g{i}", floor=1, ceiling=1).acquire() for i in range(100))
        )
        await asyncio.sleep(1.5)  # the schedules fall into step
        c0, t0 = await _script_calls(r), time.monotonic()
        await asyncio.sleep(3.0)
        held = (await _script_calls(r) - c0) / (time.monotonic() - t0)
        for lease in leases:
            assert not lease.lost.is_set()
            await lease.release()
        await asyncio.sleep(1.5)
        c0, t0 = await _script_calls(r), time.monotonic()
        await asyncio.sleep(6.0)
        idle = (await _script_calls(r) - c0) / (time.monotonic() - t0)
    await r.aclose()
    assert held <= 10, held
    assert idle <= 2, idle


def test_cap_holds_across_processes_over_many_gates(rut: RedisUnderTest) -> None:
    """3 processes x 90 tasks over 15 gates (floor 2): each process has one wake listener for
    all 15 gates and renews them in batched heartbeats; no gate ever runs more than 2."""
    import multiprocessing as mp

    from .. import _workers

    gates = [f"mg{i}" for i in range(15)]
    probe = f"{rut.prefix}:probe"
    with mp.get_context("spawn").Pool(3) as pool:
        peaks = pool.starmap(_workers.hammer_gates, [(rut.url, rut.prefix, gates, 90, probe)] * 3)
    assert max(peaks) <= 2
    assert max(peaks) == 2  # the gates were contended
