"""The cluster client fleetgate uses: redis-py's asyncio ``RedisCluster`` with a blocking bound on
the commands in flight (:class:`_PooledCluster`) and one command table per process and cluster
(:class:`_CommandTable`)."""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any

import redis.asyncio as aredis
from redis._parsers.commands import AsyncCommandsParser
from redis.asyncio.cluster import ClusterPipeline
from redis.exceptions import MaxConnectionsError

from fleetgate._redis.limits import POOL_TIMEOUT
from fleetgate._redis.permits import _Permits

# The cluster client whose permit the current task holds (a nested call takes none: redis-py
# runs initialize() and a pipeline's redirected commands inside the call that holds it).
_HOLDER: contextvars.ContextVar[object] = contextvars.ContextVar("fleetgate_cluster_permit")

# After a connection error redis-py 8.1 closes the connections that were in use as they come
# back, in a background task: for a moment such a connection is neither free nor closed, and a
# node whose other connections are all busy raises MaxConnectionsError although fewer commands
# than max_connections are in flight. Nothing was sent then, so the call is sent again after
# this pause (until the pool timeout).
_BUSY_RETRY = 0.002


# Commands whose keys _CommandTable reads from their arguments.
_FCALLS = ("FCALL", "FCALL_RO")

# The command table of each cluster (by URL) this process has loaded: see _CommandTable.
_COMMAND_TABLES: dict[str, dict[str, Any]] = {}


class _CommandTable(AsyncCommandsParser):
    """redis-py's cluster command table (where each command's keys are), loaded once per
    process and cluster instead of once per client.

    redis-py loads it with every client's first topology load: ``COMMAND``, whose reply (every
    command of the server) is most of a cluster client's start-up CPU. Each wake listener was a
    cluster client of its own (one per gate on Cluster, before the shard channels), so a pod
    parking on 120 gates parsed it 120 times at once and held its event loop long enough that
    connects (1 s) and calls (2 s) timed out, which reads as an outage (with the pool bound
    alone, on a loaded 2-core machine, tests/core/test_cluster_pool.py::
    test_busy_node_pools_are_no_outage failed 3 of 3 runs: connects timed out, once as a
    fallback). The main client loads it first (:meth:`RedisMode.prepare`); a client that finds
    no table loads its own. A command missing from the table reloads it
    (redis-py asks with no node then).
    """

    __slots__ = ("_key",)

    def __init__(self, key: str) -> None:
        super().__init__()
        self._key = key

    async def get_keys(self, *args: Any) -> tuple[str, ...] | None:
        """The keys of a command; an ``FCALL``'s from its own arguments (``FCALL fn numkeys
        key...``), as redis-py reads an ``EVALSHA``'s. redis-py asks the server instead
        (``COMMAND GETKEYS``, FCALL has movable keys): a round trip to one node before every
        script call, on every hand-off's path."""
        if len(args) >= 3 and str(args[0]).upper() in _FCALLS:
            return tuple(args[3 : 3 + int(args[2])])
        keys: tuple[str, ...] | None = await super().get_keys(*args)
        return keys

    async def initialize(self, node: Any | None = None) -> None:
        table = _COMMAND_TABLES.get(self._key)
        if node is None or table is None:
            await super().initialize(node)
            _COMMAND_TABLES[self._key] = self.commands
        else:
            self.node = node
            self.commands = table  # never changed in place: a reload replaces it


class _PooledCluster(aredis.RedisCluster):
    """redis-py's asyncio ``RedisCluster`` with a blocking bound on commands in flight.

    Its node pools have no wait: a command beyond a node's ``max_connections`` raises
    ``MaxConnectionsError`` (a ``ConnectionError`` with no text), which reads as an outage --
    without the bound, 4-5 false fallbacks per run of 3 healthy pods with 120 gates each, and 2-3
    permits running on gates of limit 1 under the fallback's local bounds; with it, none and 1
    (tests/core/test_cluster_pool.py::test_busy_node_pools_are_no_outage). Here at
    most ``max_connections`` commands (and pipelines, and topology loads) of the client are in
    flight at once; each holds at most one connection of any node, so no node's pool is ever
    asked for more than it has. The others wait in arrival order, for at most ``pool_timeout``
    seconds (then ``ConnectionError``, an outage like the standalone pool's), or until the
    caller's deadline cancels them.
    """

    __slots__ = ("_permits",)

    def __init__(
        self, *args: Any, pool_timeout: float = POOL_TIMEOUT, table_key: str = "", **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self._permits = _Permits(int(self.connection_kwargs["max_connections"]), pool_timeout)
        if table_key:
            self.commands_parser = _CommandTable(table_key)

    async def _take(self) -> contextvars.Token[object] | None:
        if _HOLDER.get(None) is self:
            return None
        await self._permits.acquire()
        return _HOLDER.set(self)

    def _give(self, token: contextvars.Token[object] | None) -> None:
        if token is not None:
            _HOLDER.reset(token)
            self._permits.release()

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        token = await self._take()
        try:
            if token is None:
                return await super().execute_command(*args, **kwargs)
            loop = asyncio.get_running_loop()
            give_up = loop.time() + self._permits.timeout
            while True:
                try:
                    return await super().execute_command(*args, **kwargs)
                except MaxConnectionsError:
                    if loop.time() >= give_up:
                        raise
                await asyncio.sleep(_BUSY_RETRY)
        finally:
            self._give(token)

    async def initialize(self, *args: Any, **kwargs: Any) -> aredis.RedisCluster:
        token = await self._take()
        try:
            return await super().initialize(*args, **kwargs)
        finally:
            self._give(token)

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None) -> Any:
        if shard_hint:
            return super().pipeline(transaction, shard_hint)  # raises, as redis-py does
        return _PooledPipeline(self, transaction)  # type: ignore[abstract]


class _PooledPipeline(ClusterPipeline):
    """A cluster pipeline whose execution takes one of its client's permits."""

    __slots__ = ()

    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> Any:
        client = self.cluster_client
        assert isinstance(client, _PooledCluster)
        token = await client._take()
        try:
            return await super().execute(raise_on_error, allow_redirections)
        finally:
            client._give(token)
