"""Creating redis-py asyncio clients from a URL, the one place connection options are chosen."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis.asyncio as aredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ClusterDownError, TryAgainError

__all__ = [
    "REDIS_ERRORS",
    "AnyRedis",
    "connect",
    "is_cluster",
    "prepare",
    "redact",
    "split_cluster_flag",
]

AnyRedis = aredis.Redis | aredis.RedisCluster

# Errors that mean "Redis is not reachable right now" (fallback territory), as opposed to a
# script or data error (a bug or bad state, surfaced as is).
REDIS_ERRORS: tuple[type[BaseException], ...] = (
    aredis.ConnectionError,
    aredis.TimeoutError,
    ClusterDownError,
    TryAgainError,
    OSError,
)

_TRUE = {"1", "true", "yes", "on"}


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


def is_cluster(client: object) -> bool:
    return isinstance(client, aredis.RedisCluster)


async def prepare(client: Any) -> None:
    """Load a cluster client's topology before concurrent use.

    redis-py's asyncio ``RedisCluster`` can corrupt a connection when many first commands race
    its lazy initialisation (seen with redis-py 8.1); one explicit ``initialize()`` avoids it.
    A standalone client needs nothing. Unreachable Redis is left to the caller's first command.
    """
    if is_cluster(client):
        try:
            await client.initialize()
        except REDIS_ERRORS:
            pass


# Connections of one process' pool. Calls beyond it wait for a free connection (a blocking
# pool) instead of failing with "Too many connections", which would read as an outage.
MAX_CONNECTIONS = 64
POOL_TIMEOUT = 10.0


def connect(url: str, *, dedicated: bool = False, **overrides: Any) -> Any:
    """An asyncio client for ``url`` with fleetgate's defaults.

    No automatic retries: a failed call is handled by fleetgate itself (fallback or a clear
    error) instead of stalling the caller in redis-py's back-off. Short connect and socket
    timeouts make an outage visible within about a second. ``dedicated`` gives a client bound
    to one connection of its own (for blocking commands).
    """
    options: dict[str, Any] = {
        "decode_responses": True,
        "socket_connect_timeout": 1.0,
        "socket_timeout": 2.0,
        "retry": Retry(NoBackoff(), 0),
        "health_check_interval": 0,
    }
    options.update(overrides)
    url, cluster = split_cluster_flag(url)
    if cluster:
        # One pool per node, owned by the cluster client; a dedicated client is simply another
        # cluster client whose connections nobody else uses.
        options.pop("health_check_interval", None)
        options.setdefault("max_connections", MAX_CONNECTIONS)
        return aredis.RedisCluster.from_url(url, **options)
    if dedicated:
        return aredis.Redis.from_url(url, single_connection_client=True, **options)
    options.setdefault("max_connections", MAX_CONNECTIONS)
    options.setdefault("timeout", POOL_TIMEOUT)
    pool = aredis.BlockingConnectionPool.from_url(url, **options)
    return aredis.Redis.from_pool(pool)  # closing the client closes its pool


_CREDENTIALS = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<auth>[^@/]*@)", re.IGNORECASE)


def redact(url: str) -> str:
    """``url`` with any user:password part replaced, for logs, errors and status output."""
    return _CREDENTIALS.sub(lambda m: f"{m.group('scheme')}***@", url)
