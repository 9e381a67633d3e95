"""The gate scripts: one Redis Functions library built from ``fleetgate.lua``, replies typed.

Each state transition of a gate is one Lua file under ``lua/`` with a header stating its KEYS,
ARGV and reply. ``lib.lua`` (time, limit, reaping, hand-off) holds the rules they share, once.

The gate scripts are loaded as one Redis Functions library (:func:`gate_library`): ``lib.lua``,
``heartbeat_lib.lua`` and every script wrapped as a function, loaded once per server by
``FUNCTION LOAD`` and called by ``FCALL``, so the library's ~45 closures are created once at load
instead of at every call (an EVALSHA of ``lib.lua`` + a script re-ran lib.lua's top level: 5 µs
of server time per call, docs/design.md). The library and its functions are named after a hash
of its source, so two fleetgate versions in one fleet (a rolling upgrade) never replace each
other's code. A call that finds its function missing (Redis restarted empty, a new Cluster
primary, ``FUNCTION FLUSH``) loads the library and is sent again, once.

:func:`script_source` still gives each script as one EVAL-able source (``lib.lua`` prepended),
for tests and benchmarks; the leader scripts stay plain EVALSHA scripts.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import msgspec
from redis.asyncio.client import Pipeline
from redis.exceptions import NoPermissionError, NoScriptError, ResponseError

from fleetgate._redis import BatchCall, RedisMode, ServerUnavailable, unavailable_reply
from fleetgate.errors import ConfigError, GateStateError
from fleetgate.keys import GateKeys
from fleetgate.settings import GateSettings

__all__ = [
    "MAX_BATCH",
    "SCRIPT_NAMES",
    "AcquireReply",
    "GateLibrary",
    "GateScripts",
    "HeartbeatReply",
    "HeartbeatRequest",
    "LeaderScripts",
    "ScriptCall",
    "Snapshot",
    "Utilization",
    "gate_library",
    "script_source",
]

SCRIPT_NAMES = (
    "acquire",
    "release",
    "cancel",
    "heartbeat",
    "heartbeat_many",
    "set_target",
    "inspect",
    "adopt",
    "prune",
    "publish",
)
# Scripts that also get heartbeat_lib.lua (the heartbeat transition of one gate).
_HEARTBEAT_SCRIPTS = ("heartbeat", "heartbeat_many")
# What one heartbeat_many call may carry, in units of about 30 µs of server time: an idle gate
# (nothing to renew: reap, register the pod, count) is 1, a gate with leases or waiters 2 plus
# one per 4 ids (measured: ~30 µs per idle gate, ~70 µs per gate holding one lease;
# benchmarks/pod_cost.py). 40 units keep a call near a millisecond, so another client's call
# (a release, a hand-off) never waits long behind a pod's heartbeat.
HEARTBEAT_UNITS_PER_CALL = 40
# Scripts on the fleet keys (not a gate's): self-contained, without lib.lua.
LEADER_SCRIPT_NAMES = ("leader_renew", "leader_release")

GRANTED, PARKED, REJECTED = 1, 2, 0  # acquire.lua's status
# acquire.lua's other refusals: the tenant's queue bound, a sheddable band that could not be
# granted at once, a weight above the ceiling (never grantable).
REJECTED_TENANT, SHED, TOO_HEAVY = 3, 4, 5
# The gate state's schema these scripts implement (lua/lib.lua SCHEMA).
SCHEMA = 2
# Requests per acquire_many / release_many call: the script's variadic commands take 2 values per
# id, well inside Lua's unpack limit (~8,000), and one call stays short for other clients.
MAX_BATCH = 256


PRUNED, IDLE, IN_USE, PRUNE_REFUSED = 1, 2, 0, -1  # prune.lua's state

_R = TypeVar("_R")


#: The shared library's parts (``lua/lib_*.lua``), in the order they are joined: each uses only
#: what the parts before it define (their locals are one chunk's), ``lib_gate`` first (the keys).
LIB_PARTS = (
    "lib_gate",
    "lib_cfg",
    "lib_fence",
    "lib_order",
    "lib_units",
    "lib_lanes",
    "lib_reap",
    "lib_wakes",
    "lib_tokens",
    "lib_handoff",
)


def _read(name: str) -> str:
    return importlib.resources.files("fleetgate.lua").joinpath(f"{name}.lua").read_text("utf-8")


@functools.cache
def lib_source() -> str:
    """The shared library: the :data:`LIB_PARTS` joined in order, as EVAL runs it (its top level
    points the gate keys at ``KEYS[1]``)."""
    return "\n".join(_read(part) for part in LIB_PARTS)


@functools.cache
def script_source(name: str) -> str:
    """The full source of script ``name``: the shared library followed by the script."""
    if name not in SCRIPT_NAMES + LEADER_SCRIPT_NAMES:
        raise ValueError(f"unknown script {name!r}")
    body = _read(name)
    if name in LEADER_SCRIPT_NAMES:
        return body
    lib = lib_source()
    if name in _HEARTBEAT_SCRIPTS:
        lib += "\n" + _read("heartbeat_lib")
    return f"{lib}\n{body}"


# Function flags (FUNCTION LOAD): a function without flags is refused before it starts while
# Redis is out of memory (maxmemory reached), as acquire, publish, adopt, set_target and prune
# should be (they add state). allow-oom runs it anyway: release and cancel free memory (under
# EVAL they ran because their first write is a removal), the heartbeat keeps the leases of work
# that is running alive (renewals rewrite existing entries; a hand-off only grants what was
# freed), and inspect only reads (it writes only when converting a schema-1 gate, which is
# small), so ``fleetgate status`` works during the incident.
FUNCTION_FLAGS: dict[str, tuple[str, ...]] = {
    "release": ("allow-oom",),
    "cancel": ("allow-oom",),
    "heartbeat": ("allow-oom",),
    "heartbeat_many": ("allow-oom",),
    "inspect": ("allow-oom",),
}
# lib.lua's top level points the gate keys at KEYS[1] (the EVAL form); each library function
# does it at its start instead (a library's top level runs once, at load, without KEYS).
_USE_GATE = "use_gate(KEYS[1])\n"
_HASH = "@HASH@"


@dataclass(frozen=True)
class GateLibrary:
    """The gate scripts as one Redis Functions library (see the module docstring)."""

    name: str  # fleetgate_<12 hex of the sha1 of the source>
    source: str  # FUNCTION LOAD's argument
    functions: Mapping[str, str]  # script name -> function name


@functools.cache
def gate_library() -> GateLibrary:
    """The library: ``lib.lua`` and ``heartbeat_lib.lua`` once, then each gate script as
    ``local function <name>_body(KEYS, ARGV)`` (which first points the gate keys at KEYS[1]),
    registered as ``fg_<hash>_<name>`` with its :data:`FUNCTION_FLAGS`. The hash is the first
    12 hex digits of the sha1 of the source (with the hash left out)."""
    lib = lib_source()
    if lib.count(_USE_GATE) != 1:
        raise RuntimeError("the shared library: expected one top-level use_gate(KEYS[1])")
    parts = [f"#!lua name=fleetgate_{_HASH}", lib.replace(_USE_GATE, "", 1), _read("heartbeat_lib")]
    for name in SCRIPT_NAMES:
        body = _read(name)
        parts.append(f"local function {name}_body(KEYS, ARGV)\nuse_gate(KEYS[1])\n{body}\nend")
    for name in SCRIPT_NAMES:
        flags = ", ".join(f"'{f}'" for f in FUNCTION_FLAGS.get(name, ()))
        parts.append(
            f"redis.register_function{{function_name = 'fg_{_HASH}_{name}', "
            f"callback = {name}_body, flags = {{{flags}}}}}"
        )
    template = "\n".join(parts) + "\n"
    digest = hashlib.sha1(template.encode()).hexdigest()[:12]
    return GateLibrary(
        name=f"fleetgate_{digest}",
        source=template.replace(_HASH, digest),
        functions={name: f"fg_{digest}_{name}" for name in SCRIPT_NAMES},
    )


def function_missing(reply: object) -> bool:
    """Whether ``reply`` is the error of an FCALL whose function the server does not have."""
    return isinstance(reply, ResponseError) and "Function not found" in str(reply)


class _Loader:
    """Loads :func:`gate_library` on every primary behind one client: before its first call,
    and again when a call finds its function missing."""

    __slots__ = ("library", "loaded", "redis")

    def __init__(self, redis: RedisMode) -> None:
        self.redis = redis
        self.library = gate_library()
        self.loaded = False

    async def ensure(self) -> None:
        if not self.loaded:
            await self.load()

    async def load(self) -> None:
        """FUNCTION LOAD (no REPLACE: a library of this name holds this very code) on each
        primary; "already exists" is success. A refusal (OOM, NOPERM, ...) raises."""
        client, source = self.redis.client, self.library.source

        async def load_one(**target: Any) -> None:
            try:
                await client.execute_command("FUNCTION LOAD", source, **target)
            except ResponseError as exc:
                if "already exists" not in str(exc):
                    raise

        await self.redis.each_primary(load_one)
        self.loaded = True


class _GateFunction:
    """One gate script as a library function, called like a redis-py ``Script``:
    ``await f(keys=..., args=..., client=...)``; on a pipeline that only queues the FCALL (the
    caller retries a missing function: :meth:`GateScripts._redis_batch`)."""

    __slots__ = ("loader", "name")

    def __init__(self, loader: _Loader, name: str) -> None:
        self.loader = loader
        self.name = name

    async def __call__(self, keys: Sequence[str], args: Sequence[Any], client: Any) -> Any:
        await self.loader.ensure()
        if isinstance(client, Pipeline):
            return client.fcall(self.name, len(keys), *keys, *args)
        try:
            return await client.fcall(self.name, len(keys), *keys, *args)
        except ResponseError as exc:
            if not function_missing(exc):
                raise
        await self.loader.load()
        return await client.fcall(self.name, len(keys), *keys, *args)


class AcquireReply(msgspec.Struct, frozen=True, kw_only=True):
    """``acquire.lua``'s reply. Of ``holders``, ``position`` and ``max_queued`` only the one of
    the outcome is set (the others are 0)."""

    status: int  # GRANTED, PARKED, REJECTED, REJECTED_TENANT, SHED or TOO_HEAVY
    token: int  # granted: the fencing token; parked: the seq of the waiter member
    limit: int
    holders: int  # granted: units held counting this one
    position: int  # parked: waiters counting this one
    #: refused: the bound that refused it (max_queued, per tenant, shed_below or ceiling)
    max_queued: int
    lease_ms: int  # the TTLs in force (the caller paces its first renewal by them)
    waiter_ms: int
    expires_at: int  # server ms: when the lease (or the parked entry) expires; 0 if rejected
    #: ms the gate's recovery fence still holds every grant (0: none; ``lua/lib.lua``
    #: gate_birth): a caller parked behind it asks for its hand-off when it ends
    fence_ms: int = 0

    @classmethod
    def decode_many(cls, reply: Any) -> list[AcquireReply]:
        """acquire.lua's reply: {limit, lease_ms, waiter_ms, released, fence_ms, then per
        request: status, token, n, expires_at}."""
        limit, lease_ms, waiter_ms = int(reply[0]), int(reply[1]), int(reply[2])
        fence_ms = int(reply[4])
        out = []
        for i in range(5, len(reply), 4):
            status, token, n, expires_at = (int(x) for x in reply[i : i + 4])
            out.append(
                cls(
                    status=status,
                    token=token,
                    limit=limit,
                    holders=n if status == GRANTED else 0,
                    position=n if status == PARKED else 0,
                    max_queued=n if status not in (GRANTED, PARKED) else 0,
                    lease_ms=lease_ms,
                    waiter_ms=waiter_ms,
                    expires_at=expires_at,
                    fence_ms=fence_ms,
                )
            )
        return out


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
    #: fencing tokens of granted_waiters, in order (fresh: their wake-ups were missed)
    granted_tokens: list[int] = field(default_factory=list)
    #: waiters evicted by a higher band (they get Overloaded)
    evicted: list[str] = field(default_factory=list)
    #: waiters refused because they weigh more than the ceiling, lowered after they parked
    #: (they get ConfigError, as an arrival that heavy: TOO_HEAVY)
    too_heavy: list[str] = field(default_factory=list)
    ceiling: int = 0  # the ceiling in force

    @classmethod
    def decode(cls, r: Any) -> HeartbeatReply:
        return cls(
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
            granted_tokens=[int(x) for x in r[12]],
            evicted=[_s(x) for x in r[13]],
            too_heavy=[_s(x) for x in r[14]],
            ceiling=int(r[15]),
        )


class Waiter(msgspec.Struct):
    """A parked caller as ``inspect.lua`` lists it (token = its seq in its lane)."""

    id: str
    token: int
    expires_at: int | None = None
    weight: int = 1
    priority: int = 0
    tenant: str = ""


class Holder(msgspec.Struct):
    id: str
    expires_at: int
    weight: int = 1


class Lane(msgspec.Struct):
    """One (priority, tenant) line of waiters as ``inspect.lua`` lists it: in service order,
    ``tag`` its virtual finish tag, or ``oversize`` when its head weighs more than the limit;
    ``reserved`` the waiter the band's free units are kept for."""

    priority: int
    tenant: str
    queued: int
    tag: int | None = None
    oversize: bool = False
    reserved: str | None = None


class Utilization(msgspec.Struct, frozen=True, kw_only=True):
    """The coordinator's last utilisation snapshot of a gate (``fg:{G}:util``), parsed: a
    missing or garbled value is None (False for the flags)."""

    running: float | None = None
    waiting_capacity: float | None = None
    metrics_ok: bool = False
    saturated: bool = False
    last_poll: float | None = None
    metrics_url: str | None = None
    reason: str | None = None
    server: str | None = None
    #: "latency" for a gate driven by the client-observed signal (else None: metrics or fixed)
    signal: str | None = None
    #: the last poll's median call latency and the estimated no-load latency (seconds)
    latency_p50: float | None = None
    latency_no_load: float | None = None
    #: calls reported by releases during the last poll, and the overloads/timeouts among them
    obs_calls: float | None = None
    obs_overloaded: float | None = None
    obs_timeout: float | None = None

    @classmethod
    def parse(cls, util: Mapping[str, str]) -> Utilization:
        return cls(
            running=_float(util.get("running")),
            waiting_capacity=_float(util.get("waiting_capacity")),
            metrics_ok=util.get("metrics_ok") == "1",
            saturated=util.get("saturated") == "1",
            last_poll=_float(util.get("last_poll")),
            metrics_url=util.get("metrics_url") or None,
            reason=util.get("reason") or None,
            server=util.get("server") or None,
            signal=util.get("signal") or None,
            latency_p50=_float(util.get("latency_p50")),
            latency_no_load=_float(util.get("latency_no_load")),
            obs_calls=_float(util.get("obs_calls")),
            obs_overloaded=_float(util.get("obs_overloaded")),
            obs_timeout=_float(util.get("obs_timeout")),
        )


class Snapshot(msgspec.Struct):
    """A consistent view of one gate (``inspect.lua``): the raw hashes plus parsed views of them
    (:attr:`live_target`, :attr:`epoch`, :meth:`utilization`, :meth:`stat`)."""

    now: int
    limit: int
    floor: int
    ceiling: int
    max_queued: int
    holders: int
    queued: int
    live_pods: int
    lease_ms: int = 0
    waiter_ms: int = 0
    #: units held: the holders' weights (expired-but-unreaped leases included)
    units: int = 0
    schema: int = 0
    max_queued_per_tenant: int = 0
    shed_below: int = 0
    tenant_weights: dict[str, str] = {}
    lanes: list[Lane] = []
    cfg: dict[str, str] = {}
    target: dict[str, str] = {}
    stats: dict[str, str] = {}
    util: dict[str, str] = {}
    head: list[Waiter] = []
    leases: list[Holder] = []

    @property
    def live_target(self) -> int | None:
        """The coordinator's published target while it is unexpired, else None (the limit has
        decayed to the floor)."""
        expires = _int(self.target.get("expires_at"))
        if expires is None or expires <= self.now:
            return None
        return _int(self.target.get("value"))

    @property
    def epoch(self) -> int | None:
        """The epoch of the leader that last published the gate."""
        return _int(self.target.get("epoch"))

    def stat(self, name: str) -> int:
        """A fleet-wide counter of ``fg:{G}:stats`` (0 when absent)."""
        return _int(self.stats.get(name)) or 0

    def utilization(self) -> Utilization:
        return Utilization.parse(self.util)


def _int(v: str | None) -> int | None:
    if v is None or v == "":
        return None
    try:
        return int(float(v))
    except (ValueError, OverflowError):
        return None


def _float(v: str | None) -> float | None:
    if v is None or v == "":
        return None
    try:
        return float(v)
    except ValueError:
        return None


def _empty_tables_as_lists(raw: bytes | str) -> Any:
    # Redis' cjson encodes an empty Lua table as {}; the list fields are normalised here.
    obj = msgspec.json.decode(raw)
    for k in ("head", "leases", "lanes"):
        if obj.get(k) == {}:
            obj[k] = []
    for k in ("cfg", "target", "stats", "util", "tenant_weights"):
        if obj.get(k) == []:
            obj[k] = {}
    return obj


@dataclass(frozen=True)
class HeartbeatRequest:
    """One gate's heartbeat, as :meth:`GateScripts.heartbeat` takes it (for
    :meth:`GateScripts.heartbeats`)."""

    keys: GateKeys
    pod_id: str
    pod_ttl_ms: int
    leases: list[tuple[str, int]]
    waiters: list[tuple[str, int]]
    max_token: int = 0
    defaults: GateSettings | None = None
    #: the recovery fence this pod sets on a gate it finds without state (see
    #: :meth:`GateScripts.acquire_many`); 0 sets none
    fence_ms: int = 0

    def argv(self) -> list[Any]:
        """heartbeat.lua's ARGV."""
        args: list[Any] = [self.pod_id, self.pod_ttl_ms, len(self.leases)]
        for lid, expires_at in self.leases:
            args += [lid, expires_at]
        args.append(len(self.waiters))
        for wid, remaining_ms in self.waiters:
            args += [wid, max(1, remaining_ms)]
        args += [self.max_token, self.fence_ms]
        if self.defaults is not None:
            args += self.defaults.argv()
        return args


class _ManyHeartbeats:
    """One heartbeat_many.lua call for several gates of one slot (a :data:`BatchCall`)."""

    __slots__ = ("args", "keys", "script")

    def __init__(self, script: Any, requests: Sequence[HeartbeatRequest], mode: RedisMode) -> None:
        self.script = script
        # The gates' base names first (the script reads gate j's at KEYS[j]), then, on Cluster,
        # every gate's declared keys (see RedisMode.script_keys). Declared keys laid end to end
        # put gate 2's name at KEYS[1 + 17], not KEYS[2]: gate 2 was renewed on keys derived
        # from gate 1's second key, its real lease expired while held.
        self.keys: list[str] = [req.keys.base for req in requests]
        if mode.cluster:
            for req in requests:
                self.keys += mode.script_keys(req.keys)
        self.args: list[Any] = [len(requests)]
        for req in requests:
            argv = req.argv()
            self.args += [len(argv), *argv]

    def __call__(self, client: Any) -> Any:
        return self.script(keys=self.keys, args=self.args, client=client)


class ScriptCall(Generic[_R]):
    """One script call with its arguments encoded and its reply decoder: awaited alone by
    :class:`GateScripts`, or batched with others by :meth:`GateScripts.batch`."""

    __slots__ = ("args", "decode", "key_names", "keys", "script")

    def __init__(
        self,
        script: Any,
        keys: GateKeys,
        args: list[Any],
        decode: Callable[[Any], _R],
        key_names: list[str],
    ) -> None:
        self.script = script
        self.keys = keys
        self.args = args
        self.decode = decode
        #: the KEYS sent (RedisMode.script_keys)
        self.key_names = key_names

    def __call__(self, client: Any) -> Any:
        """Issue the call on ``client`` (a client, or a pipeline it queues itself on)."""
        return self.script(keys=self.key_names, args=self.args, client=client)


@dataclass
class GateScripts:
    """The scripts registered on one redis-py client (standalone or cluster, asyncio).

    Every script's ARGV is encoded here and every reply decoded here: one call at a time
    (:meth:`acquire`, ...) or several gates' calls batched (the ``*_call`` methods with
    :meth:`batch`).
    """

    client: Any
    _scripts: dict[str, Any] = field(default_factory=dict)
    redis: RedisMode = field(init=False)

    _loader: _Loader = field(init=False)

    def __post_init__(self) -> None:
        self.redis = RedisMode(self.client)
        self._loader = _Loader(self.redis)
        for name, function in self._loader.library.functions.items():
            self._scripts[name] = _GateFunction(self._loader, function)

    async def _run(self, call: ScriptCall[_R]) -> _R:
        try:
            raw = await call(self.client)
        except ResponseError as exc:
            raise await self.translate(exc, call.keys) from exc
        return call.decode(raw)

    async def batch(
        self,
        calls: Sequence[ScriptCall[_R]],
        *,
        also: Sequence[BatchCall] = (),
        raise_on_error: bool = True,
    ) -> list[_R | Exception]:
        """Run ``calls`` together (one pipeline on a standalone Redis, concurrent calls on a
        Cluster) after the plain commands ``also`` (whose replies are dropped); the replies
        decoded, in order. ``raise_on_error=False``: a failed call's exception is its reply."""
        try:
            raw = await self._redis_batch([*also, *calls], raise_on_error=raise_on_error)
        except ResponseError as exc:
            if unavailable_reply(exc):  # an outage, as for a single call
                raise ServerUnavailable(str(exc)) from exc
            raise
        return [
            r if isinstance(r, Exception) else c.decode(r)
            for c, r in zip(calls, raw[len(also) :], strict=True)
        ]

    async def _redis_batch(self, calls: Sequence[BatchCall], *, raise_on_error: bool) -> list[Any]:
        """:meth:`RedisMode.batch`, with the calls that found their function missing (Redis
        restarted empty mid-pipeline, say: they ran nothing) sent again once after the library
        is loaded. ``raise_on_error``: the first failed call's exception raises."""
        raw = await self.redis.batch(calls, raise_on_error=False)
        missing = [i for i, r in enumerate(raw) if function_missing(r)]
        if missing:
            await self._loader.load()
            again = await self.redis.batch([calls[i] for i in missing], raise_on_error=False)
            for i, r in zip(missing, again, strict=True):
                raw[i] = r
        if raise_on_error:
            for r in raw:
                if isinstance(r, BaseException):
                    raise r
        return raw

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
        if "fleetgate schema:" in text:
            return ConfigError(f"gate {keys.name!r}: {text[text.index('fleetgate schema:') :]}")
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

    # -- one call per script: ARGV encoded, reply decoded ----------------------------------

    def _call(
        self, name: str, keys: GateKeys, args: list[Any], decode: Callable[[Any], _R]
    ) -> ScriptCall[_R]:
        return ScriptCall(self._scripts[name], keys, args, decode, self.redis.script_keys(keys))

    async def acquire(
        self, keys: GateKeys, lease_id: str, wait_ms: int, defaults: GateSettings
    ) -> AcquireReply:
        return (await self.acquire_many(keys, [(lease_id, wait_ms)], defaults))[0]

    async def acquire_many(
        self,
        keys: GateKeys,
        requests: Sequence[tuple[str, int] | tuple[str, int, str]],
        defaults: GateSettings,
        *,
        releases: Sequence[str] = (),
        observed: Sequence[str | int] = (),
        fence_ms: int = 0,
    ) -> list[AcquireReply]:
        """One acquire call for several callers of one gate, each ``(lease id, wait_ms)`` or
        ``(lease id, wait_ms, class)`` (:func:`fleetgate.admission.lane_class`; the weight is in
        the id, :func:`fleetgate.admission.weighted_id`): granted, parked or refused in order,
        as if they had asked one after the other, after ``releases`` (lease ids) were released
        and ``observed`` (their reports, :func:`fleetgate.observed.tally`) counted.
        At most :data:`MAX_BATCH` of each.

        ``fence_ms``: if the gate has no state (a new gate, or Redis lost it), no grant is made
        for that long, so pods whose work the lost state counted can count it again first
        (``lua/lib.lua`` gate_birth; 0: no fence)."""
        _check_batch(len(requests))
        _check_batch(len(releases), least=0)
        args: list[Any] = [*_encoded_argv(defaults), fence_ms, len(releases), *releases]
        args += (len(observed), *observed)
        for req in requests:
            args += (req[0], max(1, req[1]), req[2] if len(req) > 2 else "")
        return await self._run(self._call("acquire", keys, args, AcquireReply.decode_many))

    async def release(self, keys: GateKeys, lease_id: str) -> bool:
        """Whether ``lease_id`` held a lease (it is released, its slot handed on)."""
        return await self.release_many(keys, [lease_id]) == 1

    async def release_many(
        self, keys: GateKeys, lease_ids: Sequence[str], observed: Sequence[str | int] = ()
    ) -> int:
        """Release several leases of one gate in one call (at most :data:`MAX_BATCH`) and count
        their reports (``observed``: :func:`fleetgate.observed.tally`); returns how many of
        them held a lease."""
        _check_batch(len(lease_ids))
        args: list[Any] = [len(observed), *observed, *lease_ids]
        return await self._run(self._call("release", keys, args, int))

    async def cancel(self, keys: GateKeys, lease_id: str, member: str = "") -> int:
        """Leave the wait list (``member``: the waiter member it parked as, if it parked) or
        release ``lease_id``: 1 = left the wait list, 2 = the grant raced in and was released,
        0 = unknown id."""
        return await self._run(self._call("cancel", keys, [lease_id, member], _first))

    async def heartbeat(
        self,
        keys: GateKeys,
        pod_id: str,
        pod_ttl_ms: int,
        leases: list[tuple[str, int]],
        waiters: list[tuple[str, int]],
        *,
        max_token: int = 0,
        defaults: GateSettings | None = None,
        fence_ms: int = 0,
    ) -> HeartbeatReply:
        """Renew ``leases`` ((id, server-ms expiry last seen)) and ``waiters`` ((waiter member,
        remaining deadline ms)) of pod ``pod_id``; an empty pod id only sweeps the gate.
        ``fence_ms`` as for :meth:`acquire_many`."""
        req = HeartbeatRequest(
            keys, pod_id, pod_ttl_ms, leases, waiters, max_token, defaults, fence_ms
        )
        return await self._run(self._heartbeat_call(req, HeartbeatReply.decode))

    def _heartbeat_call(self, req: HeartbeatRequest, decode: Callable[[Any], _R]) -> ScriptCall[_R]:
        """heartbeat.lua for one gate's request."""
        return self._call("heartbeat", req.keys, req.argv(), decode)

    async def heartbeats(
        self, requests: Sequence[HeartbeatRequest], *, units: int = HEARTBEAT_UNITS_PER_CALL
    ) -> list[HeartbeatReply | Exception]:
        """The heartbeats of several gates, in few script calls: the gates are grouped by slot
        (:meth:`RedisMode.slot_group`: all of them on a standalone Redis), each group sent as
        ``heartbeat_many.lua`` calls of at most ``units`` (:data:`HEARTBEAT_UNITS_PER_CALL`;
        a group of one as a plain ``heartbeat.lua``). The single-gate calls go as one
        :meth:`RedisMode.batch`; the multi-gate calls one after the other, so Redis serves other
        clients between them (a pipeline of them would run back to back).

        Returns one reply per request, in order: the decoded reply, or the exception of that
        gate's call (a gate error such as WRONGTYPE as :meth:`translate` gives it; a failed
        multi-gate call is sent again gate by gate, so one broken gate never stops the others'
        renewals). An outage (connection error, an OOM/READONLY/... reply) raises.
        """
        groups: dict[int, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(self.redis.slot_group(req.keys.base), []).append(i)
        chunks: list[list[int]] = []
        for members in groups.values():
            chunk: list[int] = []
            load = 0
            for i in members:
                cost = _heartbeat_units(requests[i])
                if chunk and load + cost > units:
                    chunks.append(chunk)
                    chunk, load = [], 0
                chunk.append(i)
                load += cost
            chunks.append(chunk)
        singles = [c for c in chunks if len(c) == 1]
        many = [c for c in chunks if len(c) > 1]
        chunks = singles + many
        raw = await self._batch_raw(
            [
                self._heartbeat_call(requests[c[0]], _identity)
                for c in singles
            ]
        )
        for c in many:
            raw += await self._batch_raw(
                [
                    _ManyHeartbeats(
                        self._scripts["heartbeat_many"], [requests[i] for i in c], self.redis
                    )
                ]
            )
        out: list[HeartbeatReply | Exception | None] = [None] * len(requests)
        retry: list[int] = []
        for chunk, reply in zip(chunks, raw, strict=True):
            if isinstance(reply, Exception):
                if len(chunk) > 1:
                    retry += chunk
                else:
                    out[chunk[0]] = await self._gate_error(reply, requests[chunk[0]].keys)
            elif len(chunk) == 1:
                out[chunk[0]] = HeartbeatReply.decode(reply)
            else:
                for i, r in zip(chunk, reply, strict=True):
                    out[i] = HeartbeatReply.decode(r)
        if retry:
            one_by_one: list[BatchCall] = [
                self._heartbeat_call(requests[i], _identity) for i in retry
            ]
            for i, reply in zip(retry, await self._batch_raw(one_by_one), strict=True):
                out[i] = (
                    await self._gate_error(reply, requests[i].keys)
                    if isinstance(reply, Exception)
                    else HeartbeatReply.decode(reply)
                )
        return [r if r is not None else RuntimeError("no reply") for r in out]

    async def _batch_raw(self, calls: Sequence[BatchCall]) -> list[Any]:
        """``calls`` as one batch; a failed call's exception is its reply; an outage raises."""
        try:
            raw = await self._redis_batch(calls, raise_on_error=False)
        except ResponseError as exc:  # the library could not be loaded
            if unavailable_reply(exc):
                raise ServerUnavailable(str(exc)) from exc
            raise
        for r in raw:
            if isinstance(r, ResponseError) and unavailable_reply(r):
                raise ServerUnavailable(str(r)) from r
            if isinstance(r, BaseException) and not isinstance(r, ResponseError):
                raise r  # Cluster: a connection error of one concurrent call
        return raw

    async def _gate_error(self, exc: Exception, keys: GateKeys) -> Exception:
        return await self.translate(exc, keys) if isinstance(exc, ResponseError) else exc

    def sweep_call(self, keys: GateKeys) -> ScriptCall[Any]:
        """A heartbeat without a pod: renews nothing, only reaps and hands off (the reaper)."""
        return self._call("heartbeat", keys, ["", 0, 0, 0, 0], HeartbeatReply.decode)

    async def set_target(self, keys: GateKeys, value: int, epoch: int, ttl_ms: int) -> bool:
        return await self._run(self._call("set_target", keys, [value, epoch, ttl_ms], _accepted))

    def publish_call(
        self,
        keys: GateKeys,
        epoch: int,
        ttl_ms: int,
        target: int | None,
        cfg: Mapping[str, Any],
        util: Mapping[str, Any],
    ) -> ScriptCall[bool]:
        """The coordinator's epoch-fenced write of one gate (``publish.lua``): target None leaves
        the target's value alone; the reply False = refused (a newer epoch owns the gate)."""
        args: list[Any] = [epoch, ttl_ms, "" if target is None else target, len(cfg)]
        for pairs in (cfg, util):
            for k, v in pairs.items():
                args += [k, v]
        return self._call("publish", keys, args, _accepted)

    async def publish(
        self,
        keys: GateKeys,
        epoch: int,
        ttl_ms: int,
        target: int | None,
        cfg: Mapping[str, Any],
        util: Mapping[str, Any],
    ) -> bool:
        """:meth:`publish_call`, alone."""
        return await self._run(self.publish_call(keys, epoch, ttl_ms, target, cfg, util))

    def prune_call(self, keys: GateKeys, epoch: int, idle_after_ms: int) -> ScriptCall[int]:
        """``prune.lua``: the reply is PRUNED, IDLE, IN_USE or PRUNE_REFUSED."""
        return self._call("prune", keys, [epoch, idle_after_ms], _first)

    async def adopt(
        self, keys: GateKeys, lease_ids: list[str], max_token: int = 0, fence_ms: int = 0
    ) -> tuple[int, int]:
        """Count ``lease_ids`` (running work) as leases again after an outage; raise the gate's
        token counter above ``max_token``; ``fence_ms`` as for :meth:`acquire_many`. Returns
        (ids added, server-ms expiry)."""
        args: list[Any] = [fence_ms, max_token, *lease_ids]
        return await self._run(self._call("adopt", keys, args, _pair))

    async def snapshot(
        self, keys: GateKeys, listed: int = 10, defaults: GateSettings | None = None
    ) -> Snapshot:
        """A consistent snapshot of a gate (``inspect.lua``) listing its first ``listed``
        waiters and holders (``<= 0``: none; at most 1000): the counts are exact, and the cost
        never grows with the queue. ``defaults``: what an acquire would register for a gate
        without configuration."""
        args: list[Any] = [listed, *(defaults.argv() if defaults else [])]
        return await self._run(self._call("inspect", keys, args, _snapshot))


class LeaderScripts:
    """The coordinator's leadership-lease scripts (on the fleet keys, not a gate's)."""

    def __init__(self, client: Any) -> None:
        self._renew = client.register_script(script_source("leader_renew"))
        self._release = client.register_script(script_source("leader_release"))

    async def renew(self, leader_key: str, owner: str, ttl_ms: int) -> bool:
        """Extend the lease to ``ttl_ms`` if ``owner`` holds it; False if it does not."""
        return bool(await self._renew(keys=[leader_key], args=[owner, ttl_ms]))

    async def release(self, leader_key: str, owner: str) -> None:
        """Delete the lease if ``owner`` holds it."""
        await self._release(keys=[leader_key], args=[owner])


@functools.lru_cache(maxsize=4096)
def _encoded_argv(defaults: GateSettings) -> tuple[bytes, ...]:
    """A gate's default settings as script ARGV, encoded once (they go with every acquire)."""
    return tuple(str(v).encode() for v in defaults.argv())


def _check_batch(n: int, least: int = 1) -> None:
    if not least <= n <= MAX_BATCH:
        raise ValueError(f"a batch holds {least} to {MAX_BATCH} ids, not {n}")


def _heartbeat_units(req: HeartbeatRequest) -> int:
    """A gate's share of one heartbeat_many call (see HEARTBEAT_UNITS_PER_CALL)."""
    ids = len(req.leases) + len(req.waiters)
    return 1 if ids == 0 else 2 + ids // 4


def _identity(r: Any) -> Any:
    return r


def _first(r: Any) -> int:
    return int(r[0])


def _accepted(r: Any) -> bool:
    return int(r[0]) == 1


def _pair(r: Any) -> tuple[int, int]:
    return int(r[0]), int(r[1])


def _snapshot(raw: Any) -> Snapshot:
    return msgspec.convert(_empty_tables_as_lists(raw), Snapshot, strict=False)


def _s(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x
