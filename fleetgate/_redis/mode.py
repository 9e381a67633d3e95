""":class:`RedisMode`, the one object that knows whether a client talks to a standalone Redis or
a Redis Cluster (callers never ask). A Sentinel URL gives a client of the current master, which
is standalone here."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from inspect import isawaitable
from typing import Any

import redis.asyncio as aredis
from redis.crc import key_slot
from redis.exceptions import RedisClusterException

from fleetgate._redis.outage import REDIS_ERRORS
from fleetgate._redis.shard_pubsub import OnMessage, OnSubscribed, ShardSubscriber
from fleetgate.keys import GateKeys

__all__ = ["AnyRedis", "BatchCall", "RedisMode", "prepare"]

AnyRedis = aredis.Redis | aredis.RedisCluster

# What prepare() tolerates: unreachable, or a cluster that cannot be mapped yet.
_PREPARE_ERRORS: tuple[type[BaseException], ...] = (*REDIS_ERRORS, RedisClusterException)

# One command of a batch: given the pipeline (standalone) or the client (Cluster), issue it;
# what it returns is awaited when awaitable (a script call queues itself on a pipeline that way).
BatchCall = Callable[[Any], Any]


class RedisMode:
    """A redis-py asyncio client and the way of talking to it that its mode needs.

    Standalone and Redis Cluster differ in four places, all here: the topology load before
    concurrent use (:meth:`prepare`), commands that go to every primary (:meth:`each_primary`),
    dropping idle connections (:meth:`disconnect_idle`) and batches of gate commands
    (:meth:`batch`: one pipeline, or concurrent calls because Cluster refuses scripts in
    pipelines). A Sentinel URL gives a client of the current master: standalone here.
    """

    __slots__ = ("client", "cluster")

    def __init__(self, client: Any) -> None:
        self.client = client
        #: informative only: callers use the methods below, never this flag
        self.cluster = isinstance(client, aredis.RedisCluster)

    async def prepare(self) -> None:
        """Load a cluster client's topology before concurrent use.

        redis-py's asyncio ``RedisCluster`` can corrupt a connection when many first commands
        race its lazy initialisation (seen with redis-py 8.1); one explicit ``initialize()``
        avoids it. A standalone client needs nothing. Unreachable Redis is left to the caller's
        first command, so a process may start before its Redis: that includes redis-py's
        ``RedisClusterException`` "Redis Cluster cannot be connected" (which is not a
        ``ConnectionError``), raised when no startup node answers -- or when the ACL refuses
        ``CLUSTER SLOTS``/``COMMAND``, which redis-py 8.1 misreports as "Cluster mode is not
        enabled on this node".
        """
        if self.cluster:
            try:
                await self.client.initialize()
            except _PREPARE_ERRORS:
                pass

    async def each_primary(self, command: Callable[..., Awaitable[Any]]) -> list[tuple[str, Any]]:
        """``command(**target)`` on every node that takes writes, as ``(label, reply)``.

        ``target`` is empty on a standalone Redis (label ``""``) and ``target_nodes=node`` per
        Cluster primary (label ``"host:port "``, ready to prefix a message).
        """
        if not self.cluster:
            return [("", await command())]
        out = []
        for node in self.client.get_primaries():
            out.append((f"{node.host}:{node.port} ", await command(target_nodes=node)))
        return out

    def script_keys(self, keys: GateKeys) -> list[str]:
        """KEYS of a script call on gate ``keys``.

        The scripts need only the gate's base name (``lua/lib_gate.lua`` derives the rest), which is
        all a standalone Redis gets (ten names cost the client more to encode: the "+ gate
        KEYS/ARGV" row of ``benchmarks/uncontended.py``: 66 → 11-16 µs per acquire + release pair
        at p50 in the runs of 2026-12-01). On
        Cluster every data key is declared too: during a slot migration Redis decides from the
        declared keys whether a call runs on the migrating node, is redirected to the importing
        one (ASK) or retried (TRYAGAIN); a call declaring only a name that never exists would be
        redirected while the gate's keys still live on the old node, and write a second copy of
        them there (tests/chaos/test_cluster_faults.py::test_slot_migration_under_load: MIGRATE
        then failed with BUSYKEY).
        """
        return keys.declared_keys() if self.cluster else keys.script_keys()

    def slot_group(self, key: str) -> int:
        """Keys of one group may go into one command or script call (``BLPOP k1 k2 ...``, one
        ``heartbeat_many.lua`` for several gates).

        Standalone (and Sentinel): every key, one group. Cluster: the key's slot, since a
        command's keys must share one slot there (each gate's keys carry its own hash tag, so in
        practice one group per gate on Cluster).
        """
        return key_slot(key.encode()) if self.cluster else 0

    def node_group(self, key: str) -> str:
        """Keys of one node group are served by one node: standalone (and Sentinel) ``""``;
        Cluster the name (``host:port``) of the primary serving the key's slot, as the client's
        topology has it (a stale map only costs a redirection, which redis-py follows)."""
        if not self.cluster:
            return ""
        try:
            return str(self.client.get_node_from_key(key).name)
        except (RedisClusterException, AttributeError, KeyError, IndexError):
            return ""  # no topology yet: one group, a pipeline routes each call anyway

    def shard_subscriber(
        self,
        on_message: OnMessage,
        on_subscribed: OnSubscribed,
        *,
        ping_every: float,
        retry_after: float,
    ) -> ShardSubscriber | None:
        """Cluster: a :class:`ShardSubscriber` (shard channels on one connection per node) of
        this client's nodes. Standalone (and Sentinel): None -- wake-ups are popped from lists
        there, one blocking pop per 64 lists on one connection, which measures better than
        pub/sub on one server (``client/_wakes.py``)."""
        if not self.cluster:
            return None
        return ShardSubscriber(
            self.client,
            on_message,
            on_subscribed,
            ping_every=ping_every,
            retry_after=retry_after,
        )

    async def disconnect_idle(self) -> None:
        """Close the idle pooled connections (of every node, for a cluster client).

        Connections that were mid-command when Redis went away go back to redis-py's pool (8.1)
        in a state its connection check misses: their next command fails with "Connection
        closed by server.", which read as a second outage right after recovery (every pod fell
        back again within 2 ms of resuming fleet mode in
        tests/chaos/test_redis_restart.py::test_redis_restart_fair_share). New connections are
        opened on demand.
        """
        if not self.cluster:
            await self.client.connection_pool.disconnect(inuse_connections=False)
            return
        for node in self.client.get_nodes():
            await node.disconnect_free_connections()

    async def batch(
        self, calls: Sequence[BatchCall], *, raise_on_error: bool = True, pipelined: bool = False
    ) -> list[Any]:
        """Run ``calls`` (each on a different gate, say) and return their replies in order.

        Standalone: one pipeline without MULTI (one round trip). Cluster: concurrent calls, a
        round trip and a connection each; ``pipelined``: one cluster pipeline, which redis-py
        splits by node and sends as one pipeline per node, concurrently (one round trip per
        node; a call redirected by MOVED, ASK or TRYAGAIN is sent again alone, redirections
        followed). A pipeline's scripts run back to back on their node, so callers keep its
        server time small (the heartbeat's rounds: :meth:`GateScripts.heartbeats`).
        ``raise_on_error=False`` returns a failed call's exception as its reply.
        """
        if not calls:
            return []
        if self.cluster and not pipelined:
            return list(
                await asyncio.gather(
                    *(_run(call, self.client) for call in calls),
                    return_exceptions=not raise_on_error,
                )
            )
        # As a context manager: a connection error while redis-py loads the scripts (before
        # execute's own reset) would otherwise leave the pipeline holding its connection.
        async with self.client.pipeline(transaction=False) as pipe:
            for call in calls:
                queued = call(pipe)
                if isawaitable(queued):
                    await queued  # a script on a pipeline: awaiting only queues its EVALSHA
            return list(await pipe.execute(raise_on_error=raise_on_error))


async def _run(call: BatchCall, client: Any) -> Any:
    # The call is made inside the task: a task cancelled before its first step (a fleet
    # closing as the batch starts) then leaves no coroutine of the call behind unawaited.
    value = call(client)
    return await value if isawaitable(value) else value


async def prepare(client: Any) -> None:
    """Load a cluster client's topology before concurrent use (see :meth:`RedisMode.prepare`)."""
    await RedisMode(client).prepare()
