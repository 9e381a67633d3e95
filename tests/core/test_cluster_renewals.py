"""Redis Cluster renewals batched per node: a round of heartbeats is one pipeline per node
(calls as before, round trips one per node), and grouped gate names (``{group}name``) let a
pod's gates share a slot, so they ride in few ``heartbeat_many`` calls. On a real 3-master
cluster."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
from typing import Any

import pytest
from redis.asyncio.cluster import ClusterNode

from fleetgate._redis import connect
from fleetgate.keys import GateKeys
from fleetgate.scripts import GRANTED, GateScripts, HeartbeatRequest
from fleetgate.scripts._calls import heartbeat_rounds
from fleetgate.settings import GateSettings

from .. import _workers
from ..conftest import RedisUnderTest


def test_rounds_are_one_pipeline_per_node_within_the_units() -> None:
    nodes = ["a", "b", "a", "c", "a", "b", "a"]
    costs = [20, 5, 20, 1, 20, 50, 1]
    rounds = heartbeat_rounds(nodes, costs, 40)
    # per node, in call order, at most 40 units per round (a heavier call alone)
    assert rounds == [[0, 2, 1, 3], [4, 6, 5]]
    assert heartbeat_rounds(["", "", ""], [40, 1, 1], 40) == [[0], [1, 2]]
    assert heartbeat_rounds([], [], 40) == []


async def _held(scripts: GateScripts, names: list[str], prefix: str) -> list[HeartbeatRequest]:
    d = GateSettings(floor=1, ceiling=1)
    requests = []
    for i, name in enumerate(names):
        keys = GateKeys.of(prefix, name)
        reply = await scripts.acquire(keys, f"p:{i}", 5000, d)
        assert reply.status == GRANTED
        requests.append(HeartbeatRequest(keys, "p", 10_000, [(f"p:{i}", reply.expires_at)], []))
    return requests


@pytest.mark.cluster
@pytest.mark.parametrize("grouped", [False, True], ids=["plain", "grouped"])
async def test_a_round_is_one_pipeline_per_node(
    cluster_rut: RedisUnderTest, monkeypatch: pytest.MonkeyPatch, grouped: bool
) -> None:
    """30 held gates over the 3 masters (plain names): one heartbeat round is one pipeline per
    node (30 FCALLs, 3 round trips; before, 30 concurrent calls); in one group's slot: 2
    heartbeat_many calls. Every lease renewed on its own gate."""
    client = connect(cluster_rut.url)
    scripts = GateScripts(client)
    names = [f"{{pod-a}}r{i}" if grouped else f"r{i}" for i in range(30)]
    requests = await _held(scripts, names, cluster_rut.prefix)
    sent: list[int] = []
    real = ClusterNode.execute_pipeline

    async def counted(self: ClusterNode, commands: list[Any]) -> bool:
        sent.append(len(commands))
        return await real(self, commands)

    monkeypatch.setattr(ClusterNode, "execute_pipeline", counted)
    await asyncio.sleep(0.01)
    replies = await scripts.heartbeats(requests)
    monkeypatch.undo()
    nodes = {client.get_node_from_key(r.keys.base).name for r in requests}
    if grouped:  # one slot: 30 gates of 2 units in 2 calls of <= 40, one round each
        assert len(nodes) == 1 and sent == [1, 1], sent
    else:  # one pipeline per node, one round
        assert len(nodes) == 3 and len(sent) == 3 and sum(sent) == 30, sent
    for req, reply in zip(requests, replies, strict=True):
        assert not isinstance(reply, Exception), reply
        assert reply.lost_leases == [] and reply.holders == 1
        assert reply.expires_at >= req.leases[0][1]
    await client.aclose()


@pytest.mark.cluster
@pytest.mark.long
def test_cap_holds_across_processes_with_grouped_gates(cluster_rut: RedisUnderTest) -> None:
    """3 processes x 60 tasks over 5 gates of one group (floor 2): they share a slot, so each
    process renews them together in heartbeat_many calls and pops their wake lists together;
    no gate ever runs more than 2."""
    gates = [f"{{grp}}{g}" for g in ("bge-m3", "llama", "rerank/nemo", "qwen", "e5")]
    probe = f"{cluster_rut.prefix}:probe"
    with mp.get_context("spawn").Pool(3) as pool:
        peaks = pool.starmap(
            _workers.hammer_gates, [(cluster_rut.url, cluster_rut.prefix, gates, 60, probe)] * 3
        )
    assert max(peaks) <= 2
    assert max(peaks) == 2  # the gates were contended
