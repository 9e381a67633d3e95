"""``fleetgate init`` (:mod:`fleetgate.stamp`): a stamped prefix's first permits skip the recovery
fence, a wipe removes the stamp (the fence holds again), and a prefix in use is refused.

Against private servers that never held fleetgate state (no ``<prefix>:born``), as a first
start is. Whether a permit waited behind the fence is read from the acquire reply
(``fence_ms``), or made plain by a fence longer than the permit's deadline: never a timed
bound. The fleet-level wipe tests (tests/chaos/test_wipe.py, 3 worker processes) run on a
prefix stamped by :func:`init_prefix` too (``own_redis`` in tests/conftest.py).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator

import pytest
import redis
import redis.asyncio as aredis
from prometheus_client import CollectorRegistry

from fleetgate._redis import connect
from fleetgate.client import Fleet
from fleetgate.keys import GateKeys, fleet_keys
from fleetgate.scripts import GRANTED, PARKED, GateScripts
from fleetgate.settings import GateSettings
from fleetgate.stamp import init_prefix
from fleetgate.tools.redisproc import RedisClusterProcess, RedisProcess

from .._sentinel import SentinelDeployment

FENCE_MS = 60_000  # far longer than any deadline here: a permit behind it would never come
ONE = GateSettings(floor=1, ceiling=1, max_queued=10, lease_ms=60_000, waiter_ms=60_000)


@pytest.fixture
def server() -> Iterator[RedisProcess]:
    """A private server that never held fleetgate state (a first start)."""
    with RedisProcess() as proc:
        yield proc


@pytest.fixture
async def client(server: RedisProcess) -> AsyncIterator[aredis.Redis]:
    r = aredis.Redis.from_url(server.url, decode_responses=True)
    yield r
    await r.aclose()


async def _first_acquire(client: aredis.Redis, gate: str, lease: str) -> tuple[int, int]:
    reply = await GateScripts(client).acquire_many(
        GateKeys.of("fg", gate), [(lease, 60_000)], ONE, fence_ms=FENCE_MS
    )
    return reply[0].status, reply[0].fence_ms


async def test_the_first_permit_after_init_is_not_fenced(
    server: RedisProcess, client: aredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """Script level: granted with no fence; fleet level: a 60 s fence would outlast the 5 s
    deadline, and nothing is logged about a fence."""
    outcome = await init_prefix(server.url, "fg")
    assert (outcome.result, outcome.ok) == ("stamped", True)
    assert await client.get(fleet_keys("fg").born) == "0"
    assert await _first_acquire(client, "g", "p:1") == (GRANTED, 0)
    caplog.set_level(logging.INFO, logger="fleetgate")
    async with Fleet(server.url, registry=CollectorRegistry(), recovery_fence=60) as fleet:
        async with fleet.gate("chat", floor=2).permit(deadline=5.0) as lease:
            assert lease.token > 0
    assert not [r for r in caplog.records if "recovery fence" in r.getMessage()]


async def test_an_unstamped_first_permit_waits_and_says_why_once(
    server: RedisProcess, client: aredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """The contrast: without init the first script parks behind the fence, and the Fleet logs
    one WARNING for its gates naming the command that avoids it."""
    assert await _first_acquire(client, "g", "p:1") == (PARKED, FENCE_MS)
    caplog.set_level(logging.WARNING, logger="fleetgate.client")
    async with Fleet(server.url, registry=CollectorRegistry(), recovery_fence=0.3) as fleet:
        for name in ("a", "b"):
            async with fleet.gate(name, floor=2).permit(deadline=5.0):
                pass
    said = [r for r in caplog.records if "recovery fence" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert "`fleetgate init --prefix fg`" in said[0].getMessage()


@pytest.mark.parametrize("wipe", ["flushall", "flushdb", "restart"])
async def test_a_wipe_after_init_fences_again(
    server: RedisProcess, client: aredis.Redis, wipe: str
) -> None:
    """The wipe takes the stamp with the state: the gate that held a permit parks the next
    caller behind the fence, and so does a gate never seen before."""
    assert (await init_prefix(server.url, "fg")).result == "stamped"
    assert await _first_acquire(client, "g", "p:1") == (GRANTED, 0)
    if wipe == "restart":
        server.restart()  # without persistence: empty
    else:
        with redis.Redis.from_url(server.url) as r:
            r.execute_command(wipe.upper())
    r2 = aredis.Redis.from_url(server.url, decode_responses=True)
    try:
        status, fence = await _first_acquire(r2, "g", "p:2")
        assert (status, fence > 0) == (PARKED, True)
        assert await r2.get(fleet_keys("fg").born) not in (None, "0")  # born now, not stamped
        status, fence = await _first_acquire(r2, "new", "p:3")
        assert (status, fence > 0) == (PARKED, True)
    finally:
        await r2.aclose()


async def test_a_prefix_in_use_is_refused_and_a_stamped_one_left_alone(
    server: RedisProcess, client: aredis.Redis
) -> None:
    """A key of the prefix's fleet (here a coordinator's, as after a wipe and a coordinator's
    first poll) or of a named gate refuses the stamp and writes nothing; init twice is a
    no-op; other prefixes on the server are their own."""
    await client.set("fg:leader", "coord-a")
    outcome = await init_prefix(server.url, "fg")
    assert (outcome.result, outcome.ok, outcome.found) == ("in_use", False, ("fg:leader",))
    assert await client.get(fleet_keys("fg").born) is None
    assert "not stamped" in outcome.message()
    assert (await init_prefix(server.url, "other")).result == "stamped"
    assert (await init_prefix(server.url, "other")).result == "already"
    await client.zadd(GateKeys.of("third", "g").holders, {"old:1": 1})
    outcome = await init_prefix(server.url, "third", gates=["g"])
    assert (outcome.result, outcome.found) == ("in_use", ("third:{g}:*",))
    assert await client.get(fleet_keys("third").born) is None


async def test_a_prefix_born_by_a_pod_is_in_use(server: RedisProcess, client: aredis.Redis) -> None:
    """A first script wrote ``<prefix>:born`` (its server time): that prefix is in use."""
    await _first_acquire(client, "g", "p:1")
    await client.delete(*GateKeys.of("fg", "g").data_keys())
    outcome = await init_prefix(server.url, "fg")
    assert (outcome.result, outcome.found) == ("in_use", ("fg:born",))
    assert await client.get(fleet_keys("fg").born) != "0"


@pytest.mark.timeout(90)
async def test_sentinel_a_failover_to_a_synced_replica_keeps_the_stamp() -> None:
    """Through a Sentinel URL init stamps the master; the replica has the stamp once in sync,
    so after a failover to it a new gate's first permit is still not fenced. (A replica that
    never synced holds no key at all: no stamp, and the fence holds, as for any wipe.)"""
    with SentinelDeployment() as sentinel:
        assert (await init_prefix(sentinel.url, "fg")).result == "stamped"
        with redis.Redis(port=sentinel.master.port) as master:
            assert master.execute_command("WAIT", 1, 5000) == 1  # the replica has it
        sentinel.kill_master_and_wait_failover()
        promoted = aredis.Redis(port=sentinel.replica.port, decode_responses=True)
        try:
            assert await promoted.get(fleet_keys("fg").born) == "0"
            assert await _first_acquire(promoted, "new", "p:1") == (GRANTED, 0)
        finally:
            await promoted.aclose()


@pytest.mark.cluster
@pytest.mark.timeout(90)
async def test_cluster_stamps_named_gates_and_a_node_wipe_fences_its_own() -> None:
    """Cluster: the stamp is per gate (its cfg ``fence`` = 0, in its slot). Without names init
    writes nothing; the named gates' first permits are not fenced, an unnamed gate's is; a
    FLUSHALL of the node of one stamped gate fences that gate again and leaves the stamp of a
    gate on another node."""
    with RedisClusterProcess(3) as cluster:
        assert (await init_prefix(cluster.url, "fg")).result == "needs_gates"
        client = connect(cluster.url)
        try:
            await client.initialize()
            names = _gates_on_two_nodes(client)
            outcome = await init_prefix(cluster.url, "fg", gates=names)
            assert (outcome.result, outcome.gates) == ("stamped", tuple(names))
            scripts = GateScripts(client)

            async def first(gate: str, lease: str) -> tuple[int, int]:
                keys = GateKeys.of("fg", gate)
                reply = await scripts.acquire_many(keys, [(lease, 60_000)], ONE, fence_ms=FENCE_MS)
                return reply[0].status, reply[0].fence_ms

            assert await first(names[0], "p:1") == (GRANTED, 0)
            assert (await first("unnamed", "p:2"))[0] == PARKED
            node = client.get_node_from_key(GateKeys.of("fg", names[0]).cfg)
            await client.execute_command("FLUSHALL", target_nodes=node)
            status, fence = await first(names[0], "p:3")
            assert (status, fence > 0) == (PARKED, True)
            assert await first(names[1], "p:4") == (GRANTED, 0)
        finally:
            await client.aclose()


def _gates_on_two_nodes(client: aredis.RedisCluster) -> list[str]:
    """Two gate names whose slots are served by different nodes."""
    by_node: dict[str, str] = {}
    for i in range(100):
        name = f"g{i}"
        node = client.get_node_from_key(GateKeys.of("fg", name).cfg).name
        by_node.setdefault(node, name)
        if len(by_node) == 2:
            return list(by_node.values())
    raise AssertionError("100 gates on one node")
