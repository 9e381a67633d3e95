"""Redis Cluster: the scripts, the client and the coordinator on a real 3-master cluster, with
gates spread over slots on different nodes."""

from __future__ import annotations

import asyncio
import multiprocessing as mp

import pytest
from prometheus_client import CollectorRegistry
from redis.crc import key_slot

from fleetgate._redis import connect
from fleetgate.client import Fleet
from fleetgate.coordinator.config import Config
from fleetgate.coordinator.daemon import Coordinator
from fleetgate.keys import GateKeys
from fleetgate.scripts import GRANTED, PARKED, GateScripts
from fleetgate.settings import GateSettings
from fleetgate.status import gather_status
from fleetgate.tools.redisproc import RedisClusterProcess

from .. import _workers
from ..conftest import RedisUnderTest

pytestmark = pytest.mark.cluster
GATES = ["bge-m3", "llama", "rerank/nemo", "qwen", "e5"]


async def spread(redis_cluster: RedisClusterProcess, prefix: str) -> int:
    """How many distinct nodes own the test gates' slots."""
    client = connect(redis_cluster.url)
    await client.initialize()
    nodes = {client.get_node_from_key(GateKeys.of(prefix, g).cfg).name for g in GATES}
    await client.aclose()
    return len(nodes)


@pytest.mark.servers
async def test_scripts_on_every_node(
    cluster_rut: RedisUnderTest, redis_cluster: RedisClusterProcess
) -> None:
    assert await spread(redis_cluster, cluster_rut.prefix) >= 2
    client = connect(cluster_rut.url)
    scripts = GateScripts(client)
    d = GateSettings(floor=1, ceiling=4)
    for g in GATES:
        keys = GateKeys.of(cluster_rut.prefix, g)
        assert (await scripts.acquire(keys, "p:1", 5000, d)).status == GRANTED
        assert (await scripts.acquire(keys, "q:1", 5000, d)).status == PARKED
        assert await scripts.set_target(keys, 2, epoch=1, ttl_ms=10_000)  # growth hands off
        [wake] = await client.lrange(keys.wake("q"), 0, -1)
        assert wake.partition("=")[0] == "q:1"  # <id>=<token>
        snap = await scripts.snapshot(keys)
        assert (snap.holders, snap.queued, snap.limit) == (2, 0, 2)
    await client.aclose()


@pytest.mark.long
async def test_client_park_and_wake_on_cluster(cluster_rut: RedisUnderTest) -> None:
    async with Fleet(
        cluster_rut.url, prefix=cluster_rut.prefix, registry=CollectorRegistry()
    ) as fleet:
        for name in GATES:
            gate = fleet.gate(name, floor=1)
            held = await gate.acquire()
            parked = asyncio.create_task(gate.acquire(deadline=5))
            await asyncio.sleep(0.05)
            assert not parked.done()
            await held.release()
            lease = await asyncio.wait_for(parked, 1.0)  # the wake list, not the heartbeat
            await lease.release()
        util = await fleet.utilization(GATES[0])
        assert util.in_flight == 0 and util.queued == 0


@pytest.mark.servers
def test_cap_holds_across_processes_on_cluster(cluster_rut: RedisUnderTest) -> None:
    probe = f"{cluster_rut.prefix}:probe"
    with mp.get_context("spawn").Pool(3) as pool:
        peaks = pool.starmap(
            _workers.hammer_gates,
            [(cluster_rut.url, cluster_rut.prefix, GATES, 60, probe)] * 3,
        )
    assert max(peaks) <= 2


def _two_gates_in_one_slot() -> tuple[str, str]:
    """Two gate names whose keys share a Cluster slot (each gate's hash tag is its name)."""
    seen: dict[int, str] = {}
    for i in range(20_000):
        name = f"same-slot-{i}"
        slot = key_slot(GateKeys.of("x", name).cfg.encode())
        if slot in seen:
            return seen[slot], name
        seen[slot] = name
    raise AssertionError("no two names share a slot")


@pytest.mark.long
def test_two_gates_in_one_slot_keep_their_leases(
    cluster_rut: RedisUnderTest, rut: RedisUnderTest
) -> None:
    """A pod holding permits of two gates that share a slot renews both in one heartbeat_many
    call; the second gate's lease must be renewed on its own keys, so another process's caller
    waits until it is released (it was granted once the unrenewed lease expired: 2 running
    under a limit of 1)."""
    gates = list(_two_gates_in_one_slot())
    probe, probe_url = f"{rut.prefix}:probe", rut.url  # counted on a standalone server
    with mp.get_context("spawn").Pool(2) as pool:
        holder = pool.apply_async(
            _workers.hold_gates,
            (cluster_rut.url, cluster_rut.prefix, gates),
            dict(hold_s=3.0, probe_url=probe_url, probe=probe),
        )
        other = pool.apply_async(
            _workers.hammer_with,
            (cluster_rut.url, cluster_rut.prefix, gates[1]),
            dict(probe_url=probe_url, probe=probe, hold_s=0.2, floor=1, after_probe=1),
        )
        lost = holder.get(60)
        peak = other.get(60)
    assert lost == [False, False]
    assert peak == 1, f"{peak} running on gate {gates[1]!r} under a limit of 1"


async def test_coordinator_publishes_on_cluster(cluster_rut: RedisUnderTest) -> None:
    gates = "\n".join(f'[[gates]]\nname = "{g}"\nfloor = 3\n' for g in GATES)
    cfg = Config.from_toml_text(
        f"""
[redis]
url = "{cluster_rut.url}"
prefix = "{cluster_rut.prefix}"
[coordinator]
poll_interval = 0.3
leader_ttl = 2.0
metrics_listen = "127.0.0.1:0"
scrape_timeout = 0.2
{gates}
""",
        env={},
    )
    stop = asyncio.Event()
    coord = Coordinator(cfg, registry=CollectorRegistry())
    task = asyncio.create_task(coord.run(stop))
    client = connect(cluster_rut.url)
    try:
        for _ in range(100):
            status = await gather_status(client, cluster_rut.prefix)
            # On Cluster the registry SADD and the gates' publish calls run concurrently, so a
            # gate may be listed a moment before its first publish lands: wait for both.
            published = all(g.floor == 3 for g in status.gates)
            if len(status.gates) == len(GATES) and status.leader and published:
                break
            await asyncio.sleep(0.05)
        assert status.leader == coord.id
        assert sorted(g.name for g in status.gates) == sorted(GATES)
        assert all(g.floor == 3 and g.limit == 3 for g in status.gates)
    finally:
        stop.set()
        await task
        await client.aclose()


async def test_stored_controller_states_are_read_on_cluster(cluster_rut: RedisUnderTest) -> None:
    """A new leader reads each gate's stored state and whether its target is live, also on
    Cluster (where redis-py refuses TIME in a pipeline: a read doing so would start every
    leader change cold)."""
    from fleetgate.coordinator.publisher import Publisher

    client = connect(cluster_rut.url)
    publisher = Publisher(client, cluster_rut.prefix)
    sec, _ = await client.time()
    for g, expires in (("live", sec + 60), ("lapsed", sec - 60)):
        keys = GateKeys.of(cluster_rut.prefix, g)
        await client.hset(keys.util, "state", '{"target":40}')
        await client.hset(keys.target, mapping={"value": 40, "expires_at": expires * 1000})
    stored = await publisher.stored_states(["live", "lapsed", "none"])
    await client.aclose()
    assert stored == {
        "live": ('{"target":40}', False, None),
        "lapsed": ('{"target":40}', True, None),
        "none": (None, True, None),
    }
