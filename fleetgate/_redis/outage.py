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
