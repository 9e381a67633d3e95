"""The gate scripts: loaded once from ``fleetgate.lua``, called by SHA, replies typed.

Each state transition of a gate is one Lua file under ``lua/`` with a header stating its KEYS,
ARGV and reply. ``lib.lua`` (time, limit, reaping, hand-off) is prepended to each script so those
rules exist once. redis-py ``Script`` objects call EVALSHA and reload on NOSCRIPT by themselves.
"""

from __future__ import annotations

import functools
import importlib.resources
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
from redis.exceptions import NoPermissionError, NoScriptError, ResponseError

from fleetgate._redis import ServerUnavailable, unavailable_reply
from fleetgate.errors import ConfigError, GateStateError
from fleetgate.keys import GateKeys

__all__ = [
    "SCRIPT_NAMES",
    "AcquireReply",
    "GateDefaults",
    "GateScripts",
    "HeartbeatReply",
    "Snapshot",
    "publish_args",
    "script_source",
]

SCRIPT_NAMES = (
    "acquire",
    "release",
    "cancel",
    "heartbeat",
    "set_target",
    "inspect",
    "adopt",
    "prune",
    "publish",
)
# Scripts on the fleet keys (not a gate's): self-contained, without lib.lua.
LEADER_SCRIPT_NAMES = ("leader_renew", "leader_release")

GRANTED, PARKED, REJECTED = 1, 2, 0


@functools.cache
def script_source(name: str) -> str:
    """The full source of script ``name``: the shared library followed by the script."""
    if name not in SCRIPT_NAMES + LEADER_SCRIPT_NAMES:
        raise ValueError(f"unknown script {name!r}")
    pkg = importlib.resources.files("fleetgate.lua")
    body = pkg.joinpath(f"{name}.lua").read_text(encoding="utf-8")
    if name in LEADER_SCRIPT_NAMES:
        return body
    lib = pkg.joinpath("lib.lua").read_text(encoding="utf-8")
    return f"{lib}\n{body}"


@dataclass(frozen=True)
class GateDefaults:
    """The configuration a client registers for a gate that has none yet."""

    floor: int = 1
    ceiling: int = 512
    max_queued: int = 1000
    lease_ms: int = 10_000
    waiter_ms: int = 5_000

    def argv(self) -> list[int]:
        return [self.floor, self.ceiling, self.max_queued, self.lease_ms, self.waiter_ms]


@dataclass(frozen=True)
class AcquireReply:
    status: int  # GRANTED, PARKED or REJECTED
    token: int
    limit: int
    n: int  # holders when granted, 1-based position when parked, max_queued when rejected
    lease_ms: int  # the TTLs in force (the caller paces its first renewal by them)
    waiter_ms: int
    expires_at: int  # server ms: when the lease (or the parked entry) expires; 0 if rejected


@dataclass(frozen=True)
class HeartbeatReply:
    limit: int
    live_pods: int
    lost_leases: list[str]
    granted_waiters: list[str]
    lost_waiters: list[str]
    queued: int
    holders: int
    lease_ms: int
    waiter_ms: int
    expires_at: int  # server ms the renewed leases now expire at
    pod_new: bool  # the pod's live entry had to be created (first, expired or wiped)
    adopted: list[str]  # leases the gate had lost before they expired, counted again


class Waiter(msgspec.Struct):
    id: str
    token: int
    expires_at: int | None = None


class Holder(msgspec.Struct):
    id: str
    expires_at: int


class Snapshot(msgspec.Struct):
    """A consistent view of one gate (the ``inspect`` script)."""

    now: int
    limit: int
    floor: int
    ceiling: int
    max_queued: int
    holders: int
    queued: int
    live_pods: int
    cfg: dict[str, str] = {}
    target: dict[str, str] = {}
    stats: dict[str, str] = {}
    util: dict[str, str] = {}
    head: list[Waiter] = []
    leases: list[Holder] = []


def _empty_tables_as_lists(raw: bytes | str) -> Any:
    # Redis' cjson encodes an empty Lua table as {}; the list fields are normalised here.
    obj = msgspec.json.decode(raw)
    for k in ("head", "leases"):
        if obj.get(k) == {}:
            obj[k] = []
    for k in ("cfg", "target", "stats", "util"):
        if obj.get(k) == []:
            obj[k] = {}
    return obj


@dataclass
class GateScripts:
    """The scripts registered on one redis-py client (standalone or cluster, asyncio)."""

    client: Any
    _scripts: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in SCRIPT_NAMES:
            self._scripts[name] = self.client.register_script(script_source(name))

    def script(self, name: str) -> Any:
        """The registered redis-py ``Script`` (for use in a pipeline: ``client=pipe``)."""
        return self._scripts[name]

    async def _call(self, name: str, keys: GateKeys, args: list[Any]) -> Any:
        try:
            return await self._scripts[name](keys=keys.script_keys(), args=args)
        except ResponseError as exc:
            raise await self.translate(exc, keys) from exc

    async def translate(self, exc: ResponseError, keys: GateKeys) -> Exception:
        """The error to raise for a Redis error reply to a script of gate ``keys``.

        A reply that means the server cannot serve writes now (OOM, READONLY, ...) becomes
        :class:`ServerUnavailable`, an outage; a command the Redis user may not run becomes a
        :class:`ConfigError`; anything else (WRONGTYPE, say) a :class:`GateStateError` naming
        the gate and the keys of the wrong type, found by one TYPE per key (only on this path).
        """
        if unavailable_reply(exc):
            return ServerUnavailable(str(exc))
        if isinstance(exc, NoScriptError):
            return exc
        text = str(exc)
        if isinstance(exc, NoPermissionError) or "can't run this command" in text:
            return ConfigError(
                f"gate {keys.name!r}: the Redis user may not run a command the gate scripts "
                f"need ({text}); see deploy/acl.conf"
            )
        wrong: list[str] = []
        try:
            for key, expected in keys.expected_types():
                kind = await self.client.type(key)
                if kind not in ("none", expected):
                    wrong.append(f"{key} ({kind}, expected {expected})")
        except Exception:  # the diagnosis is best effort; the error below stands
            wrong = []
        return GateStateError(keys.name, wrong, text)

    async def acquire(
        self, keys: GateKeys, lease_id: str, wait_ms: int, defaults: GateDefaults
    ) -> AcquireReply:
        r = await self._call("acquire", keys, [lease_id, max(1, wait_ms), *defaults.argv()])
        return AcquireReply(*(int(x) for x in r[:7]))

    async def release(self, keys: GateKeys, lease_id: str) -> bool:
        r = await self._call("release", keys, [lease_id])
        return int(r[0]) == 1

    async def cancel(self, keys: GateKeys, waiter_id: str) -> int:
        r = await self._call("cancel", keys, [waiter_id])
        return int(r[0])

    async def heartbeat(
        self,
        keys: GateKeys,
        pod_id: str,
        pod_ttl_ms: int,
        leases: list[tuple[str, int]],
        waiters: list[tuple[str, int]],
        *,
        max_token: int = 0,
        defaults: GateDefaults | None = None,
    ) -> HeartbeatReply:
        """Renew ``leases`` ((id, server-ms expiry last seen)) and ``waiters`` ((id, remaining
        deadline ms)) of pod ``pod_id``; an empty pod id only sweeps the gate."""
        args: list[Any] = [pod_id, pod_ttl_ms, len(leases)]
        for lid, expires_at in leases:
            args += [lid, expires_at]
        args.append(len(waiters))
        for wid, remaining_ms in waiters:
            args += [wid, max(1, remaining_ms)]
        args.append(max_token)
        if defaults is not None:
            args += defaults.argv()
        r = await self._call("heartbeat", keys, args)
        return HeartbeatReply(
            limit=int(r[0]),
            live_pods=int(r[1]),
            lost_leases=[_s(x) for x in r[2]],
            granted_waiters=[_s(x) for x in r[3]],
            lost_waiters=[_s(x) for x in r[4]],
            queued=int(r[5]),
            holders=int(r[6]),
            lease_ms=int(r[7]),
            waiter_ms=int(r[8]),
            expires_at=int(r[9]),
            pod_new=int(r[10]) == 1,
            adopted=[_s(x) for x in r[11]],
        )

    async def set_target(self, keys: GateKeys, value: int, epoch: int, ttl_ms: int) -> bool:
        r = await self._call("set_target", keys, [value, epoch, ttl_ms])
        return int(r[0]) == 1

    async def publish(
        self,
        keys: GateKeys,
        epoch: int,
        ttl_ms: int,
        target: int | None,
        cfg: Mapping[str, Any],
        util: Mapping[str, Any],
    ) -> bool:
        """The coordinator's epoch-fenced write of one gate (``publish.lua``); False = refused."""
        r = await self._call("publish", keys, publish_args(epoch, ttl_ms, target, cfg, util))
        return int(r[0]) == 1

    async def adopt(
        self, keys: GateKeys, lease_ids: list[str], max_token: int = 0
    ) -> tuple[int, int]:
        """Count ``lease_ids`` (running work) as leases again after an outage; raise the gate's
        token counter above ``max_token``. Returns (ids added, server-ms expiry)."""
        r = await self._call("adopt", keys, [max_token, *lease_ids])
        return int(r[0]), int(r[1])

    async def inspect(
        self, keys: GateKeys, n: int = 10, defaults: GateDefaults | None = None
    ) -> Snapshot:
        """Snapshot of a gate listing its first ``n`` waiters and holders (``n <= 0``: none; at
        most 1000): the counts are exact, and the cost never grows with the queue."""
        args: list[Any] = [n, *(defaults.argv() if defaults else [])]
        raw = await self._call("inspect", keys, args)
        return msgspec.convert(_empty_tables_as_lists(raw), Snapshot, strict=False)


def publish_args(
    epoch: int, ttl_ms: int, target: int | None, cfg: Mapping[str, Any], util: Mapping[str, Any]
) -> list[Any]:
    """ARGV of ``publish.lua``: target None leaves the target's value alone."""
    args: list[Any] = [epoch, ttl_ms, "" if target is None else target, len(cfg)]
    for pairs in (cfg, util):
        for k, v in pairs.items():
            args += [k, v]
    return args


def _s(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x
