"""Redis clients for fleetgate: made from a URL, the one place connection options are chosen, and
:class:`RedisMode`, the one object that knows whether a client talks to a standalone Redis or a
Redis Cluster (callers never ask). A Sentinel URL gives a client of the current master, which
behaves as a standalone one; redis-py's Sentinel pool finds the master again after a failover.

One job per module:

* :mod:`~fleetgate._redis.clients`: :func:`connect`, a client for a URL with fleetgate's defaults;
* :mod:`~fleetgate._redis.urls`: :func:`validate_redis_url` and the ``cluster=1`` flag;
* :mod:`~fleetgate._redis.sentinel_url`: the ``redis+sentinel://`` URL form (parsing only);
* :mod:`~fleetgate._redis.sentinel_pool`: a client of a Sentinel URL's current master;
* :mod:`~fleetgate._redis.cluster`: the cluster client, with a bound on commands in flight
  (:mod:`~fleetgate._redis.permits`) and one command table per process and cluster;
* :mod:`~fleetgate._redis.shard_pubsub`: :class:`ShardSubscriber`, Cluster shard channels on one
  connection per node (the wake-ups on Cluster);
* :mod:`~fleetgate._redis.limits`: connections per pool and the wait for a free one; the most
  arguments of one command (:data:`MAX_ARGS`);
* :mod:`~fleetgate._redis.mode`: :class:`RedisMode` and :func:`prepare`;
* :mod:`~fleetgate._redis.outage`: which errors are outages (:data:`REDIS_ERRORS`,
  :class:`ServerUnavailable`) and how an error reads in a log line (:func:`error_text`);
* :mod:`~fleetgate._redis.redaction`: passwords kept out of messages (:func:`redact`,
  :func:`scrub`).
"""

from __future__ import annotations

from fleetgate._redis.clients import connect
from fleetgate._redis.limits import (
    CLUSTER_MAX_CONNECTIONS,
    MAX_ARGS,
    MAX_CONNECTIONS,
    POOL_TIMEOUT,
    in_chunks,
)
from fleetgate._redis.mode import AnyRedis, BatchCall, RedisMode, prepare
from fleetgate._redis.outage import (
    REDIS_ERRORS,
    UNAVAILABLE_REPLIES,
    ServerUnavailable,
    error_text,
    unavailable_reply,
)
from fleetgate._redis.redaction import redact, scrub
from fleetgate._redis.urls import split_cluster_flag, validate_redis_url

__all__ = [
    "CLUSTER_MAX_CONNECTIONS",
    "MAX_ARGS",
    "MAX_CONNECTIONS",
    "POOL_TIMEOUT",
    "REDIS_ERRORS",
    "UNAVAILABLE_REPLIES",
    "AnyRedis",
    "BatchCall",
    "RedisMode",
    "ServerUnavailable",
    "connect",
    "error_text",
    "in_chunks",
    "prepare",
    "redact",
    "scrub",
    "split_cluster_flag",
    "unavailable_reply",
    "validate_redis_url",
]
