"""Redis Cluster: a busy node pool is congestion, never an outage.

redis-py's asyncio RedisCluster has no blocking pool: a call beyond a node's max_connections
raises ``MaxConnectionsError`` (a ``ConnectionError`` with an empty message). fleetgate's
permits make such a call wait for a connection; read as "Redis unreachable ()", it would serve
under the fair-share fallback with every node up.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
from typing import Any

import pytest
from redis.crc import key_slot

from fleetgate._redis import REDIS_ERRORS, connect
from fleetgate._redis.cluster import _COMMAND_TABLES
from fleetgate._redis.permits import _Permits

from ..conftest import RedisUnderTest
from . import _cluster_workers

PROCESSES = 3
GATES = 120


async def test_permits_pass_on_what_cancelled_waiters_leave() -> None:
    """A waiter cancelled while queued, or cancelled just after it was handed the permit, leaves
    the permit to the next caller (none is lost, so no later caller waits out the timeout)."""
    permits = _Permits(1, timeout=5)
    await permits.acquire()
    queued = asyncio.create_task(permits.acquire())
    await asyncio.sleep(0)  # it queues
    queued.cancel()
    with pytest.raises(asyncio.CancelledError):
        await queued
    handed = asyncio.create_task(permits.acquire())
    await asyncio.sleep(0)
    permits.release()  # handed to the waiter, which is cancelled before it runs
    handed.cancel()
    with pytest.raises(asyncio.CancelledError):
        await handed
    assert permits.free == 1
    await asyncio.wait_for(permits.acquire(), 1)  # free at once
    assert permits.free == 0


async def test_permits_wait_in_arrival_order_and_time_out() -> None:
    permits = _Permits(1, timeout=0.2)
    await permits.acquire()
    order: list[int] = []

    async def take(i: int) -> None:
        await permits.acquire()
        order.append(i)
        permits.release()

    waiters = [asyncio.create_task(take(i)) for i in range(3)]
    await asyncio.sleep(0)
    permits.release()
    await asyncio.gather(*waiters)
    assert order == [0, 1, 2]
    await permits.acquire()
    with pytest.raises(REDIS_ERRORS, match=r"no free connection .* within 0\.2 s"):
        await permits.acquire()  # the one permit is never released: an outage after 0.2 s


def _per_node(client: Any) -> dict[str, int]:
    return {n.name: len(n._connections) for n in client.get_nodes()}


@pytest.mark.cluster
async def test_calls_beyond_a_node_pool_wait_on_cluster(cluster_rut: RedisUnderTest) -> None:
    """200 concurrent calls (commands, scripts, pipelines) on a client of 2 connections per
    node: all succeed (no MaxConnectionsError read as an outage) and no node's pool
    grows past its bound."""
    client = connect(cluster_rut.url, max_connections=2)
    try:
        await client.initialize()
        script = client.register_script("return redis.call('INCR', KEYS[1])")

        async def call(i: int) -> Any:
            key = f"{cluster_rut.prefix}:{{k{i % 20}}}"
            if i % 3 == 0:
                return await script(keys=[key])
            if i % 3 == 1:
                async with client.pipeline(transaction=False) as pipe:
                    pipe.incr(key)
                    pipe.pexpire(key, 60_000)
                    return (await pipe.execute())[0]
            return await client.incr(key)

        replies = await asyncio.gather(*(call(i) for i in range(200)))
        assert all(isinstance(r, int) and r >= 1 for r in replies)
        assert max(_per_node(client).values()) <= 2
    finally:
        await client.aclose()


@pytest.mark.cluster
async def test_a_connection_not_back_yet_is_waited_for(cluster_rut: RedisUnderTest) -> None:
    """After a connection error redis-py closes the connections that were in use as they come
    back, in a background task: meanwhile the node has no free connection although no command
    of the client is in flight. A call then waits for it instead of failing."""
    client = connect(cluster_rut.url, max_connections=1)
    try:
        await client.initialize()
        key = f"{cluster_rut.prefix}:{{w}}"
        node = client.get_node_from_key(key)
        await client.set(key, "1")  # the node's one connection exists, and is free again
        closing = node.acquire_connection()  # as redis-py's background close holds it
        call = asyncio.create_task(client.get(key))
        await asyncio.sleep(0.1)
        assert not call.done()  # waiting, not failed with MaxConnectionsError
        node.release(closing)
        assert await asyncio.wait_for(call, 2) == "1"
    finally:
        await client.aclose()


@pytest.mark.cluster
async def test_a_pool_busy_past_its_timeout_is_an_outage(cluster_rut: RedisUnderTest) -> None:
    """A call that finds no free connection within the pool timeout fails as an outage, with
    a message that says why (as the standalone pool's "No connection available.")."""
    client = connect(cluster_rut.url, max_connections=1, timeout=0.2)
    try:
        await client.initialize()
        key = f"{cluster_rut.prefix}:{{b}}"
        blocked = asyncio.create_task(client.blpop([key], 1))  # holds the one permit for 1 s
        await asyncio.sleep(0.05)
        with pytest.raises(REDIS_ERRORS, match="no free connection to the Redis Cluster"):
            await client.get(key)
        assert await blocked is None
    finally:
        await client.aclose()


@pytest.mark.cluster
async def test_cluster_clients_share_one_command_table(cluster_rut: RedisUnderTest) -> None:
    """Every cluster client of one URL in a process uses the command table the first one
    loaded: a wake listener (a client of its own, per gate on Cluster) does not parse
    ``COMMAND`` (~35 ms of CPU) when it starts."""
    first = connect(cluster_rut.url)
    listener = connect(cluster_rut.url, dedicated=True)
    try:
        await first.initialize()
        await listener.initialize()
        assert listener.commands_parser.commands is first.commands_parser.commands
        assert any(cluster_rut.url.startswith(url.partition("?")[0]) for url in _COMMAND_TABLES)
        key = f"{cluster_rut.prefix}:{{t}}"
        assert await listener.blmpop(0.01, 1, key, direction="LEFT") is None  # keys found
        assert key_slot(key.encode()) == listener.keyslot(key)
    finally:
        await first.aclose()
        await listener.aclose()


@pytest.mark.slow
@pytest.mark.cluster
def test_busy_node_pools_are_no_outage(cluster_rut: RedisUnderTest, rut: RedisUnderTest) -> None:
    """3 processes, one Fleet each on the 3-master cluster, 120 gates of limit 1: on every gate
    each process holds a lease and parks a waiter at once (240 concurrent acquires per process,
    about 80 per node, beyond the pools' 64 connections per node), then every waiter is granted
    in turn. No process may fall back, and no gate may run more than 1 permit at once."""
    gates = [f"pool-{i}" for i in range(GATES)]
    probe_url, probe = rut.url, f"{rut.prefix}:probe"  # counted on a standalone server
    barrier = (f"{rut.prefix}:barrier", PROCESSES)
    with mp.get_context("spawn").Pool(PROCESSES) as pool:
        runs = [
            pool.apply_async(
                _cluster_workers.park_and_hold_each,
                (cluster_rut.url, cluster_rut.prefix, gates),
                dict(probe_url=probe_url, probe=probe, barrier=barrier, hold_s=0.3),
            )
            for _ in range(PROCESSES)
        ]
        results = [r.get(90) for r in runs]
    causes = [c for r in results for c in r["causes"]]
    seen = {
        "fallbacks": len(causes),
        "causes": sorted(set(causes)),
        "fallback_seen": any(r["fallback_seen"] for r in results),
        "local_bound_lines": sum(r["local_bounds"] for r in results),
        "peak": max(r["peak"] for r in results),
    }
    # A busy pool read as an outage shows here as 4-5 fallbacks (cause MaxConnectionsError),
    # 480-600 local-bound lines, 2-3 permits running at once on gates of limit 1.
    assert seen == {
        "fallbacks": 0,
        "causes": [],
        "fallback_seen": False,
        "local_bound_lines": 0,
        "peak": 1,
    }
    assert [r["granted"] for r in results] == [2 * GATES] * PROCESSES


@pytest.mark.cluster
async def test_script_calls_ask_no_node_for_their_keys(cluster_rut: RedisUnderTest) -> None:
    """A pod's script calls (FCALL: acquires, releases, heartbeats) are routed by the keys in
    their own arguments, as redis-py routes an EVALSHA: no ``COMMAND GETKEYS`` round trip to a
    node before a call (redis-py asks the server for the keys of a command with movable keys:
    before, every call of this test's pod did: 66 of 66)."""
    from prometheus_client import CollectorRegistry

    from fleetgate.client import Fleet

    probe = connect(cluster_rut.url)
    await probe.initialize()

    async def calls(command: str) -> int:
        stats = await probe.info("commandstats", target_nodes=probe.get_primaries())
        return sum(int(node.get(command, {}).get("calls", 0)) for node in stats.values())

    before = await calls("cmdstat_command|getkeys"), await calls("cmdstat_fcall")
    async with Fleet(
        cluster_rut.url,
        prefix=cluster_rut.prefix,
        registry=CollectorRegistry(),
        heartbeat_interval=0.2,
        recovery_fence=0,
    ) as fleet:
        for i in range(10):
            gate = fleet.gate(f"gk{i}", floor=1, ceiling=1)
            held = await gate.acquire()
            parked = asyncio.create_task(gate.acquire(deadline=5))
            await asyncio.sleep(0.05)
            await held.release()
            await (await parked).release()
        await asyncio.sleep(0.5)  # heartbeats
    after = await calls("cmdstat_command|getkeys"), await calls("cmdstat_fcall")
    await probe.aclose()
    assert after[1] - before[1] >= 40  # the calls were made
    assert after[0] == before[0], (before, after)
