"""Where a benchmark runs: a private standalone redis-server or a private 3-master Redis Cluster
(to measure pod cost and hand-off on Cluster), both on free loopback ports, as one :class:`Target`.

A benchmark takes a :class:`Target` and never asks which kind it has: the fleet connects to
``target.url`` (``?cluster=1`` on a Cluster), gate setup and sampling go to the node that owns
the gate's slot (:meth:`Target.node_for`: every key of a gate shares its hash tag), and what the
server saw is summed over every master (:meth:`Target.counters`, :meth:`Target.connections`).
The Cluster's nodes are ``fleetgate.tools.redisproc.RedisClusterProcess`` (no replicas, as the
client's Cluster tests use); the chaos tests' replicated cluster is not needed to measure cost.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import redis
from redis.crc import key_slot

from fleetgate.tools.redisproc import RedisClusterProcess

from ._server import add_counters, private_redis

__all__ = [
    "CLUSTER_MASTERS",
    "MODES",
    "Target",
    "add_counters",
    "private_cluster",
    "script_calls",
    "target",
]

#: the two kinds of target, in the order a run measures them
MODES = ("standalone", "cluster")
CLUSTER_MASTERS = 3


@dataclass(frozen=True)
class Target:
    """A private Redis to benchmark against: ``url`` for fleets, ``nodes`` = each master's plain
    ``redis://`` URL (one for a standalone server), ``slots[i]`` = the slot ranges of
    ``nodes[i]``."""

    mode: str
    url: str
    nodes: tuple[str, ...]
    slots: tuple[tuple[tuple[int, int], ...], ...] = ()

    @property
    def cluster(self) -> bool:
        return self.mode == "cluster"

    def node_for(self, key: str) -> str:
        """The plain URL of the node that holds ``key`` (standalone: the server)."""
        if not self.cluster:
            return self.nodes[0]
        slot = key_slot(key.encode())
        for node, ranges in zip(self.nodes, self.slots, strict=True):
            if any(lo <= slot <= hi for lo, hi in ranges):
                return node
        raise LookupError(f"no master owns slot {slot}")

    def clients(self) -> list[redis.Redis]:
        return [redis.Redis.from_url(u, decode_responses=True) for u in self.nodes]

    def counters(self) -> dict[str, float]:
        """``calls:<cmd>``/``usec:<cmd>`` of INFO commandstats and ``cpu:redis`` (user + sys
        seconds), summed over every master."""
        out: dict[str, float] = {}
        for r in self.clients():
            with r:
                add_counters(out, r.info("commandstats"), r.info("cpu"))
        return out

    def connections(self, name: str) -> int:
        """Connections named ``name`` (``CLIENT SETNAME``), over every master."""
        total = 0
        for r in self.clients():
            with r:
                total += sum(1 for c in r.client_list() if c.get("name") == name)
        return total


def script_calls(counters: dict[str, float]) -> tuple[float, float]:
    """Script calls and their server µs in ``counters``: EVAL, EVALSHA and FCALL (the gate
    library's calls), each call of a pipeline counted."""
    names = ("eval", "evalsha", "fcall")
    return (
        sum(counters.get(f"calls:{n}", 0.0) for n in names),
        sum(counters.get(f"usec:{n}", 0.0) for n in names),
    )


def _slot_map(port: int) -> tuple[tuple[str, ...], tuple[tuple[tuple[int, int], ...], ...]]:
    with redis.Redis(port=port, decode_responses=True) as r:
        shards: Any = r.execute_command("CLUSTER", "SLOTS")
    by_node: dict[str, list[tuple[int, int]]] = {}
    for lo, hi, master, *_ in shards:
        host, node_port = master[0], master[1]
        by_node.setdefault(f"redis://{host}:{node_port}/0", []).append((int(lo), int(hi)))
    nodes = tuple(sorted(by_node))
    return nodes, tuple(tuple(by_node[n]) for n in nodes)


@contextmanager
def private_cluster(masters: int = CLUSTER_MASTERS) -> Iterator[Target]:
    """A private Redis Cluster of ``masters`` masters (no replicas) on free ports."""
    with RedisClusterProcess(masters) as proc:
        nodes, slots = _slot_map(proc.nodes[0].port)
        yield Target("cluster", proc.url, nodes, slots)


@contextmanager
def target(mode: str) -> Iterator[Target]:
    """A private target of ``mode`` (one of :data:`MODES`)."""
    if mode == "cluster":
        with private_cluster() as t:
            yield t
        return
    with private_redis() as proc:
        yield Target("standalone", proc.url, (proc.url,))
