"""Redis Cluster wake-ups on one connection per node: a pod subscribes to its wake channels
(``SSUBSCRIBE``) on one pub/sub connection per node, a granting script ``SPUBLISH``-es there,
and a wake nobody heard waits in the list, popped at the next subscription. On a real 3-master
cluster; each pod names its connections (``client_name``) so ``CLIENT LIST`` on every node
counts them."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import pytest
import redis
from prometheus_client import CollectorRegistry

from fleetgate._redis import connect
from fleetgate.client import Fleet
from fleetgate.keys import GateKeys
from fleetgate.scripts import GRANTED, GateScripts
from fleetgate.settings import GateSettings
from fleetgate.tools.redisproc import RedisClusterProcess

from ..conftest import RedisUnderTest

pytestmark = pytest.mark.cluster
ONE = GateSettings(floor=1, ceiling=1)


def masters(cluster: RedisClusterProcess) -> list[redis.Redis]:
    """A plain client of each master of the cluster (no replicas here)."""
    return [redis.Redis(port=n.port, decode_responses=True) for n in cluster.nodes]


def pod_clients(nodes: list[redis.Redis], name: str) -> list[list[dict[str, Any]]]:
    """The connections named ``name`` on each node (CLIENT LIST)."""
    return [[c for c in n.client_list() if c.get("name") == name] for n in nodes]


def _fleet(url: str, prefix: str, name: str) -> Fleet:
    # A 5 s heartbeat (waiters renewed every 5/3 s at most): a wake within 0.5 s is no heartbeat
    # catching up.
    return Fleet(
        url,
        prefix=prefix,
        registry=CollectorRegistry(),
        heartbeat_interval=5.0,
        recovery_fence=0,
        redis_options={"client_name": name},
    )


async def _hold(scripts: GateScripts, prefix: str, names: list[str]) -> list[GateKeys]:
    held = []
    for n in names:
        keys = GateKeys.of(prefix, n)
        assert (await scripts.acquire(keys, "holder:1", 30_000, ONE)).status == GRANTED
        held.append(keys)
    return held


async def _park(fleet: Fleet, names: list[str]) -> list[asyncio.Task[Any]]:
    tasks = [
        asyncio.create_task(fleet.gate(n, floor=1, ceiling=1).acquire(deadline=20)) for n in names
    ]
    await asyncio.sleep(0.5)  # parked and subscribed
    assert not any(t.done() for t in tasks)
    return tasks


async def test_a_hundred_gates_wake_on_one_connection_per_node_within_30_connections(
    cluster_rut: RedisUnderTest, redis_cluster: RedisClusterProcess
) -> None:
    """100 gates over the 3 masters, 100 acquires parked at once: the pod holds one pub/sub
    connection per node carrying all its 100 shard subscriptions, at most 30 connections in all
    (before: 461, a wake listener per gate and pools of 64 per node), and every parked caller
    is woken by its channel within 0.5 s of the releases."""
    nodes = masters(redis_cluster)
    name = f"pod-{uuid.uuid4().hex[:8]}"
    gates = [f"w{i}" for i in range(100)]
    other = connect(cluster_rut.url)
    scripts = GateScripts(other)
    held = await _hold(scripts, cluster_rut.prefix, gates)
    async with _fleet(cluster_rut.url, cluster_rut.prefix, name) as fleet:
        tasks = await _park(fleet, gates)
        per_node = pod_clients(nodes, name)
        subscribers = [[c for c in conns if int(c.get("ssub", 0)) > 0] for conns in per_node]
        assert [len(s) for s in subscribers] == [1, 1, 1], per_node
        assert sum(int(s[0]["ssub"]) for s in subscribers) == 100
        assert sum(len(c) for c in per_node) <= 30, [len(c) for c in per_node]
        t0 = time.monotonic()
        await asyncio.gather(*(scripts.release(k, "holder:1") for k in held))
        leases = await asyncio.wait_for(asyncio.gather(*tasks), 0.5)
        woken = time.monotonic() - t0
        peak = sum(len(c) for c in pod_clients(nodes, name))
        for lease in leases:
            await lease.release()
    assert peak <= 30, peak
    assert woken < 0.5, woken
    await other.aclose()
    for n in nodes:
        n.close()


def _subscriber_of(fleet: Fleet) -> Any:
    nodes = fleet._wakes._nodes
    assert nodes is not None and nodes.subscriber is not None
    return nodes.subscriber


async def test_a_killed_subscriber_connection_loses_no_wake(
    cluster_rut: RedisUnderTest, redis_cluster: RedisClusterProcess
) -> None:
    """The pod's pub/sub connections killed (CLIENT KILL) while callers are parked: the grants
    made before they subscribe again go to the lists (nobody heard them) and are popped when
    they do, a second after (the reconnect pause), long before the 5 s heartbeat."""
    nodes = masters(redis_cluster)
    name = f"pod-{uuid.uuid4().hex[:8]}"
    gates = [f"k{i}" for i in range(6)]
    other = connect(cluster_rut.url)
    scripts = GateScripts(other)
    held = await _hold(scripts, cluster_rut.prefix, gates)
    async with _fleet(cluster_rut.url, cluster_rut.prefix, name) as fleet:
        tasks = await _park(fleet, gates)
        killed = 0
        for node, conns in zip(nodes, pod_clients(nodes, name), strict=True):
            for c in conns:
                if int(c.get("ssub", 0)) > 0:
                    killed += node.client_kill_filter(_id=c["id"])
        assert killed == 3
        t0 = time.monotonic()
        await asyncio.gather(*(scripts.release(k, "holder:1") for k in held))
        leases = await asyncio.wait_for(asyncio.gather(*tasks), 3.0)
        woken = time.monotonic() - t0
        assert sum(len(s) for s in _subscriber_of(fleet).channels_by_node().values()) == 6
        for lease in leases:
            await lease.release()
    assert woken < 2.0, woken  # reconnect after min(1 s, heartbeat), then the list is popped
    await other.aclose()
    for n in nodes:
        n.close()


def _migrate(nodes: list[redis.Redis], slot: int) -> tuple[str, str]:
    """Move ``slot`` to another master (keys and all); returns (source, destination) node
    names."""
    ids = {n: n.execute_command("CLUSTER", "MYID") for n in nodes}
    src = next(n for n in nodes if slot in _slots(n))
    dst = next(n for n in nodes if n is not src)
    dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[src])
    src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[dst])
    while keys := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
        port = dst.connection_pool.connection_kwargs["port"]
        src.execute_command("MIGRATE", "127.0.0.1", port, "", 0, 5000, "KEYS", *keys)
    for n in nodes:
        n.execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[dst])
    name = "127.0.0.1:{}"
    return (
        name.format(src.connection_pool.connection_kwargs["port"]),
        name.format(dst.connection_pool.connection_kwargs["port"]),
    )


def _slots(node: redis.Redis) -> set[int]:
    me = node.execute_command("CLUSTER", "MYID")
    out: set[int] = set()
    for start, end, *owners in node.execute_command("CLUSTER", "SLOTS"):
        if owners[0][2] == me:
            out.update(range(int(start), int(end) + 1))
    return out


async def test_a_slot_migrated_while_callers_park_still_wakes_them(
    cluster_rut: RedisUnderTest, redis_cluster: RedisClusterProcess
) -> None:
    """The gate's slot moved to another master while a caller is parked: the pod's subscription
    follows the slot (the server drops it, the old node answers MOVED) to the new owner's
    connection, and the hand-off after the move wakes the caller by its channel."""
    from redis.crc import key_slot

    nodes = masters(redis_cluster)
    name = f"pod-{uuid.uuid4().hex[:8]}"
    gate = f"mig-{uuid.uuid4().hex[:6]}"
    keys = GateKeys.of(cluster_rut.prefix, gate)
    other = connect(cluster_rut.url)
    scripts = GateScripts(other)
    [held] = await _hold(scripts, cluster_rut.prefix, [gate])
    async with _fleet(cluster_rut.url, cluster_rut.prefix, name) as fleet:
        [task] = await _park(fleet, [gate])
        channel = keys.wake(fleet.pod_key)
        sub = _subscriber_of(fleet)
        [before] = [n for n, chans in sub.channels_by_node().items() if channel in chans]
        src, dst = _migrate(nodes, key_slot(channel.encode()))
        assert before == src
        t0 = time.monotonic()
        while channel not in sub.channels_by_node().get(dst, set()):
            assert time.monotonic() - t0 < 4.0, sub.channels_by_node()
            await asyncio.sleep(0.01)
        followed = time.monotonic() - t0
        t1 = time.monotonic()
        assert await scripts.release(held, "holder:1")
        lease = await asyncio.wait_for(task, 1.0)
        woken = time.monotonic() - t1
        await lease.release()
    assert woken < 0.5, woken
    assert followed < 4.0
    await other.aclose()
    for n in nodes:
        n.close()
