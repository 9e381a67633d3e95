"""Checks of the Redis server and of fleetgate's keys that the scripts cannot make themselves.

* :func:`check_redis` / :func:`server_findings`: server settings a semaphore depends on.
  ``maxmemory-policy`` must be ``noeviction`` -- an evicted ``holders`` zset or ``cfg`` hash would
  silently reset a gate's count or cap. Replicas are reported because a grant acknowledged by the
  primary can vanish in a failover before it was replicated (docs/security.md, "Redis
  settings"). The connection must reach a primary.
* :func:`find_bad_keys`: keys under the prefix that hold the wrong Redis type (every script on
  that gate then fails with ``WRONGTYPE``) or configuration values that are not numbers.

The policy is read from ``INFO memory`` first and ``CONFIG GET`` only as a fallback: INFO needs no
``CONFIG`` permission (``CONFIG GET`` can read ``requirepass``, so least-privilege ACLs and
managed Redis services deny or rename it). When neither answers, the result says that the
setting could not be checked instead of guessing.

Connection errors propagate (the caller decides: the coordinator retries later, ``fleetgate
check`` reports Redis unusable). Permission and unknown-command errors are findings.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import redis.asyncio as aredis
from redis.exceptions import NoPermissionError, ResponseError

from fleetgate._redis import RedisMode
from fleetgate.keys import GateKeys, fleet_keys
from fleetgate.registry import read_registry
from fleetgate.settings import bounds

__all__ = [
    "EXPECTED_TYPES",
    "Finding",
    "check_redis",
    "find_bad_keys",
    "is_wrongtype",
    "redis_version",
    "server_findings",
]

MIN_VERSION = (6, 2)

Level = Literal["error", "warning"]


@dataclass(frozen=True)
class Finding:
    """One problem: ``error`` means fleetgate's guarantees do not hold as configured."""

    level: Level
    # version, eviction, unchecked, replica_role, replicas, wrong_type, bad_value, schema
    code: str
    message: str

    def __str__(self) -> str:
        return self.message


# Redis type of every key of one gate (GateKeys attribute -> TYPE reply); absent keys are fine.
# The same table as GateKeys.expected_types() (tests/test_visibility.py checks it), by attribute.
EXPECTED_TYPES: Mapping[str, str] = {
    "cfg": "hash",
    "target": "hash",
    "holders": "zset",
    # schema 2's fence (a string, so that a fleetgate older than 0.2 fails with WRONGTYPE
    # instead of miscounting units); a zset here is schema 1's FIFO: see _queue_finding
    "queue": "string",
    "waiters": "zset",
    "lanes": "zset",
    "fair": "zset",
    "big": "zset",
    "adm": "hash",
    "tenant_weights": "hash",
    "evicted": "zset",
    "seq": "string",
    "stats": "hash",
    "pods": "zset",
    "util": "hash",
    "obs": "hash",
}
_FLEET_TYPES: Mapping[str, str] = {"gates": "set", "leader": "string", "epoch": "string"}
# The lowest value of each cfg field the scripts take as given (fleetgate.settings), and of the
# schema-2 fields the settings may not declare (shed_below may be any integer: bands are in
# [-100, 100]).
_CFG_LOWEST = {
    "max_queued_per_tenant": 0,
    "shed_below": -(2**53),
    "schema": 1,
    **{name: low for name, (low, _) in bounds().items()},
}
# fg:{G}:tw values: the scripts clamp a tenant weight to [1, 1000] and read garbage as 1.
_TENANT_WEIGHT_RANGE = (1, 1000)
_TARGET_FIELDS = ("value", "epoch", "expires_at")
# Larger numbers are no configuration anyone means (a lease of 30 years, a cap of 10^18), and
# make the scripts compute with floats that Redis cannot return.
_MAX_VALUE = 2**53

_WAIT_NOTE = (
    "a grant is acknowledged by the primary before it reaches the replicas; after a failover "
    "the new primary may not know recent leases, so a gate can briefly admit more than its "
    "limit (see docs/security.md, 'Redis settings', for WAIT)"
)


def is_wrongtype(exc: BaseException) -> bool:
    """True for Redis' ``WRONGTYPE`` error (a key of fleetgate's holds another type)."""
    return isinstance(exc, ResponseError) and "WRONGTYPE" in str(exc)  # also in pipelines


def _denied(exc: ResponseError) -> bool:
    """ACL refusal, or a command renamed away / unknown (managed Redis)."""
    if isinstance(exc, NoPermissionError):  # redis-py strips the NOPERM prefix
        return True
    text = str(exc).upper()
    return "NOPERM" in text or "UNKNOWN COMMAND" in text or "UNKNOWN SUBCOMMAND" in text


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
        if not _denied(exc):
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
        if not _denied(exc):
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
        if not _denied(exc):
            raise
        return None
    versions = [str(info.get("redis_version", "")) for _, info in nodes]
    known = [v for v in versions if v]
    return min(known, key=_version_tuple) if known else None


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
        if not _denied(exc):
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


def _bad_number(value: str, low: int, high: int = _MAX_VALUE) -> str | None:
    try:
        number = float(value)
    except ValueError:
        return "is not a number"
    if not math.isfinite(number):
        return "is not finite"
    if number != int(number):
        return "is not an integer"
    if number < low or number > high:
        return f"is outside [{_shown(low)}, {_shown(high)}]"
    return None


def _shown(bound: int) -> str:
    return "2^53" if bound == _MAX_VALUE else "-2^53" if bound == -_MAX_VALUE else str(bound)


async def find_bad_keys(
    client: aredis.Redis | aredis.RedisCluster,
    prefix: str,
    gates: Iterable[str] = (),
    *,
    max_gates: int = 1000,
) -> list[Finding]:
    """Keys under ``prefix`` of the wrong type and garbled ``cfg``/``target`` values.

    Looks at the fleet keys and at ``gates`` plus the registered gates (at most ``max_gates``).
    The per-pod wake lists are not looked at (their names are not known without a SCAN).
    Needs ``TYPE``, ``SMEMBERS`` and ``HGETALL``; a refused command is a warning, not a crash.
    """
    fk = fleet_keys(prefix)
    findings: list[Finding] = []
    try:
        fleet_types = await _types(client, [getattr(fk, a) for a in _FLEET_TYPES])
        names = set(gates)
        if fleet_types[0] in ("set", "none"):
            registry = await read_registry(client, prefix)
            names |= set(registry.names)
            for shown, why in registry.invalid:
                findings.append(
                    Finding(
                        "warning",
                        "bad_value",
                        f"{fk.gates} holds an invalid gate name {shown} ({why}): the reaper and "
                        f"`fleetgate status` skip it; remove it (redis-cli SREM '{fk.gates}' ...)",
                    )
                )
        for (attr, expected), found in zip(_FLEET_TYPES.items(), fleet_types, strict=True):
            if found not in ("none", expected):
                findings.append(_wrong_type(getattr(fk, attr), found, expected))
        for name in sorted(names)[:max_gates]:
            try:
                keys = GateKeys.of(prefix, name)
            except ValueError:
                findings.append(
                    Finding("error", "bad_value", f"{fk.gates} holds an invalid gate name {name!r}")
                )
                continue
            findings += await _gate_findings(client, keys)
    except ResponseError as exc:
        if not _denied(exc):
            raise
        findings.append(Finding("warning", "unchecked", f"keys could not be checked ({exc})"))
    return findings


def _wrong_type(key: str, found: str, expected: str) -> Finding:
    return Finding(
        "error",
        "wrong_type",
        f"key {key} is a {found}, expected a {expected}: every command on it fails with "
        f"WRONGTYPE; delete it (redis-cli DEL '{key}') -- fleetgate recreates it",
    )


def _stored_schema(value: object) -> int:
    try:
        return int(float(str(value))) if value is not None else 1
    except ValueError:
        return 1


def _queue_finding(keys: GateKeys, schema: object, found: str) -> Finding | None:
    """``queue`` is schema 2's fence (a string). A zset there is schema 1's FIFO: normal on a
    gate no fleetgate >= 0.2 has touched yet (its first call converts it); on a gate of schema
    2 the fence was deleted and a fleetgate older than 0.2 wrote its FIFO again, so old and new
    clients count the gate differently. No fence at all on a schema-2 gate lets that happen."""
    stored = _stored_schema(schema)
    heal = (
        f"stop fleetgate < 0.2 clients, then redis-cli HDEL '{keys.cfg}' schema: the next call "
        "converts the gate again (moving any old waiters into the default lane) and writes "
        "the fence"
    )
    if found == "zset" and stored < 2:
        return Finding(
            "warning",
            "schema",
            f"gate {keys.name!r} is at schema 1 ({keys.queue} is a FIFO zset of fleetgate 0.1): "
            "the first fleetgate >= 0.2 call on it converts it, after which fleetgate 0.1 "
            "clients and coordinators are refused on this gate; upgrade them first",
        )
    if found == "zset":
        return Finding(
            "error",
            "wrong_type",
            f"key {keys.queue} is a zset on a gate of schema {stored}: a fleetgate older than "
            f"0.2 wrote its wait list where schema 2 keeps a fence; {heal}",
        )
    if found == "none" and stored >= 2:
        return Finding(
            "warning",
            "schema",
            f"key {keys.queue} (schema 2's fence against fleetgate < 0.2) is missing on gate "
            f"{keys.name!r}: an old client would use the gate as a FIFO; {heal}",
        )
    return None


async def _types(client: Any, keys: list[str]) -> list[str]:
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.type(key)
    return [str(t) for t in await pipe.execute()]


async def _gate_findings(client: Any, keys: GateKeys) -> list[Finding]:
    out: list[Finding] = []
    attrs = list(EXPECTED_TYPES)
    types = dict(zip(attrs, await _types(client, [getattr(keys, a) for a in attrs]), strict=True))
    cfg = await client.hgetall(keys.cfg) if types["cfg"] == "hash" else {}
    for attr, expected in EXPECTED_TYPES.items():
        if attr == "queue" and types[attr] in ("zset", "none"):
            if types["cfg"] == "hash":
                finding = _queue_finding(keys, cfg.get("schema"), types[attr])
                if finding is not None:
                    out.append(finding)
        elif types[attr] not in ("none", expected):
            out.append(_wrong_type(getattr(keys, attr), types[attr], expected))
    if types["cfg"] == "hash":
        for name, low in _CFG_LOWEST.items():
            value = cfg.get(name)
            problem = None if value is None else _bad_number(str(value), low)
            if problem:
                out.append(
                    Finding(
                        "error",
                        "bad_value",
                        f"{keys.cfg} field {name}={str(value)[:40]!r} {problem}: the scripts "
                        "fall back to a default or fail; the coordinator rewrites it from its "
                        f"config, or fix it (redis-cli DEL '{keys.cfg}')",
                    )
                )
    if types["tenant_weights"] == "hash":
        low, high = _TENANT_WEIGHT_RANGE
        for tenant, value in (await client.hgetall(keys.tenant_weights)).items():
            problem = _bad_number(str(value), low, high)
            if problem:
                out.append(
                    Finding(
                        "error",
                        "bad_value",
                        f"{keys.tenant_weights} tenant {str(tenant)[:40]!r} weight "
                        f"{str(value)[:40]!r} {problem}: the scripts weigh that tenant 1 (or "
                        "clamp it); the coordinator rewrites the weights from its config",
                    )
                )
    if types["target"] == "hash":
        target = await client.hgetall(keys.target)
        for name in _TARGET_FIELDS:
            value = target.get(name)
            problem = None if value is None else _bad_number(str(value), 0)
            if problem:
                out.append(
                    Finding(
                        "error",
                        "bad_value",
                        f"{keys.target} field {name}={str(value)[:40]!r} {problem}: delete the "
                        f"target (redis-cli DEL '{keys.target}'); the leader publishes a new one",
                    )
                )
    return out
