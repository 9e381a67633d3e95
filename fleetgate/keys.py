"""The Redis key layout, named once.

Every key of one gate carries the gate's hash tag ``{G}`` so the whole gate lives in one Redis
Cluster slot and every script touches a single slot. A grouped gate name ``{group}rest`` (opt-in,
:func:`gate_group`) has the keys ``{prefix}:{group}rest:cfg`` and so on: the gates of one group
share the group's slot. The registry of gates and the leadership
keys are outside any gate's slot and are written by separate commands.

    {prefix}:{G}:cfg       hash    floor, ceiling, max_queued, lease_ms, waiter_ms,
                                   max_queued_per_tenant, shed_below, token_limit,
                                   token_ceiling, schema; fence
                                   (server ms: the recovery fence's end, lua/lib_fence.lua)
    {prefix}:{G}:target    hash    value, epoch, expires_at (server ms)
    {prefix}:{G}:holders   zset    lease id  -> lease expiry (server ms); a lease of weight
                                   W > 1 is '<pod>:<n>w<W>', one holding T tokens ends 't<T>'
    {prefix}:{G}:queue     string  a fence against fleetgate 0.1 (schema 1 kept its FIFO here)
    {prefix}:{G}:lanes     zset    every waiter '<tenant>}<R>}<seq20>}<id>', scores 0: FIFO
                                   per (band, tenant) lane by bytes (docs/admission.md)
    {prefix}:{G}:waiters   zset    waiter member -> waiter expiry (server ms)
    {prefix}:{G}:fair      zset    eligible lanes in service order '<R>}<F20>}<tenant>'
    {prefix}:{G}:big       zset    lane -> head weight, for heads heavier than the limit
    {prefix}:{G}:adm       hash    extra units, tokens held (tok), virtual times, lane tags,
                                   reservations, each band's drain (dr:<R>)
    {prefix}:{G}:tw        hash    tenant -> weight
    {prefix}:{G}:evicted   zset    waiter id -> until (evicted by a higher band; '<id>=c'
                                   refused by a ceiling; '<id>=r' a lease id resized away)
    {prefix}:{G}:seq       string  counter for lane order and fencing tokens (never below
                                   server ms x 1000)
    {prefix}:{G}:stats     hash    granted, rejected, expired_leases, abandoned_waiters, ...
    {prefix}:{G}:pods      zset    pod id -> liveness expiry (for the fair-share fallback)
    {prefix}:{G}:util      hash    the coordinator's last utilisation snapshot
    {prefix}:{G}:obs       hash    client-observed counters, written by the release path:
                                   ok, overloaded, timeout, error (outcomes reported),
                                   lat_n, lat_us (count and sum in µs of ok latencies),
                                   b<i> (ok calls in latency bucket i; fleetgate.observed),
                                   tn/ta/tu:<tenant> (token reports, tokens asked, used)
    {prefix}:{G}:wake:<pod> list   ids granted by hand-off, popped by the owner pod (also a
                                   shard channel: pods on Cluster subscribe, scripts SPUBLISH)
    {prefix}:{G}:rearm:<pod> list  a token the pod pushes to re-arm its blocking pop over
                                   several wake lists when it adds one (short TTL)
    {prefix}:gates         set     registry of gate names
    {prefix}:leader        string  coordinator leadership lease
    {prefix}:epoch         string  coordinator epoch counter
    {prefix}:born          string  server ms this Redis first held gate state under the prefix
                                   (standalone; the recovery fence); 0: stamped new by
                                   ``fleetgate init`` (fleetgate.stamp)
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from fleetgate.errors import ConfigError

__all__ = [
    "MAX_GATE_NAME_BYTES",
    "GateKeys",
    "fleet_keys",
    "gate_group",
    "name_problem",
    "validate_gate_name",
    "validate_name",
    "validate_prefix",
]

MAX_GATE_NAME_BYTES = 200
# Braces would break the hash tag; control characters make keys unreadable in redis-cli.
_FORBIDDEN = re.compile(r"[{}\x00-\x1f\x7f-\x9f\u2028\u2029]")


def name_problem(name: object, what: str) -> str | None:
    """Why ``name`` cannot be used as a ``what`` (``"gate name"``, ``"tenant"``), as one sentence
    starting with ``what``; None if it can.

    The rules of a gate name, shared by every name that ends up inside a gate's keys or script
    arguments: a non-empty string of at most :data:`MAX_GATE_NAME_BYTES` UTF-8 bytes without
    braces (they would break the hash tag; the scripts also use ``}`` as a field separator) or
    control characters.
    """
    if not isinstance(name, str):
        return f"{what} must be a string, got {type(name).__name__}"
    if not name:
        return f"{what} must not be empty"
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        return f"{what} {name!r} is not valid Unicode text"
    if size > MAX_GATE_NAME_BYTES:
        return f"{what} {name[:40]!r}... is longer than {MAX_GATE_NAME_BYTES} bytes"
    bad = _FORBIDDEN.search(name)
    if bad:
        return (
            f"{what} {name!r} contains {bad.group()!r}: braces and control characters "
            "are not allowed (they would break the Redis hash tag or the key layout)"
        )
    return None


# A grouped gate name: "{group}rest" (the one place braces are allowed in a gate name).
_GROUPED = re.compile(r"\{([^{}]*)\}(.*)", re.DOTALL)


def gate_group(name: str) -> str | None:
    """The group of a grouped gate name ``{group}rest``, or None for a plain name.

    Opt-in naming rule: every gate of one group shares the group's hash tag,
    so on Redis Cluster they share one slot and a pod renews all of them in few
    ``heartbeat_many`` calls (and pops their wake lists together) -- at the price of one node
    serving every gate of the group (a hot slot: docs/pod-cost.md). A plain name is its own
    hash tag, as before."""
    m = _GROUPED.fullmatch(name)
    return m.group(1) if m else None


def _grouped_name_problem(name: str) -> str | None:
    m = _GROUPED.fullmatch(name)
    if m is None:
        return (
            f"gate name {name!r}: a name starting with '{{' must be a grouped name "
            "'{group}name' (braces nowhere else)"
        )
    problem = name_problem(m.group(1), "gate group") or name_problem(m.group(2), "gate name")
    if problem is None and len(name.encode("utf-8")) > MAX_GATE_NAME_BYTES:
        return f"gate name {name[:40]!r}... is longer than {MAX_GATE_NAME_BYTES} bytes"
    return problem


def validate_gate_name(name: object) -> str:
    """Return ``name`` if it is a usable gate name, else raise :class:`ConfigError` saying why.

    A plain name (:func:`name_problem`), or a grouped one, ``{group}rest``, whose group and
    rest are each plain (:func:`gate_group`)."""
    if isinstance(name, str) and name.startswith("{"):
        problem = _grouped_name_problem(name)
    else:
        problem = name_problem(name, "gate name")
    if problem:
        raise ConfigError(problem)
    assert isinstance(name, str)
    return name


def validate_name(name: object, what: str) -> str:
    """Return ``name`` if it is a plain name (:func:`name_problem`: no braces at all), else raise
    :class:`ConfigError` naming ``what``."""
    problem = name_problem(name, what)
    if problem:
        raise ConfigError(problem)
    assert isinstance(name, str)
    return name


def validate_prefix(prefix: object) -> str:
    """Return ``prefix`` if usable as the key prefix, else raise :class:`ConfigError`."""
    if not isinstance(prefix, str) or not prefix:
        raise ConfigError("prefix must be a non-empty string")
    if _FORBIDDEN.search(prefix) or ":" in prefix or len(prefix) > 64:
        raise ConfigError(
            f"prefix {prefix!r} must be at most 64 bytes without ':', braces or control characters"
        )
    return prefix


@dataclass(frozen=True)
class GateKeys:
    """All key names of one gate."""

    prefix: str
    name: str

    @functools.cached_property
    def base(self) -> str:
        """``<prefix>:{<gate>}``: every key of the gate is this plus a suffix; the scripts get
        only this name (``KEYS[1]``) and derive the rest (see ``lua/lib_gate.lua``). A grouped
        name ``{group}rest`` (:func:`gate_group`) gives ``<prefix>:{group}rest``: the group is
        the hash tag."""
        if self.name.startswith("{"):
            return f"{self.prefix}:{self.name}"
        return f"{self.prefix}:{{{self.name}}}"

    @property
    def cfg(self) -> str:
        return f"{self.base}:cfg"

    @property
    def target(self) -> str:
        return f"{self.base}:target"

    @property
    def holders(self) -> str:
        return f"{self.base}:holders"

    @property
    def queue(self) -> str:
        """Schema 1's FIFO; since schema 2 a string that fences out older clients."""
        return f"{self.base}:queue"

    @property
    def lanes(self) -> str:
        """Every waiter, ``<tenant>}<R>}<seq20>}<id>`` (scores 0: ordered by bytes)."""
        return f"{self.base}:lanes"

    @property
    def fair(self) -> str:
        """Eligible lanes in service order, ``<R>}<F20>}<tenant>``."""
        return f"{self.base}:fair"

    @property
    def big(self) -> str:
        """Lanes whose head weighs more than the limit -> that weight."""
        return f"{self.base}:big"

    @property
    def adm(self) -> str:
        """Admission state: extra units, virtual times, lane tags, reservations."""
        return f"{self.base}:adm"

    @property
    def tenant_weights(self) -> str:
        return f"{self.base}:tw"

    @property
    def evicted(self) -> str:
        """Waiters evicted by a higher band, remembered for a while (-> until)."""
        return f"{self.base}:evicted"

    @property
    def waiters(self) -> str:
        return f"{self.base}:waiters"

    @property
    def seq(self) -> str:
        return f"{self.base}:seq"

    @property
    def stats(self) -> str:
        return f"{self.base}:stats"

    @property
    def pods(self) -> str:
        return f"{self.base}:pods"

    @property
    def util(self) -> str:
        return f"{self.base}:util"

    @property
    def obs(self) -> str:
        """Client-observed outcome and latency counters (:mod:`fleetgate.observed`)."""
        return f"{self.base}:obs"

    @property
    def wake_prefix(self) -> str:
        """Prefix of the per-pod wake lists; the scripts append the pod id."""
        return f"{self.base}:wake:"

    def wake(self, pod_id: str) -> str:
        return f"{self.wake_prefix}{pod_id}"

    def rearm(self, pod_id: str) -> str:
        """The pod's re-arm list in this gate's slot (see client/_wakes.py)."""
        return f"{self.base}:rearm:{pod_id}"

    @functools.cached_property
    def _script_keys(self) -> list[str]:
        return [self.base]

    @functools.cached_property
    def _declared_keys(self) -> list[str]:
        return [self.base, *self.data_keys()]

    def script_keys(self) -> list[str]:
        """KEYS of a gate script call: the base name alone (``lua/lib_gate.lua`` derives every key
        from it, with the suffixes of the properties above)."""
        return self._script_keys

    def declared_keys(self) -> list[str]:
        """:meth:`script_keys` plus every data key, declared for Redis Cluster's sake (see
        :meth:`fleetgate._redis.RedisMode.script_keys`); the scripts read only the first."""
        return self._declared_keys

    def data_keys(self) -> list[str]:
        """Every key of the gate's state (not the per-pod wake and re-arm lists)."""
        return [key for key, _ in self.expected_types()]

    def expected_types(self) -> list[tuple[str, str]]:
        """Each key of the gate with the Redis type its scripts expect (for diagnostics)."""
        return [
            (self.cfg, "hash"),
            (self.target, "hash"),
            (self.holders, "zset"),
            (self.queue, "string"),
            (self.waiters, "zset"),
            (self.lanes, "zset"),
            (self.fair, "zset"),
            (self.big, "zset"),
            (self.adm, "hash"),
            (self.tenant_weights, "hash"),
            (self.evicted, "zset"),
            (self.seq, "string"),
            (self.stats, "hash"),
            (self.pods, "zset"),
            (self.util, "hash"),
            (self.obs, "hash"),
        ]

    @classmethod
    def of(cls, prefix: str, name: str) -> GateKeys:
        return cls(validate_prefix(prefix), validate_gate_name(name))


@dataclass(frozen=True)
class FleetKeys:
    """Keys outside any gate's slot."""

    prefix: str

    @property
    def gates(self) -> str:
        return f"{self.prefix}:gates"

    @property
    def leader(self) -> str:
        return f"{self.prefix}:leader"

    @property
    def epoch(self) -> str:
        return f"{self.prefix}:epoch"

    @property
    def born(self) -> str:
        """Server time (ms) this Redis first held gate state under the prefix; ``0`` for state
        older than the mark, or a prefix stamped new by ``fleetgate init`` (:mod:`fleetgate.stamp`)
        (the recovery fence: ``lua/lib_fence.lua`` gate_birth). Standalone and Sentinel only."""
        return f"{self.prefix}:born"


def fleet_keys(prefix: str) -> FleetKeys:
    """Keys of the fleet (registry and leadership) under ``prefix``."""
    return FleetKeys(validate_prefix(prefix))
