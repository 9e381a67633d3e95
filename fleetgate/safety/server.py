"""Checks of the Redis server's settings a semaphore depends on: version, eviction policy and
replication, of every primary.

The policy is read from ``INFO memory`` first and ``CONFIG GET`` only as a fallback: INFO needs no
``CONFIG`` permission (``CONFIG GET`` can read ``requirepass``, so least-privilege ACLs and
managed Redis services deny or rename it). When neither answers, the result says that the
setting could not be checked instead of guessing.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aredis
from redis.exceptions import ResponseError

from fleetgate._redis import RedisMode
from fleetgate.safety.findings import Finding, denied

__all__ = ["MIN_VERSION", "check_redis", "redis_version", "server_findings", "server_label"]

MIN_VERSION = (7, 0)  # the scripts are a Functions library (FUNCTION LOAD, FCALL)

_WAIT_NOTE = (
    "a grant is acknowledged by the primary before it reaches the replicas; after a failover "
    "the new primary may not know recent leases, so a gate can briefly admit more than its "
    "limit (see docs/security.md, 'Redis settings', for WAIT)"
)


async def _per_node(client: Any, section: str) -> list[tuple[str, dict[str, Any]]]:
    """``INFO section`` of every node the client writes to (one node when standalone)."""

    async def info(**target: Any) -> dict[str, Any]:
        return dict(await client.info(section, **target))

    return await RedisMode(client).each_primary(info)


async def _policy(client: Any) -> list[tuple[str, str | None, str | None]]:
    """(node, maxmemory-policy or None, why unknown) per node."""
    try:
        nodes = await _per_node(client, "memory")
    except ResponseError as exc:
        if not denied(exc):
            raise
        nodes = []
    found: list[tuple[str, str | None, str | None]] = [
        (n, str(i["maxmemory_policy"]), None) for n, i in nodes if "maxmemory_policy" in i
    ]
    if found and len(found) == len(nodes):
        return found
    try:
        reply = await client.config_get("maxmemory-policy")
    except ResponseError as exc:
        if not denied(exc):
            raise
        return [("", None, f"INFO lacks it and CONFIG GET was refused ({exc})")]
    # A cluster client merges the nodes' replies; one value stands for all of them.
    value = reply.get("maxmemory-policy") if isinstance(reply, dict) else None
    return [("", str(value) if value is not None else None, "CONFIG GET gave no value")]


async def redis_version(client: aredis.Redis | aredis.RedisCluster) -> str | None:
    """The lowest ``redis_version`` of the nodes, None when INFO is refused."""
    try:
        nodes = await _per_node(client, "server")
    except ResponseError as exc:
        if not denied(exc):
            raise
        return None
    versions = [str(info.get("redis_version", "")) for _, info in nodes]
    known = [v for v in versions if v]
    return min(known, key=_version_tuple) if known else None


async def server_label(client: aredis.Redis | aredis.RedisCluster) -> str:
    """The server's name and version as ``fleetgate check`` prints them (the first primary's):
    ``redis 7.0.15``, ``valkey 9.1.2`` (whose ``redis_version`` says 7.2.4, for compatibility);
    ``redis ?`` when INFO is refused."""
    try:
        nodes = await _per_node(client, "server")
    except ResponseError as exc:
        if not denied(exc):
            raise
        nodes = []
    info = nodes[0][1] if nodes else {}
    name = str(info.get("server_name") or "redis")
    return f"{name} {info.get(f'{name}_version') or info.get('redis_version') or '?'}"


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) if x.isdigit() else 0 for x in version.split(".")[:3])


async def server_findings(client: aredis.Redis | aredis.RedisCluster) -> list[Finding]:
    """Findings about the server's settings (empty when everything fleetgate needs holds):
    version, eviction policy and replication, of every primary."""
    findings = await _version_findings(client)
    findings += await _eviction_findings(client)
    findings += await _replication_findings(client)
    return findings


async def _version_findings(client: Any) -> list[Finding]:
    version = await redis_version(client)
    if version is None:
        return [
            Finding("warning", "unchecked", "the Redis version could not be checked (INFO refused)")
        ]
    if _version_tuple(version) < MIN_VERSION:
        need = ".".join(map(str, MIN_VERSION))
        return [
            Finding("error", "version", f"Redis {version} is too old: fleetgate needs >= {need}")
        ]
    return []


async def _eviction_findings(client: Any) -> list[Finding]:
    findings: list[Finding] = []
    for node, policy, why in await _policy(client):
        if policy is None:
            findings.append(
                Finding(
                    "warning",
                    "unchecked",
                    f"{node}maxmemory-policy could not be checked ({why}); make sure it is "
                    "'noeviction': an evicted semaphore key would silently reset a gate's cap",
                )
            )
        elif policy != "noeviction":
            findings.append(
                Finding(
                    "error",
                    "eviction",
                    f"{node}maxmemory-policy is {policy!r}; use 'noeviction': under memory "
                    "pressure Redis would evict semaphore keys and silently reset gates' caps "
                    "and queues",
                )
            )
    return findings


async def _replication_findings(client: Any) -> list[Finding]:
    try:
        replication = await _per_node(client, "replication")
    except ResponseError as exc:
        if not denied(exc):
            raise
        return [Finding("warning", "unchecked", f"replication could not be checked ({exc})")]
    findings: list[Finding] = []
    for node, info in replication:
        role = str(info.get("role", ""))
        if role in ("slave", "replica"):
            findings.append(
                Finding(
                    "error",
                    "replica_role",
                    f"{node}connected to a replica (role {role}): fleetgate needs the primary "
                    "(scripts write, a replica refuses them)",
                )
            )
            continue
        replicas = int(info.get("connected_slaves", 0) or 0)
        if replicas:
            findings.append(
                Finding(
                    "warning", "replicas", f"{node}{replicas} replica(s) attached: {_WAIT_NOTE}"
                )
            )
    return findings


async def check_redis(client: aredis.Redis | aredis.RedisCluster) -> list[str]:
    """Warnings about the server's settings, one line each (empty: nothing to report).

    See :func:`server_findings` for the levels; ``fleetgate check`` fails on error-level ones.
    """
    return [f.message for f in await server_findings(client)]
