"""The gate scripts' replies, typed: the status codes, the reply structs and their decoders.

Each reply is decoded here from what the script returns (its header in ``lua/`` states the
shape): :class:`AcquireReply`, :class:`HeartbeatReply`, :class:`Snapshot` (``inspect.lua``'s
JSON, with :class:`Waiter`, :class:`Holder`, :class:`Lane`, and the util hash it holds read by
:class:`~fleetgate.util_hash.UtilHash`), and the small decoders of the other scripts' replies.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from fleetgate.observed import TokenUsage
from fleetgate.protocol import AcquireStatus, PruneState, ResizeStatus
from fleetgate.util_hash import UtilHash

# The statuses, named in fleetgate.protocol (and in Lua from there: lua/lib_proto.lua ST).
GRANTED, PARKED, REJECTED = AcquireStatus.GRANTED, AcquireStatus.PARKED, AcquireStatus.REJECTED
# acquire.lua's other refusals: the tenant's queue bound, a sheddable band that could not be
# granted at once, a weight above the ceiling, tokens above the token ceiling (never grantable),
# an expected start past the deadline (deadline-aware admission), a weight above the band's share
# of the ceiling (headroom between bands: never grantable).
REJECTED_TENANT, SHED = AcquireStatus.REJECTED_TENANT, AcquireStatus.SHED
TOO_HEAVY, TOO_MANY_TOKENS = AcquireStatus.TOO_HEAVY, AcquireStatus.TOO_MANY_TOKENS
TOO_LATE, OVER_SHARE = AcquireStatus.TOO_LATE, AcquireStatus.OVER_SHARE
# resize.lua's status: resized, growth refused (does not fit now), no such lease, tokens above
# the token ceiling.
RESIZED, RESIZE_REFUSED = ResizeStatus.RESIZED, ResizeStatus.RESIZE_REFUSED
RESIZE_LOST, RESIZE_TOO_MANY = ResizeStatus.RESIZE_LOST, ResizeStatus.RESIZE_TOO_MANY
# prune.lua's state
PRUNED, IDLE, IN_USE, PRUNE_REFUSED = (
    PruneState.PRUNED,
    PruneState.IDLE,
    PruneState.IN_USE,
    PruneState.PRUNE_REFUSED,
)


class AcquireReply(msgspec.Struct, frozen=True, kw_only=True):
    """``acquire.lua``'s reply to one request, each field with one meaning. The fields of the
    other outcomes are 0 (-1 for the estimates)."""

    status: AcquireStatus
    limit: int
    fencing_token: int = 0  # granted: monotonic per gate in grant order
    holders: int = 0  # granted: units held counting this one
    seq: int = 0  # parked: the waiter's place in its lane (its member's seq20)
    position: int = 0  # parked: waiters counting this one
    #: refused: the bound that refused it (max_queued, max_queued_per_tenant, shed_below, the
    #: ceiling, the token ceiling or the band's share of the ceiling); 0 for TOO_LATE
    bound: int = 0
    #: REJECTED (the list is full): ms after which a place is expected to free for it (0: no
    #: estimate)
    retry_after_ms: int = 0
    #: parked: the wait (ms) the gate expects by its bands' service rates; TOO_LATE: the expected
    #: wait that refused it; -1: none
    expected_wait_ms: int = -1
    #: TOO_LATE with deadline_admission "finish": the band's expected hold (ms) the deadline had
    #: to cover too; -1: none
    expected_hold_ms: int = -1
    lease_ms: int  # the TTLs in force (the caller paces its first renewal by them)
    waiter_ms: int
    expires_at: int = 0  # server ms: when the lease (or the parked entry) expires
    #: ms the gate's recovery fence still holds every grant (0: none; ``lua/lib_fence.lua``
    #: gate_birth): a caller parked behind it asks for its hand-off when it ends
    fence_ms: int = 0

    # Deprecated (0.2.x, removed in 0.4): the wire's overloaded slots, by their old names.
    @property
    def token(self) -> int:
        """Deprecated: ``fencing_token`` (granted), ``seq`` (parked) or ``retry_after_ms``."""
        return self.fencing_token or self.seq or self.retry_after_ms

    @property
    def max_queued(self) -> int:
        """Deprecated: ``bound`` (refused), or ``expected_wait_ms`` for TOO_LATE."""
        return self.expected_wait_ms if self.status == TOO_LATE else self.bound

    @property
    def estimate_ms(self) -> int:
        """Deprecated: ``expected_wait_ms`` (parked) or ``expected_hold_ms`` (TOO_LATE)."""
        return self.expected_hold_ms if self.status == TOO_LATE else self.expected_wait_ms

    @classmethod
    def decode(
        cls, row: Sequence[Any], limit: int, lease_ms: int, waiter_ms: int, fence_ms: int
    ) -> AcquireReply:
        """One request's five values (status, token, n, expires_at, estimate: acquire.lua's
        header) as the reply of its outcome; the call's shared values are given."""
        status, token, n, expires_at, estimate = (int(x) for x in row)
        st = AcquireStatus(status)
        common = {"limit": limit, "lease_ms": lease_ms, "waiter_ms": waiter_ms}
        common |= {"fence_ms": fence_ms, "expires_at": expires_at}
        if st == GRANTED:
            return cls(status=st, fencing_token=token, holders=n, **common)
        if st == PARKED:
            return cls(status=st, seq=token, position=n, expected_wait_ms=estimate, **common)
        if st == TOO_LATE:
            return cls(status=st, expected_wait_ms=n, expected_hold_ms=estimate, **common)
        return cls(status=st, bound=n, retry_after_ms=token if st == REJECTED else 0, **common)

    @classmethod
    def decode_many(cls, reply: Any) -> list[AcquireReply]:
        """acquire.lua's reply: {limit, lease_ms, waiter_ms, released, fence_ms, then per
        request: status, token, n, expires_at, estimate}."""
        shared = (int(reply[0]), int(reply[1]), int(reply[2]), int(reply[4]))
        return [cls.decode(reply[i : i + 5], *shared) for i in range(5, len(reply), 5)]


# HeartbeatReply's lists of ids (and of the values that go with them, in the same order)
_HEARTBEAT_LISTS = (
    "lost_leases",
    "granted_waiters",
    "lost_waiters",
    "adopted",
    "granted_tokens",
    "evicted",
    "too_heavy",
    "too_late",
    "too_late_ms",
    "too_late_hold_ms",
    "revoked",
)


@dataclass(frozen=True)
class HeartbeatReply:
    """``heartbeat.lua``'s reply for one gate (``heartbeat_many.lua`` returns one per gate)."""

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
    token_limit: int | None = None  # the token budget in force (None: none)
    tokens: int = 0  # tokens held
    #: waiters that left because by the drain they would now start after their deadline
    #: (DeadlineUnreachable), and their expected waits (ms), in order
    too_late: list[str] = field(default_factory=list)
    too_late_ms: list[int] = field(default_factory=list)
    #: the band's expected holds (ms) their deadlines had to cover too (deadline_admission
    #: "finish"; else -1), in order
    too_late_hold_ms: list[int] = field(default_factory=list)
    #: the pod's leases the gate marked revoked (a higher band waited past revoke_after)
    revoked: list[str] = field(default_factory=list)

    @classmethod
    def merge(cls, parts: Sequence[HeartbeatReply]) -> HeartbeatReply:
        """The replies of one gate's heartbeat sent in parts (``HeartbeatRequest.parts``), in
        order, as one: the ids of each list in order, the gate's state as the last part saw
        it, ``pod_new`` if any part created the pod's entry, and the earliest expiry (the
        first part's leases were renewed first)."""
        if len(parts) == 1:
            return parts[0]
        merged: dict[str, Any] = {
            f.name: getattr(parts[-1], f.name) for f in dataclasses.fields(cls)
        }
        for name in _HEARTBEAT_LISTS:
            merged[name] = [x for part in parts for x in getattr(part, name)]
        merged["expires_at"] = min(part.expires_at for part in parts)
        merged["pod_new"] = any(part.pod_new for part in parts)
        return cls(**merged)

    @classmethod
    def decode(cls, r: Any) -> HeartbeatReply:
        """The reply as the script returns it (a list in field order)."""
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
            token_limit=None if int(r[16]) < 0 else int(r[16]),
            tokens=int(r[17]),
            too_late=[_s(x) for x in r[18]] if len(r) > 18 else [],
            too_late_ms=[int(x) for x in r[19]] if len(r) > 19 else [],
            too_late_hold_ms=[int(x) for x in r[20]] if len(r) > 20 else [],
            revoked=[_s(x) for x in r[21]] if len(r) > 21 else [],
        )


class ResizeReply(msgspec.Struct, frozen=True):
    """``resize.lua``'s reply: ``status`` (RESIZED, RESIZE_REFUSED, RESIZE_LOST or
    RESIZE_TOO_MANY), the lease's ``id`` from now on, and ``tokens`` (held; for
    RESIZE_TOO_MANY the token ceiling)."""

    status: int
    id: str
    tokens: int

    @classmethod
    def decode(cls, r: Any) -> ResizeReply:
        """The reply as the script returns it."""
        return cls(int(r[0]), _s(r[1]), int(r[2]))


class Waiter(msgspec.Struct):
    """A parked caller as ``inspect.lua`` lists it (token = its seq in its lane)."""

    id: str
    token: int
    expires_at: int | None = None
    weight: int = 1
    tokens: int = 0
    priority: int = 0
    tenant: str = ""


class Holder(msgspec.Struct):
    """A lease as ``inspect.lua`` lists it (its weight is in its id)."""

    id: str
    expires_at: int
    weight: int = 1
    tokens: int = 0


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
    #: the token budget in force and the most one call may ask (None: no token budget)
    token_limit: int | None = None
    token_ceiling: int | None = None
    #: the budget in force is the coordinator's tuned token target (live), not the configured
    #: ``token_limit``
    token_tuned: bool = False
    #: tokens held, counted as ``units``
    tokens: int = 0
    #: whether a call that would start after its deadline is refused at once
    deadline_admission: bool = True
    #: whether the deadline must cover the band's mean hold too (deadline_admission "finish")
    deadline_finish: bool = False
    #: revocation: ms a higher band's head may wait before lower bands give back (0: never)
    revoke_after_ms: int = 0
    #: the band shares in force: priority -> thousandths of the limit that band and the ones
    #: below it may hold (empty: strict bands only; ``fleetgate.bands``)
    band_share: dict[int, int] = {}
    #: units held per priority (every band that holds some)
    band_units: dict[int, int] = {}
    schema: int = 0
    max_queued_per_tenant: int = 0
    shed_below: int = 0
    tenant_weights: dict[str, str] = {}
    lanes: list[Lane] = []
    cfg: dict[str, str] = {}
    target: dict[str, str] = {}
    stats: dict[str, str] = {}
    util: dict[str, str] = {}
    #: the client-observed counters (``fleetgate.observed``), token usage included
    obs: dict[str, str] = {}
    head: list[Waiter] = []
    leases: list[Holder] = []
    #: from :meth:`Gate.snapshot <fleetgate.client.Gate.snapshot>` only: the settings that
    #: process gave which Redis holds otherwise, name -> (stored, asked); the stored ones apply
    differing: dict[str, tuple[str, str]] = {}

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

    @property
    def token_usage(self) -> dict[str, TokenUsage]:
        """Per tenant ('' = the default tenant): the tokens the calls that reported their use
        held and used (:class:`~fleetgate.observed.TokenUsage`)."""
        return TokenUsage.parse(self.obs)

    def utilization(self) -> UtilHash:
        """The coordinator's last utilisation snapshot of the gate, parsed (the one codec of
        the util hash: :class:`~fleetgate.util_hash.UtilHash`)."""
        return UtilHash.decode(self.util)


def _int(v: str | None) -> int | None:
    if v is None or v == "":
        return None
    try:
        return int(float(v))
    except (ValueError, OverflowError):
        return None


def _snapshot_containers() -> tuple[frozenset[str], frozenset[str]]:
    """The fields of :class:`Snapshot` that hold a list, and those that hold a dict, read off
    its type hints (so a field added later is normalised too)."""
    lists, maps = set(), set()
    for name, hint in typing.get_type_hints(Snapshot).items():
        origin = typing.get_origin(hint)
        if origin is list:
            lists.add(name)
        elif origin is dict:
            maps.add(name)
    return frozenset(lists), frozenset(maps)


_LIST_FIELDS, _MAP_FIELDS = _snapshot_containers()


def _empty_tables_as_lists(raw: bytes | str) -> Any:
    # Redis' cjson encodes an empty Lua table as {}, fakeredis' Lua as []: an empty one of
    # either kind is made what the field holds.
    obj = msgspec.json.decode(raw)
    for k, v in obj.items():
        if v == {} and k in _LIST_FIELDS:
            obj[k] = []
        elif v == [] and k in _MAP_FIELDS:
            obj[k] = {}
    return obj


def as_is(r: Any) -> Any:
    """The raw reply (decoded later, or by the caller)."""
    return r


def first_int(r: Any) -> int:
    """The reply's first value, an integer (cancel, prune)."""
    return int(r[0])


def accepted(r: Any) -> bool:
    """Whether the fenced write was accepted (set_target, publish: 1)."""
    return int(r[0]) == 1


class AdoptReply(msgspec.Struct, frozen=True):
    """``adopt.lua``'s reply: ``added`` (ids counted again or anew), ``expires_at`` (the
    server-ms expiry of every id adopted) and ``lapsed`` (fleet lease ids not counted again:
    their renewal time passed and Redis no longer held them, so their units may have gone to
    another pod; their holders are told)."""

    added: int
    expires_at: int
    lapsed: list[str]

    @classmethod
    def decode(cls, r: Any) -> AdoptReply:
        """The reply as the script returns it."""
        return cls(int(r[0]), int(r[1]), [_s(x) for x in r[2]])


def decode_snapshot(raw: Any) -> Snapshot:
    """inspect.lua's JSON as a :class:`Snapshot`."""
    return msgspec.convert(_empty_tables_as_lists(raw), Snapshot, strict=False)


def _s(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x
