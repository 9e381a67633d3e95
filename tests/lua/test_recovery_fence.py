"""What the recovery fence (``lua/lib_fence.lua`` gate_birth) costs, and when it applies.

The fleet-level behaviour (a wiped gate grants nothing while the old pods' work still runs) is
tests/chaos/test_wipe.py; here: a gate with state pays nothing, a first start on an empty
server pays at most one fence on the gates it meets first, a later new gate pays nothing on a
standalone server and one fence on Cluster, state from before birth marks is not fenced, and a
caller parked behind the fence is handed its permit when the fence ends, not a heartbeat later.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aredis
from prometheus_client import CollectorRegistry

from fleetgate.client import Fleet
from fleetgate.keys import GateKeys, fleet_keys
from fleetgate.scripts import GRANTED, PARKED, GateScripts
from fleetgate.settings import GateSettings
from fleetgate.tools.redisproc import RedisProcess

from .._servers import MatrixServer
from ..conftest import RedisUnderTest

# the scripts against each server of the matrix (tests/_servers.py)
pytestmark = pytest.mark.servers

FENCE_MS = 600
ONE = GateSettings(floor=1, ceiling=1, max_queued=10, lease_ms=60_000, waiter_ms=60_000)


@pytest.fixture
async def empty(matrix_server: MatrixServer | None) -> AsyncIterator[aredis.Redis]:
    """A server of the matrix's kind that never held fleetgate state (no ``fg:born``: a first
    start)."""
    with RedisProcess(binary=matrix_server.binary if matrix_server else None) as proc:
        r = aredis.Redis.from_url(proc.url, decode_responses=True)
        yield r
        await r.aclose()


async def test_first_start_fences_the_first_gates_only(empty: aredis.Redis) -> None:
    scripts = GateScripts(empty)
    first = GateKeys.of("fg", "first")
    reply = await scripts.acquire_many(first, [("p:1", 60_000)], ONE, fence_ms=FENCE_MS)
    assert reply[0].status == PARKED and 0 < reply[0].fence_ms <= FENCE_MS
    born = int(await empty.get(fleet_keys("fg").born) or 0)
    assert born > 0 and await empty.hget(first.cfg, "fence") == str(born + FENCE_MS)
    # a gate first met after the fence period is new, not wiped: granted at once
    await asyncio.sleep(FENCE_MS / 1000 + 0.05)
    later = GateKeys.of("fg", "later")
    reply = await scripts.acquire_many(later, [("p:2", 60_000)], ONE, fence_ms=FENCE_MS)
    assert (reply[0].status, reply[0].fence_ms) == (GRANTED, 0)
    # born ('fence' present), never fenced (it ends when it began)
    assert int(await empty.hget(later.cfg, "fence") or 0) <= born + FENCE_MS + 200
    # the parked caller of the first gate is handed the permit by the next script after the
    # fence (here a heartbeat of another pod)
    await scripts.heartbeat(first, "q", 10_000, [], [], fence_ms=FENCE_MS)
    assert await empty.zscore(first.holders, "p:1") is not None


async def test_a_gate_with_state_pays_nothing(empty: aredis.Redis) -> None:
    """Once born, the fence fields ride the configuration read every script makes; a gate whose
    fence has passed grants at once whatever the node marker says (deleted here)."""
    scripts = GateScripts(empty)
    keys = GateKeys.of("fg", "g")
    await scripts.acquire_many(keys, [("p:1", 60_000)], ONE, fence_ms=100)
    await asyncio.sleep(0.15)
    await empty.delete(fleet_keys("fg").born)
    reply = await scripts.acquire_many(keys, [("p:2", 60_000)], ONE, fence_ms=FENCE_MS)
    assert reply[0].fence_ms == 0
    assert await empty.get(fleet_keys("fg").born) is None  # not looked at: no write, no read


async def test_no_fence_without_a_fence_length(empty: aredis.Redis) -> None:
    """fence_ms 0 (fleetgate.testing, the coordinator's sweep) marks nothing and grants."""
    scripts = GateScripts(empty)
    keys = GateKeys.of("fg", "g")
    reply = await scripts.acquire_many(keys, [("p:1", 60_000)], ONE)
    assert (reply[0].status, reply[0].fence_ms) == (GRANTED, 0)
    assert await empty.hget(keys.cfg, "fence") is None
    assert await empty.get(fleet_keys("fg").born) is None


async def test_state_from_before_birth_marks_is_not_fenced(empty: aredis.Redis) -> None:
    """A gate with holders but no 'fence' (written by a fleetgate without the fence) is marked
    born at once, without a fence; the server is not marked (its other gates say for
    themselves)."""
    scripts = GateScripts(empty)
    keys = GateKeys.of("fg", "old")
    await empty.zadd(keys.holders, {"old:1": time.time() * 1000 + 60_000})
    reply = await scripts.acquire_many(keys, [("p:1", 60_000)], ONE, fence_ms=FENCE_MS)
    assert (reply[0].status, reply[0].fence_ms) == (PARKED, 0)  # parked: the limit is full
    assert await empty.hget(keys.cfg, "fence") is not None
    assert await empty.get(fleet_keys("fg").born) is None


async def test_a_pod_without_a_fence_does_not_lift_it_for_the_server(
    empty: aredis.Redis,
) -> None:
    """After a FLUSHALL an idle pod without a fence (recovery_fence=0, or a fleetgate without
    one) beats gate X, so X has a live pod but no mark. The next fenced script on X does not
    take that for old state: the server stays fenced (``fg:born`` not 0), and a fresh pod on
    gate G parks while A's work there is still uncounted (granted at once, 4 units would be held
    under a limit of 2)."""
    scripts = GateScripts(empty)
    g, x = GateKeys.of("fg", "g"), GateKeys.of("fg", "x")
    two = GateSettings(floor=2, ceiling=2, max_queued=10, lease_ms=60_000, waiter_ms=60_000)
    await empty.set(fleet_keys("fg").born, 0)  # a server long in use
    for lid in ("a:1", "a:2"):
        await scripts.acquire_many(g, [(lid, 60_000)], two, fence_ms=FENCE_MS)
    await empty.flushall()
    await scripts.heartbeat(x, "z", 10_000, [], [], fence_ms=0)  # the pod without a fence
    await scripts.heartbeat(x, "b", 10_000, [], [], fence_ms=FENCE_MS)
    assert await empty.get(fleet_keys("fg").born) != "0"
    reply = await scripts.acquire_many(g, [("c:1", 60_000)], two, fence_ms=FENCE_MS)
    assert (reply[0].status, reply[0].fence_ms > 0) == (PARKED, True)


async def test_parked_caller_is_granted_when_the_fence_ends(empty: aredis.Redis) -> None:
    """The acquire reply says how long the fence holds; the pod beats the gate then. With a
    2 s heartbeat the caller would otherwise wait up to a renewal period (2 s) longer."""
    url = f"redis://127.0.0.1:{empty.connection_pool.connection_kwargs['port']}/0"
    async with Fleet(
        url, registry=CollectorRegistry(), heartbeat_interval=2.0, recovery_fence=0.5
    ) as fleet:
        t0 = time.monotonic()
        async with fleet.gate("g", floor=2).permit(deadline=10):
            waited = time.monotonic() - t0
    assert 0.45 <= waited < 1.0, waited


@pytest.mark.cluster
async def test_every_new_gate_is_fenced_on_cluster(cluster_rut: RedisUnderTest) -> None:
    """A gate's script reaches only its own slot on Cluster: no node marker, so a new gate is
    fenced like a wiped one (and granted when the fence ends)."""
    async with Fleet(
        cluster_rut.url, prefix=cluster_rut.prefix, registry=CollectorRegistry(),
        heartbeat_interval=0.2, recovery_fence=0.4,
    ) as fleet:  # fmt: skip
        for name in ("a", "b"):
            t0 = time.monotonic()
            async with fleet.gate(name, floor=2).permit(deadline=10):
                waited = time.monotonic() - t0
            assert 0.35 <= waited < 1.0, (name, waited)
        t0 = time.monotonic()
        async with fleet.gate("a").permit(deadline=10):  # has state now: at once
            assert time.monotonic() - t0 < 0.2
