"""Checks of fleetgate's keys under a prefix: keys that hold the wrong Redis type (every script
on that gate then fails with ``WRONGTYPE``) and configuration values that are not numbers."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import redis.asyncio as aredis
from redis.exceptions import ResponseError

from fleetgate.keys import GateKeys, fleet_keys
from fleetgate.registry import read_registry
from fleetgate.safety.findings import Finding, denied
from fleetgate.settings import bounds

__all__ = ["EXPECTED_TYPES", "find_bad_keys"]

# Redis type of every key of one gate (GateKeys attribute -> TYPE reply); absent keys are fine.
# The same table as GateKeys.expected_types() (tests/core/test_redis_safety.py checks it), by
# attribute.
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
    # the coordinator's tuned token budget and the server ms it lapses at (publish.lua)
    "token_target": 1,
    "token_target_until": 0,
    **{name: low for name, (low, _) in bounds().items()},
}
# fg:{G}:tw values: the scripts clamp a tenant weight to [1, 1000] and read garbage as 1.
_TENANT_WEIGHT_RANGE = (1, 1000)
_TARGET_FIELDS = ("value", "epoch", "expires_at")
# Larger numbers are no configuration anyone means (a lease of 30 years, a cap of 10^18), and
# make the scripts compute with floats that Redis cannot return.
_MAX_VALUE = 2**53


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
        if not denied(exc):
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
        out += _cfg_findings(keys, cfg)
    if types["tenant_weights"] == "hash":
        out += _weight_findings(keys, await client.hgetall(keys.tenant_weights))
    if types["target"] == "hash":
        out += _target_findings(keys, await client.hgetall(keys.target))
    return out


def _cfg_findings(keys: GateKeys, cfg: Mapping[Any, Any]) -> list[Finding]:
    out: list[Finding] = []
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
    return out


def _weight_findings(keys: GateKeys, weights: Mapping[Any, Any]) -> list[Finding]:
    out: list[Finding] = []
    low, high = _TENANT_WEIGHT_RANGE
    for tenant, value in weights.items():
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
    return out


def _target_findings(keys: GateKeys, target: Mapping[Any, Any]) -> list[Finding]:
    out: list[Finding] = []
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
