"""A client of a Sentinel URL's current master: redis-py's Sentinel pool with a blocking wait for
a free connection."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

import redis.asyncio as aredis
from redis.asyncio.connection import parse_url
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool

from fleetgate._redis.limits import MAX_CONNECTIONS, POOL_TIMEOUT
from fleetgate._redis.sentinel_url import SentinelTarget

__all__ = ["connect_sentinel"]


class _BlockingSentinelPool(SentinelConnectionPool, aredis.BlockingConnectionPool):
    """redis-py's Sentinel pool (master looked up per new connection, dropped after a failover)
    with the blocking pool's wait for a free connection, like the standalone pool; closing it
    also closes the clients of the sentinels it asks."""

    async def disconnect(self, inuse_connections: bool = True) -> None:
        await super().disconnect(inuse_connections)
        if inuse_connections:  # the owner closes the client (idle drops pass False)
            for sentinel in self.sentinel_manager.sentinels:
                await sentinel.aclose()


def connect_sentinel(target: SentinelTarget, options: dict[str, Any], dedicated: bool) -> Any:
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
    manager = Sentinel(list(target.sentinels), sentinel_kwargs=to_sentinels)  # type: ignore[no-untyped-call, unused-ignore]
    master.setdefault("max_connections", 1 if dedicated else MAX_CONNECTIONS)
    master.setdefault("timeout", POOL_TIMEOUT)
    pool = _BlockingSentinelPool(  # type: ignore[no-untyped-call]
        target.service, manager, is_master=True, **master
    )
    client = aredis.Redis(connection_pool=pool, single_connection_client=dedicated)
    client.auto_close_connection_pool = True  # closing the client closes its pool
    return client
