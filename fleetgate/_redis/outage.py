"""Which errors mean "Redis cannot serve right now" (an outage, fallback territory) as opposed to a
script or data error (a bug or bad state, surfaced as is), and how an error reads in a log line."""

from __future__ import annotations

import redis.asyncio as aredis
from redis.exceptions import (
    ClusterDownError,
    ClusterError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)

__all__ = [
    "REDIS_ERRORS",
    "UNAVAILABLE_REPLIES",
    "ServerUnavailable",
    "error_text",
    "unavailable_reply",
]


class ServerUnavailable(aredis.ConnectionError):
    """A reply meaning the server cannot serve writes here now (:data:`UNAVAILABLE_REPLIES`:
    OOM, READONLY, NOREPLICAS, ...): an outage like a refused connection, not a bug in the data.

    A subclass of redis-py's ``ConnectionError`` (as its own ``BusyLoadingError`` is), so every
    handler of :data:`REDIS_ERRORS` treats it as "Redis unavailable": the fair-share fallback,
    the probe that waits for Redis to serve again, retried releases.
    """


# The one taxonomy of refusals: the error codes of replies that mean "cannot write here now",
# whatever the script. Every one takes the outage path (the fair-share fallback, or
# RedisUnavailable in "fail" mode); any other error reply is a script or data error.
#   OOM         maxmemory reached (noeviction)
#   READONLY    a replica (a demoted master after a failover)
#   NOREPLICAS  min-replicas-to-write not met (a replica frozen, lagging or cut off)
#   MISCONF     stop-writes-on-bgsave-error after a failed snapshot
#   BUSY        a script or function runs past busy-reply-threshold
#   LOADING     the dataset is being loaded (a restart with persistence)
#   MASTERDOWN  a replica whose link to its master is down (replica-serve-stale-data no)
#   TRYAGAIN    Cluster: a multi-key command's slot migrates
#   CLUSTERDOWN Cluster: a slot not served, or the cluster state is fail
# (A ``CLIENT PAUSE ... WRITE`` refuses nothing: the write waits, and the caller's socket
# timeout ends it, a TimeoutError, also an outage.)
UNAVAILABLE_REPLIES = frozenset(
    {
        "OOM",
        "READONLY",
        "NOREPLICAS",
        "MISCONF",
        "BUSY",
        "LOADING",
        "MASTERDOWN",
        "TRYAGAIN",
        "CLUSTERDOWN",
    }
)


def unavailable_reply(exc: BaseException) -> bool:
    """Whether ``exc`` is a Redis reply that means the server cannot serve writes right now.

    By its error code: redis-py maps some codes to classes of their own and strips the code
    from the message (``status_code`` keeps it, from redis-py 7 on); the others arrive as plain
    ResponseError whose message starts with the code."""
    if isinstance(exc, (OutOfMemoryError, ReadOnlyError, ClusterDownError, TryAgainError)):
        return True
    if not isinstance(exc, ResponseError):
        return False
    code = getattr(exc, "status_code", None)
    if isinstance(code, str) and code in UNAVAILABLE_REPLIES:
        return True
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
