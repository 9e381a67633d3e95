"""Creating redis-py asyncio clients from a URL: the one place connection options are chosen."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import redis.asyncio as aredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from fleetgate._redis.cluster import _PooledCluster
from fleetgate._redis.limits import CLUSTER_MAX_CONNECTIONS, MAX_CONNECTIONS, POOL_TIMEOUT
from fleetgate._redis.redaction import redact, scrub
from fleetgate._redis.sentinel_pool import connect_sentinel
from fleetgate._redis.sentinel_url import is_sentinel_url
from fleetgate._redis.sentinel_url import parse as parse_sentinel_url
from fleetgate._redis.urls import split_cluster_flag, validate_redis_url
from fleetgate.errors import ConfigError

__all__ = ["connect"]


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
    if is_sentinel_url(url):
        options.update(overrides)
        return connect_sentinel(parse_sentinel_url(url), options, dedicated)
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
