"""Creating redis-py asyncio clients from a URL, the one place connection options are chosen."""

from __future__ import annotations

import re
from typing import Any

import redis.asyncio as aredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

__all__ = ["REDIS_ERRORS", "connect", "redact"]

# Errors that mean "Redis is not reachable right now" (fallback territory), as opposed to a
# script or data error (a bug or bad state, surfaced as is).
REDIS_ERRORS: tuple[type[BaseException], ...] = (
    aredis.ConnectionError,
    aredis.TimeoutError,
    OSError,
)


# Connections of one process' pool. Calls beyond it wait for a free connection (a blocking
# pool) instead of failing with "Too many connections", which would read as an outage.
MAX_CONNECTIONS = 64
POOL_TIMEOUT = 10.0


def connect(url: str, *, dedicated: bool = False, **overrides: Any) -> aredis.Redis:
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
