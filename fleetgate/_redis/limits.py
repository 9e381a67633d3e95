"""How many connections a client pools and how long a call waits for one: the bounds shared by
the standalone, Sentinel and Cluster clients; and the most arguments one command may carry."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TypeVar

__all__ = ["CLUSTER_MAX_CONNECTIONS", "MAX_ARGS", "MAX_CONNECTIONS", "POOL_TIMEOUT", "in_chunks"]

_T = TypeVar("_T")

# The most arguments (the command's name included) of any command fleetgate sends: ElastiCache
# Serverless refuses a request of more than 3,999 arguments. A command whose arguments grow with
# the load (the ids of one heartbeat or adoption, gate names for the registry) is sent in
# chunks; an acquire batch stays below it by MAX_BATCH (fleetgate.scripts._argv). `fleetgate
# check` reports a server that refuses fewer (docs/operations.md, "Managed Redis").
MAX_ARGS = 3999

# Connections of one process' pool (per node on Cluster), whatever its number of gates or
# concurrent calls. Calls beyond it wait for a free connection (a blocking pool) instead of
# failing with "Too many connections", which would read as an outage. Redis runs commands one at
# a time, so more connections buy little throughput (a call is one round trip of ~0.1 ms), and
# 200 pods x 64 would approach Redis' default maxclients (10,000). A URL's max_connections or
# redis_options={"max_connections": n} override it.
MAX_CONNECTIONS = 8
# Cluster: the commands one cluster client has in flight at once, and so the connections of each
# node's pool (a command holds at most one connection per node, so no node's pool is asked for
# more than this; calls beyond wait: _PooledCluster). As on standalone: Redis runs one command
# at a time per node, a call is a round trip of ~0.1-0.3 ms, and acquires and releases of one
# gate go out as one call per batch, so 8 in flight cover a busy pod's calls; a pod holds at most
# 8 per node + one wake connection per node (27 on 3 masters; it was 64 per node, and 461
# connections at 100 gates with the wake listeners: benchmarks/README.md, "pod_cost and handoff
# on Cluster").
CLUSTER_MAX_CONNECTIONS = 8
# Seconds a call waits for a free connection (standalone, Sentinel) or a free command slot of a
# cluster client before it fails as an outage: a pool busy that long means Redis does not answer
# (every call in flight waits out its socket_timeout, 2 s, meanwhile).
POOL_TIMEOUT = 10.0


def in_chunks(items: Sequence[_T], size: int) -> Iterator[Sequence[_T]]:
    """``items`` in consecutive slices of at most ``size`` (one command's share of
    :data:`MAX_ARGS`); nothing for no items."""
    for start in range(0, len(items), size):
        yield items[start : start + size]
