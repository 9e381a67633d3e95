"""Checks of the Redis server and of fleetgate's keys that the scripts cannot make themselves.

* :func:`check_redis` / :func:`server_findings` (:mod:`fleetgate.safety.server`): server settings
  a semaphore depends on. ``maxmemory-policy`` must be ``noeviction`` -- an evicted ``holders``
  zset or ``cfg`` hash would silently reset a gate's count or cap. Replicas are reported because
  a grant acknowledged by the primary can vanish in a failover before it was replicated
  (docs/security.md, "Redis settings"). The connection must reach a primary.
* :func:`find_bad_keys` (:mod:`fleetgate.safety.keyspace`): keys under the prefix that hold the
  wrong Redis type (every script on that gate then fails with ``WRONGTYPE``) or configuration
  values that are not numbers.

* :func:`capability_findings` (:mod:`fleetgate.safety.capabilities`): the commands fleetgate
  sends that the server lacks or refuses (Functions, EVALSHA, sharded pub/sub, CLIENT, CONFIG,
  arguments per command), each probed.

All report :class:`Finding` values (:mod:`fleetgate.safety.findings`). Connection errors
propagate (the caller decides: the coordinator retries later, ``fleetgate check`` reports Redis
unusable). Permission and unknown-command errors are findings.
"""

from __future__ import annotations

from fleetgate.safety.capabilities import PROBE_GATE, capability_findings
from fleetgate.safety.findings import Finding, is_wrongtype
from fleetgate.safety.keyspace import EXPECTED_TYPES, find_bad_keys
from fleetgate.safety.server import (
    MIN_VERSION,
    check_redis,
    redis_version,
    server_findings,
    server_label,
)

__all__ = [
    "EXPECTED_TYPES",
    "MIN_VERSION",
    "PROBE_GATE",
    "Finding",
    "capability_findings",
    "check_redis",
    "find_bad_keys",
    "is_wrongtype",
    "redis_version",
    "server_findings",
    "server_label",
]
