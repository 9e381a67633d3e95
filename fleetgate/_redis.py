"""Creating redis-py asyncio clients from a URL, the one place connection options are chosen, and
:class:`RedisMode`, the one object that knows whether a client talks to a standalone Redis or a
Redis Cluster (callers never ask). A Sentinel URL gives a client of the current master, which
behaves as a standalone one; redis-py's Sentinel pool finds the master again after a failover."""

from __future__ import annotations

import asyncio
import collections
import contextvars
import difflib
import functools
import os
import re
from collections.abc import Awaitable, Callable, Sequence
from inspect import Parameter, isawaitable, signature
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

import redis.asyncio as aredis
from redis._parsers.commands import AsyncCommandsParser
from redis.asyncio.cluster import ClusterPipeline
from redis.asyncio.connection import parse_url
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.exceptions import (
    ClusterDownError,
    ClusterError,
    MaxConnectionsError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)

from fleetgate import _sentinel
from fleetgate.errors import ConfigError
from fleetgate.keys import GateKeys

__all__ = [
    "REDIS_ERRORS",
    "UNAVAILABLE_REPLIES",
    "AnyRedis",
    "BatchCall",
    "RedisMode",
    "ServerUnavailable",
    "connect",
    "error_text",
    "prepare",
    "redact",
    "scrub",
    "split_cluster_flag",
    "unavailable_reply",
    "validate_redis_url",
]

AnyRedis = aredis.Redis | aredis.RedisCluster


class ServerUnavailable(aredis.ConnectionError):
    """A reply meaning the server cannot serve writes now (OOM, READONLY, MISCONF, BUSY,
    LOADING, MASTERDOWN): an outage like a refused connection, not a bug in the data.

    A subclass of redis-py's ``ConnectionError`` (as its own ``BusyLoadingError`` is), so every
    handler of :data:`REDIS_ERRORS` treats it as "Redis unavailable": the fair-share fallback,
    the probe that waits for Redis to serve again, retried releases.
    """


# Error codes of replies that mean "cannot serve writes now". redis-py maps OOM and READONLY to
# classes of their own (and strips the code from the message); the others arrive as plain
# ResponseError whose message starts with the code.
UNAVAILABLE_REPLIES = frozenset({"OOM", "READONLY", "MISCONF", "BUSY", "LOADING", "MASTERDOWN"})


def unavailable_reply(exc: BaseException) -> bool:
    """Whether ``exc`` is a Redis reply that means the server cannot serve writes right now."""
    if isinstance(exc, (OutOfMemoryError, ReadOnlyError)):
        return True
    if not isinstance(exc, ResponseError):
        return False
    words = str(exc).split(None, 1)
    return bool(words) and words[0] in UNAVAILABLE_REPLIES


def error_text(exc: BaseException) -> str:
    """``exc`` for a log line or message: its type, and its text if it has one.

    Some of redis-py's errors carry no text (its cluster client's ``MaxConnectionsError()``):
    logged as ``str(exc)`` they read "Redis ... unreachable ()", naming no cause.
    """
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# Errors that mean "Redis is not reachable right now" (fallback territory), as opposed to a
# script or data error (a bug or bad state, surfaced as is).
REDIS_ERRORS: tuple[type[BaseException], ...] = (
    aredis.ConnectionError,
    aredis.TimeoutError,
    ClusterDownError,
    TryAgainError,
    # While a slot migrates or a master fails over: "TTL exhausted." once ASK/MOVED/TRYAGAIN
    # replies outlast redis-py's retries, or no node serves the slot
    # (tests/chaos/test_cluster_faults.py::test_slot_migration_under_load).
    ClusterError,
    SlotNotCoveredError,
    OSError,
)

# What prepare() tolerates: unreachable, or a cluster that cannot be mapped yet.
_PREPARE_ERRORS: tuple[type[BaseException], ...] = (*REDIS_ERRORS, RedisClusterException)

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def split_cluster_flag(url: str) -> tuple[str, bool]:
    """``url`` without fleetgate's ``cluster=1`` query flag, and whether it was set.

    ``redis://node-1:6379/0?cluster=1`` (or ``rediss://…``) selects Redis Cluster: the gates'
    keys carry hash tags, so each gate lives in one slot and every script runs on one node.
    """
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    flag = [v for k, v in query if k == "cluster"]
    if not flag:
        return url, False
    rest = urlencode([(k, v) for k, v in query if k != "cluster"])
    return urlunsplit(parts._replace(query=rest)), flag[-1].lower() in _TRUE


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

        The scripts need only the gate's base name (``lua/lib.lua`` derives the rest), which is
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

    async def batch(self, calls: Sequence[BatchCall], *, raise_on_error: bool = True) -> list[Any]:
        """Run ``calls`` (each on a different gate, say) and return their replies in order.

        Standalone: one pipeline without MULTI (one round trip; redis-py loads a script the
        server lacks first). Cluster: concurrent calls, since Cluster refuses scripts in
        pipelines. ``raise_on_error=False`` returns a failed call's exception as its reply.
        """
        if not calls:
            return []
        if self.cluster:
            return list(
                await asyncio.gather(
                    *(_awaited(call(self.client)) for call in calls),
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


async def _awaited(value: Any) -> Any:
    return await value if isawaitable(value) else value


async def prepare(client: Any) -> None:
    """Load a cluster client's topology before concurrent use (see :meth:`RedisMode.prepare`)."""
    await RedisMode(client).prepare()


# Connections of one process' pool (per node on Cluster), whatever its number of gates or
# concurrent calls. Calls beyond it wait for a free connection (a blocking pool) instead of
# failing with "Too many connections", which would read as an outage. Redis runs commands one at
# a time, so more connections buy little throughput (a call is one round trip of ~0.1 ms), and
# 200 pods x 64 would approach Redis' default maxclients (10,000). A URL's max_connections or
# redis_options={"max_connections": n} override it.
MAX_CONNECTIONS = 8
# Cluster: the connections per node, and the commands one cluster client has in flight at once
# (a command holds at most one connection per node, so no node's pool is asked for more than
# it has; calls beyond wait: _PooledCluster). 64 as before that wait existed, when it had to
# cover the concurrent calls (tests/test_cluster.py::test_cap_holds_across_processes_on_cluster,
# 60 tasks).
CLUSTER_MAX_CONNECTIONS = 64
# Seconds a call waits for a free connection (standalone, Sentinel) or a free command slot of a
# cluster client before it fails as an outage: a pool busy that long means Redis does not answer
# (every call in flight waits out its socket_timeout, 2 s, meanwhile).
POOL_TIMEOUT = 10.0


class _Permits:
    """At most ``size`` holders at once, served in arrival order (a semaphore whose wait fails
    with ``ConnectionError`` after ``timeout`` seconds, as the standalone pool's wait does)."""

    __slots__ = ("_waiters", "free", "size", "timeout")

    def __init__(self, size: int, timeout: float) -> None:
        self.size = size
        self.free = size
        self.timeout = timeout
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    async def acquire(self) -> None:
        if self.free > 0 and not self._waiters:
            self.free -= 1
            return
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        self._waiters.append(waiter)
        timer = loop.call_later(self.timeout, self._expire, waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # handed over as the caller was cancelled: pass it on
            else:
                self._drop(waiter)
            raise
        finally:
            timer.cancel()

    def release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():  # a cancelled one may still be queued for a moment
                waiter.set_result(None)
                return
        self.free += 1

    def _expire(self, waiter: asyncio.Future[None]) -> None:
        if waiter.done():
            return
        self._drop(waiter)
        waiter.set_exception(
            aredis.ConnectionError(
                f"no free connection to the Redis Cluster within {self.timeout:g} s "
                f"({self.size} commands in flight)"
            )
        )

    def _drop(self, waiter: asyncio.Future[None]) -> None:
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass


# The cluster client whose permit the current task holds (a nested call takes none: redis-py
# runs initialize() and a pipeline's redirected commands inside the call that holds it).
_HOLDER: contextvars.ContextVar[object] = contextvars.ContextVar("fleetgate_cluster_permit")

# After a connection error redis-py 8.1 closes the connections that were in use as they come
# back, in a background task: for a moment such a connection is neither free nor closed, and a
# node whose other connections are all busy raises MaxConnectionsError although fewer commands
# than max_connections are in flight. Nothing was sent then, so the call is sent again after
# this pause (until the pool timeout).
_BUSY_RETRY = 0.002


# The command table of each cluster (by URL) this process has loaded: see _CommandTable.
_COMMAND_TABLES: dict[str, dict[str, Any]] = {}


class _CommandTable(AsyncCommandsParser):
    """redis-py's cluster command table (where each command's keys are), loaded once per
    process and cluster instead of once per client.

    redis-py loads it with every client's first topology load: ``COMMAND``, whose reply (every
    command of the server) is most of a cluster client's start-up CPU. Each wake listener is a
    cluster client of its own (one per gate on Cluster), so a pod parking on 120 gates parsed it
    120 times at once and held its event loop long enough that connects (1 s) and calls (2 s)
    timed out, which reads as an outage (with the pool bound alone, on a loaded 2-core machine,
    tests/test_cluster_pool.py::test_busy_node_pools_are_no_outage failed 3 of 3 runs: connects
    timed out, once as a fallback). The main client loads it first (:meth:`RedisMode.prepare`);
    a client that finds no table loads its own. A command missing from the table reloads it
    (redis-py asks with no node then).
    """

    __slots__ = ("_key",)

    def __init__(self, key: str) -> None:
        super().__init__()
        self._key = key

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

    Its node pools have no wait: a command beyond a node's ``max_connections`` raised
    ``MaxConnectionsError`` (a ``ConnectionError`` with no text), which fleetgate read as an
    outage -- 4-5 false fallbacks per run of 3 healthy pods with 120 gates each, and 2-3 permits
    running on gates of limit 1 under the fallback's local bounds
    (tests/test_cluster_pool.py::test_busy_node_pools_are_no_outage; after: 0, and 1). Here at
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


def connect(url: str, *, dedicated: bool = False, **overrides: Any) -> Any:
    """An asyncio client for ``url`` with fleetgate's defaults.

    No automatic retries: a failed call is handled by fleetgate itself (fallback or a clear
    error) instead of stalling the caller in redis-py's back-off. Short connect and socket
    timeouts make an outage visible within about a second. ``dedicated`` gives a client bound
    to one connection of its own (for blocking commands).

    ``url`` is checked first (:func:`validate_redis_url`, plus: the TLS files it names exist), so
    a typo is a :class:`ConfigError` naming the problem here, not a connection error later that
    would read as an outage. ``rediss://`` verifies the server's host name unless the URL says
    ``ssl_check_hostname=false`` (redis-py < 6 did not by default). No error raised here echoes
    the URL's password.
    """
    validate_redis_url(url, check_files=True)
    options: dict[str, Any] = {
        "decode_responses": True,
        "socket_connect_timeout": 1.0,
        "socket_timeout": 2.0,
        "retry": Retry(NoBackoff(), 0),
        "health_check_interval": 0,
    }
    if _sentinel.is_sentinel_url(url):
        options.update(overrides)
        return _connect_sentinel(_sentinel.parse(url), options, dedicated)
    if urlsplit(url).scheme == "rediss":
        options["ssl_check_hostname"] = True  # a query parameter in the URL wins over this
    options.update(overrides)
    url, cluster = split_cluster_flag(url)
    try:
        if cluster:
            # One pool per node, owned by the cluster client; a dedicated client is simply
            # another cluster client whose connections nobody else uses.
            options.pop("health_check_interval", None)
            options.setdefault("max_connections", CLUSTER_MAX_CONNECTIONS)
            pool_timeout = options.pop("timeout", POOL_TIMEOUT)
            return _PooledCluster.from_url(url, pool_timeout=pool_timeout, table_key=url, **options)
        if dedicated:
            return aredis.Redis.from_url(url, single_connection_client=True, **options)
        options.setdefault("max_connections", MAX_CONNECTIONS)
        options.setdefault("timeout", POOL_TIMEOUT)
        pool = aredis.BlockingConnectionPool.from_url(url, **options)
        return aredis.Redis.from_pool(pool)  # closing the client closes its pool
    except (ValueError, TypeError) as exc:
        # redis-py's messages may quote parts of the URL (a password after a stray '/'):
        # say what failed without them.
        raise ConfigError(
            f"Redis URL {redact(url)} rejected by redis-py: {scrub(str(exc), url)}"
        ) from None


class _BlockingSentinelPool(SentinelConnectionPool, aredis.BlockingConnectionPool):
    """redis-py's Sentinel pool (master looked up per new connection, dropped after a failover)
    with the blocking pool's wait for a free connection, like the standalone pool; closing it
    also closes the clients of the sentinels it asks."""

    async def disconnect(self, inuse_connections: bool = True) -> None:
        await super().disconnect(inuse_connections)
        if inuse_connections:  # the owner closes the client (idle drops pass False)
            for sentinel in self.sentinel_manager.sentinels:
                await sentinel.aclose()


def _connect_sentinel(
    target: _sentinel.SentinelTarget, options: dict[str, Any], dedicated: bool
) -> Any:
    """A client of ``target``'s current master (a dedicated one holds one connection)."""
    scheme = "rediss" if target.tls else "redis"
    # redis-py's own URL parser types the query options (socket_timeout=0.5 -> float, ...).
    parsed: dict[str, Any] = dict(
        parse_url(f"{scheme}://localhost/{target.db}?{urlencode(target.options)}")
    )
    for key in ("host", "port", "connection_class"):
        parsed.pop(key, None)
    master: dict[str, Any] = {**options, **parsed}
    if target.username is not None:
        master["username"] = target.username
    if target.password is not None:
        master["password"] = target.password
    timeouts = {k: v for k, v in master.items() if k.startswith("socket_")}
    to_sentinels: dict[str, Any] = {**timeouts, "decode_responses": True}
    if target.tls:
        master["ssl"] = True
        to_sentinels.update({k: v for k, v in master.items() if k.startswith("ssl")})
    if target.sentinel_username is not None:
        to_sentinels["username"] = target.sentinel_username
    if target.sentinel_password is not None:
        to_sentinels["password"] = target.sentinel_password
    manager = Sentinel(list(target.sentinels), sentinel_kwargs=to_sentinels)  # type: ignore[no-untyped-call]
    master.setdefault("max_connections", 1 if dedicated else MAX_CONNECTIONS)
    master.setdefault("timeout", POOL_TIMEOUT)
    pool = _BlockingSentinelPool(  # type: ignore[no-untyped-call]
        target.service, manager, is_master=True, **master
    )
    client = aredis.Redis(connection_pool=pool, single_connection_client=dedicated)
    client.auto_close_connection_pool = True  # closing the client closes its pool
    return client


# ------------------------------------------------------------------------------ URL checking

# Query parameters fleetgate accepts in a Redis URL (redis-py turns them into connection
# options). A misspelt one would otherwise surface only at the first command, as a TypeError
# or (a missing CA file) an OSError that reads as "Redis unreachable".
_URL_PARAMS = frozenset(
    {
        "db",
        "username",
        "password",
        "client_name",
        "protocol",
        "socket_timeout",
        "socket_connect_timeout",
        "socket_keepalive",
        "health_check_interval",
        "max_connections",
        # not "timeout" (the blocking pool's wait): the dedicated clients' pool passes it on to
        # the connection, which refuses it
    }
)
_TLS_PARAMS = frozenset(
    {
        "ssl_ca_certs",
        "ssl_ca_path",
        "ssl_ca_data",
        "ssl_certfile",
        "ssl_keyfile",
        "ssl_password",
        "ssl_cert_reqs",
        "ssl_check_hostname",
        "ssl_min_version",
        "ssl_ciphers",
    }
)
_TLS_FILES = ("ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile")
_CERT_REQS = frozenset({"none", "optional", "required"})


def _init_params(cls: type) -> frozenset[str]:
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        for p in signature(init).parameters.values():
            if p.kind in (Parameter.POSITIONAL_OR_KEYWORD, Parameter.KEYWORD_ONLY):
                names.add(p.name)
    return frozenset(names)


@functools.cache
def _accepted(scheme: str, cluster: bool) -> frozenset[str]:
    """The URL parameters the installed redis-py accepts for this kind of connection."""
    if cluster:
        supported = _init_params(aredis.RedisCluster)
    else:
        conn = {
            "unix": aredis.UnixDomainSocketConnection,
            "rediss": aredis.SSLConnection,
        }.get(scheme, aredis.Connection)
        supported = _init_params(conn) | _init_params(aredis.BlockingConnectionPool)
    wanted = _URL_PARAMS | (_TLS_PARAMS if scheme == "rediss" else frozenset())
    return frozenset(wanted & supported) | {"cluster"}


def validate_redis_url(url: object, *, check_files: bool = False) -> str:
    """Return ``url`` if it is a usable Redis URL, else raise :class:`ConfigError` saying why.

    Accepted: ``redis://``, ``rediss://`` (TLS) and ``unix://`` URLs; query parameters are
    redis-py connection options (``db``, ``socket_timeout``, the ``ssl_*`` options of
    ``rediss://``, ...) plus fleetgate's ``cluster=1``. ``check_files`` also checks that the TLS
    files named by ``ssl_ca_certs``/``ssl_ca_path``/``ssl_certfile``/``ssl_keyfile`` exist.
    Messages never contain the password.
    """
    if not isinstance(url, str) or not url.strip():
        raise ConfigError("the Redis URL must be a non-empty string")
    shown = redact(url)
    if any(ch.isspace() or ord(ch) < 0x20 or ord(ch) == 0x7F for ch in url):
        raise ConfigError(f"Redis URL {shown!r} contains whitespace or control characters")
    if _sentinel.is_sentinel_url(url):
        return _validate_sentinel_url(url, shown, check_files)
    scheme, query = _split_url(url, shown)
    cluster_flags = [v for k, v in query if k == "cluster"]
    cluster = bool(cluster_flags) and cluster_flags[-1].lower() in _TRUE
    if cluster_flags and cluster_flags[-1].lower() not in _TRUE | _FALSE:
        raise ConfigError(f"Redis URL {shown!r}: cluster= takes 1/0, true/false, yes/no, on/off")
    if cluster and scheme == "unix":
        raise ConfigError(f"Redis URL {shown!r}: a Redis Cluster cannot be reached by unix://")
    _check_query_keys(query, scheme, cluster, shown)
    try:
        parse_url(url if not cluster_flags else split_cluster_flag(url)[0])
    except ValueError as exc:  # e.g. "Invalid value for 'db' in connection URL."
        raise ConfigError(f"Redis URL {shown!r}: {scrub(str(exc), url)}") from None
    _check_tls_options(dict(query), shown, check_files)
    return url


def _validate_sentinel_url(url: str, shown: str, check_files: bool) -> str:
    try:
        target = _sentinel.parse(url)
    except ValueError as exc:
        raise ConfigError(f"Redis URL {shown!r}: {scrub(str(exc), url)}") from None
    query = [*target.options]
    if any(k == "cluster" for k, _ in query):
        raise ConfigError(f"Redis URL {shown!r}: cluster= does not apply to a Sentinel URL")
    _check_query_keys(query, "rediss" if target.tls else "redis", False, shown)
    _check_tls_options(dict(query), shown, check_files)
    return url


def _split_url(url: str, shown: str) -> tuple[str, list[tuple[str, str]]]:
    """The scheme (lower case) and the query pairs of ``url``; ConfigError if malformed."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a malformed port
    except ValueError:
        # urllib's message would quote the bad port, which is part of the password when the
        # password holds an unescaped '/', '?' or '#'.
        raise ConfigError(
            f"Redis URL {shown!r} is malformed (bad port?); percent-encode any '@', '/', '?', "
            "'#' or ':' in the user name or password"
        ) from None
    scheme = parts.scheme.lower()
    if scheme not in ("redis", "rediss", "unix"):
        raise ConfigError(
            "expected a redis://, rediss://, unix:// or redis+sentinel:// URL, got scheme "
            f"{parts.scheme!r}"
        )
    if scheme == "unix" and not parts.path:
        raise ConfigError(f"Redis URL {shown!r} has no socket path")
    return scheme, parse_qsl(parts.query, keep_blank_values=True)


def _check_query_keys(query: list[tuple[str, str]], scheme: str, cluster: bool, shown: str) -> None:
    """Every query parameter is one the installed redis-py takes for this connection."""
    accepted = _accepted(scheme, cluster)
    for key, _ in query:
        if key in accepted:
            continue
        if key in _TLS_PARAMS and scheme != "rediss":
            raise ConfigError(
                f"Redis URL {shown!r}: {key} needs a rediss:// (TLS) URL, not {scheme}://"
            )
        if key in _TLS_PARAMS | _URL_PARAMS:
            kind = "Redis Cluster" if cluster else "this connection"
            raise ConfigError(
                f"Redis URL {shown!r}: {key} is not supported for {kind} by the installed redis-py"
            )
        close = difflib.get_close_matches(key, sorted(accepted), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"Redis URL {shown!r}: unknown query parameter {key!r}{hint}")


def _check_tls_options(options: dict[str, str], shown: str, check_files: bool) -> None:
    reqs = options.get("ssl_cert_reqs")
    if reqs is not None and reqs.lower() not in _CERT_REQS:
        raise ConfigError(
            f"Redis URL {shown!r}: ssl_cert_reqs must be none, optional or required, got {reqs!r}"
        )
    if check_files:
        for key in _TLS_FILES:
            path = options.get(key)
            if path is not None and not os.path.exists(path):
                raise ConfigError(f"Redis URL {shown!r}: {key} file {path!r} does not exist")


# ------------------------------------------------------------------------------ redaction

# A scheme, then everything up to the LAST '@' before whitespace: a password may hold an
# unescaped '@' or '/', and cutting at the first one would print the rest. When in doubt this
# hides too much (an '@' in a query value), never too little.
_CREDENTIALS = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<auth>[^\s'\"]*@)", re.IGNORECASE)
# Query parameters that carry secrets: ?password=..., ?ssl_password=...
_SECRET_PARAM = re.compile(
    r"(?P<key>[?&][a-z_]*(?:password|secret|token)[a-z_]*=)(?P<value>[^&#\s'\"]*)",
    re.IGNORECASE,
)


def redact(url: str) -> str:
    """``url`` with any user:password part and password query values replaced by ``***``.

    For logs, errors and status output. ``redis://u:p@h:6379/0`` -> ``redis://***@h:6379/0``.
    """
    url = _CREDENTIALS.sub(lambda m: f"{m.group('scheme')}***@", url)
    return _SECRET_PARAM.sub(lambda m: f"{m.group('key')}***", url)


def _secrets_of(url: str) -> list[str]:
    secrets: list[str] = []
    scheme_end = url.find("://")
    if scheme_end >= 0:
        rest = url[scheme_end + 3 :]
        auth = rest.rpartition("@")[0] if "@" in rest else ""
        if auth:
            password = auth.partition(":")[2] if ":" in auth else auth
            secrets += [password, unquote(password)]
    for m in _SECRET_PARAM.finditer(url):
        secrets += [m.group("value"), unquote(m.group("value"))]
    # Longest first, so a secret that contains another is replaced whole.
    return sorted({s for s in secrets if len(s) >= 3}, key=len, reverse=True)


def scrub(text: str, url: str) -> str:
    """``text`` (an error message, say) with ``url``'s password, and any credentials of URLs in
    it, replaced by ``***``: belt and braces for messages of third-party code."""
    for secret in _secrets_of(url):
        text = text.replace(secret, "***")
    return redact(text)
