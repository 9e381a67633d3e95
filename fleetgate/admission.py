"""Arguments of the admission order -- a permit's weight, priority and tenant, a gate's
``tenant_weights`` -- checked, and encoded the way the Lua scripts read them.

Pure functions, no I/O. The rules are those of docs/admission.md: a weight is an int >= 1
(never above the gate's ceiling), a priority an int in [:data:`MIN_PRIORITY`,
:data:`MAX_PRIORITY`] (higher first), a tenant a name under the gate-name rules or None (the
default tenant). Every error is a :class:`~fleetgate.errors.ConfigError` naming the argument.
A permit's arguments travel as one :class:`fleetgate.ask.Ask`, checked by these functions when
it is made and encoded by the ones below.

Wire encodings (``}`` separates fields: names follow the gate-name rules, which forbid braces, so
every encoded string parses unambiguously and reads well in ``redis-cli``):

==========================  ===================================================================
lane class (per request)    ``''`` for (priority 0, default tenant), else ``RRR}tenant``
waiter member               ``tenant}RRR}seq20}lease_id``
tenant weights              ``name}w}name}w`` sorted by name; ``''`` when there are none
lease id                    ``<pod>:<n>[b<RRR>][w<W>][t<T>]``: band (priority other than 0),
                            weight (above 1), tokens (above 0)
==========================  ===================================================================

``RRR`` = 100 - priority as three digits (``000``..``200``): it inverts the priority, so in
lexical order a smaller ``RRR`` -- a higher priority -- comes first. The default tenant is the
empty string; ``seq20`` is the arrival sequence, zero-padded to 20 digits.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Final, TypeVar

from fleetgate.errors import ConfigError
from fleetgate.keys import name_problem

__all__ = [
    "MAX_PRIORITY",
    "MAX_TENANTS",
    "MAX_TENANT_WEIGHT",
    "MAX_TOKENS",
    "MIN_PRIORITY",
    "SEP",
    "FrozenMap",
    "TenantWeights",
    "class_member",
    "decode_tenant_weights",
    "encode_tenant_weights",
    "lane_class",
    "member_id",
    "parse_lane_class",
    "parse_waiter_member",
    "resized_id",
    "tokens_of",
    "validate_priority",
    "validate_tenant",
    "validate_tenant_weights",
    "validate_tokens",
    "validate_weight",
    "waiter_member",
    "weight_of",
    "weighted_id",
]

MIN_PRIORITY: Final = -100
MAX_PRIORITY: Final = 100
#: largest entry of ``tenant_weights`` (a tenant's share relative to weight-1 tenants)
MAX_TENANT_WEIGHT: Final = 1000
#: most entries of one gate's ``tenant_weights``: the scripts read the whole table per call
MAX_TENANTS: Final = 10_000

SEP: Final = "}"
K = TypeVar("K")
V = TypeVar("V")
# A lease id ends in ':<n>', then 'b<RRR>' for a priority other than 0, 'w<W>' for a weight above
# 1, 't<T>' for tokens (ASCII digits only: str.isdigit() also accepts '²').
_WEIGHTED = re.compile(r":[0-9]+(?:b[0-9]{3})?w([0-9]+)(?:t[0-9]+)?\Z")
_TOKENED = re.compile(r":[0-9]+(?:b[0-9]{3})?(?:w[0-9]+)?t([0-9]+)\Z")
#: most tokens one call may hold (the scripts count in doubles; a typo, not a plan, beyond it)
MAX_TOKENS: Final = 10**12


# ------------------------------------------------------------------------------ validation


def validate_weight(weight: object, *, ceiling: int | None = None) -> int:
    """Return ``weight`` if it is an int >= 1 (not a bool) and, with ``ceiling``, at most the
    gate's ceiling: a heavier permit could never be granted, so it fails at once instead of
    waiting out its deadline."""
    if isinstance(weight, bool) or not isinstance(weight, int) or weight < 1:
        raise ConfigError(f"weight: expected int >= 1, got {weight!r}")
    if ceiling is not None and weight > ceiling:
        raise ConfigError(
            f"weight: {weight} is above the gate's ceiling ({ceiling}): "
            "it can never be granted on this gate"
        )
    return weight


def validate_tokens(tokens: object, *, ceiling: int | None = None) -> int:
    """Return ``tokens`` if it is an int >= 0 (not a bool; 0 holds none of a token budget) and,
    with ``ceiling`` (the gate's ``token_ceiling``), at most that: more could never be granted,
    so it fails at once instead of waiting out its deadline."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 0 <= tokens <= MAX_TOKENS:
        raise ConfigError(f"tokens: expected int in [0, {MAX_TOKENS}], got {tokens!r}")
    if ceiling is not None and tokens > ceiling:
        raise ConfigError(
            f"tokens: {tokens} is above the gate's token_ceiling ({ceiling}): "
            "it can never be granted on this gate"
        )
    return tokens


def validate_priority(priority: object) -> int:
    """Return ``priority`` if it is an int in [-100, 100] (not a bool); higher goes first."""
    if (
        isinstance(priority, bool)
        or not isinstance(priority, int)
        or not MIN_PRIORITY <= priority <= MAX_PRIORITY
    ):
        raise ConfigError(
            f"priority: expected int in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {priority!r}"
        )
    return priority


def _tenant_problem(tenant: object) -> str | None:
    if tenant == "":
        return "tenant must not be empty (None is the default tenant)"
    return name_problem(tenant, "tenant")


def validate_tenant(tenant: object) -> str | None:
    """Return ``tenant`` if it is None (the default tenant) or a usable tenant name: the rules
    of a gate name (:func:`fleetgate.keys.validate_gate_name`), not empty."""
    if tenant is None:
        return None
    problem = _tenant_problem(tenant)
    if problem:
        raise ConfigError(problem)
    assert isinstance(tenant, str)
    return tenant


def validate_tenant_weights(mapping: object) -> TenantWeights:
    """Return ``mapping`` (tenant name -> int in [1, 1000], at most 10,000 entries) as a
    :class:`TenantWeights`; the error names the entry, e.g.
    ``tenant_weights['a b{']: tenant 'a b{' contains '{': ...``."""
    if not isinstance(mapping, Mapping):
        raise ConfigError(
            f"tenant_weights: expected a mapping of tenant name -> int, got "
            f"{type(mapping).__name__}"
        )
    if len(mapping) > MAX_TENANTS:
        raise ConfigError(f"tenant_weights: at most {MAX_TENANTS} tenants, got {len(mapping)}")
    for name, weight in mapping.items():
        problem = _tenant_problem(name)
        if problem:
            raise ConfigError(f"tenant_weights[{name!r}]: {problem}")
        if (
            isinstance(weight, bool)
            or not isinstance(weight, int)
            or not 1 <= weight <= MAX_TENANT_WEIGHT
        ):
            raise ConfigError(
                f"tenant_weights[{name!r}]: expected int in [1, {MAX_TENANT_WEIGHT}], "
                f"got {weight!r}"
            )
    return mapping if isinstance(mapping, TenantWeights) else TenantWeights(mapping)


class FrozenMap(Mapping[K, V]):
    """An immutable, hashable mapping kept sorted by key, with its wire encoding (``encoded``,
    made by :meth:`encode`) computed once: a gate setting that goes with every script call that
    may register the gate's settings. Construction does not validate."""

    __slots__ = ("_hash", "_items", "_map", "encoded")

    def __init__(self, items: Mapping[K, V] | Iterable[tuple[K, V]] = ()) -> None:
        self._map: dict[K, V] = dict(sorted(dict(items).items()))
        self._items = tuple(self._map.items())
        # Hashed with the settings on every acquire (the scripts' encoded-ARGV cache): once.
        self._hash = hash(self._items)
        self.encoded: str = self.encode(self._items)

    @staticmethod
    def encode(items: tuple[tuple[K, V], ...]) -> str:
        """The wire encoding of the sorted ``items``."""
        raise NotImplementedError

    def __getitem__(self, key: K) -> V:
        return self._map[key]

    def __iter__(self) -> Iterator[K]:
        return iter(self._map)

    def __len__(self) -> int:
        return len(self._map)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if other is self:
            return True
        if isinstance(other, FrozenMap):
            return type(other) is type(self) and self._items == other._items
        if isinstance(other, Mapping):
            return self._map == dict(other.items())
        return NotImplemented

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._map!r})"


class TenantWeights(FrozenMap[str, int]):
    """A gate's ``tenant_weights``: tenant -> weight, sorted by name; ``encoded`` is
    ``name}w}name}w`` (see :func:`encode_tenant_weights`). Construction does not validate: see
    :func:`validate_tenant_weights`."""

    __slots__ = ()

    @staticmethod
    def encode(items: tuple[tuple[str, int], ...]) -> str:
        return SEP.join(f"{name}{SEP}{w}" for name, w in items)


# --------------------------------------------------------------------------------- encoding


def encode_tenant_weights(mapping: Mapping[str, int]) -> str:
    """``name}w}name}w`` sorted by name; ``''`` for an empty mapping."""
    if isinstance(mapping, TenantWeights):
        return mapping.encoded
    return SEP.join(f"{name}{SEP}{w}" for name, w in sorted(mapping.items()))


def decode_tenant_weights(text: str) -> dict[str, int]:
    """The inverse of :func:`encode_tenant_weights`."""
    if not text:
        return {}
    parts = text.split(SEP)
    if len(parts) % 2:
        raise ValueError(f"tenant weights {text[:60]!r}: expected name}}weight pairs")
    return {parts[i]: int(parts[i + 1]) for i in range(0, len(parts), 2)}


def _rank(priority: int) -> str:
    return f"{MAX_PRIORITY - priority:03d}"


def lane_class(priority: int, tenant: str | None) -> str:
    """A request's lane as the scripts take it: ``''`` for (0, default tenant), else
    ``RRR}tenant`` (``RRR`` = 100 - priority, three digits; default tenant = ``''``).
    Arguments are assumed valid (:func:`validate_priority`, :func:`validate_tenant`)."""
    if priority == 0 and tenant is None:
        return ""
    return f"{_rank(priority)}{SEP}{tenant or ''}"


def parse_lane_class(cls: str) -> tuple[int, str | None]:
    """The inverse of :func:`lane_class`: ``(priority, tenant)``."""
    if not cls:
        return 0, None
    rank, _, tenant = cls.partition(SEP)
    return MAX_PRIORITY - int(rank), tenant or None


def waiter_member(priority: int, tenant: str | None, seq: int, lease_id: str) -> str:
    """A parked waiter's member in the scripts' lex-ordered index:
    ``tenant}RRR}seq20}lease_id``, so one tenant's waiters sort by band (highest priority
    first), then by arrival."""
    return f"{tenant or ''}{SEP}{_rank(priority)}{SEP}{seq:020d}{SEP}{lease_id}"


def parse_waiter_member(member: str) -> tuple[int, str | None, int, str]:
    """The inverse of :func:`waiter_member`: ``(priority, tenant, seq, lease_id)``."""
    tenant, rank, seq, lease_id = member.split(SEP, 3)
    return MAX_PRIORITY - int(rank), tenant or None, int(seq), lease_id


def class_member(cls: str, seq: int, lease_id: str) -> str:
    """The waiter member of a call parked with lane class ``cls`` (:func:`lane_class`):
    :func:`waiter_member` of that class's priority and tenant."""
    return waiter_member(*parse_lane_class(cls), seq, lease_id)


def member_id(member: str) -> str:
    """The lease id of a waiter member (``tenant}RRR}seq20}lease_id``)."""
    return member.split(SEP, 3)[-1]


def weighted_id(base_id: str, weight: int, tokens: int = 0, priority: int = 0) -> str:
    """The lease id that carries ``priority``, ``weight`` and ``tokens``: ``base_id`` itself for
    priority 0, weight 1 and no tokens (the default path sends exactly today's ids), else
    ``base_id`` followed by ``b<RRR>`` (a priority other than 0: its band, which the band
    shares count by), ``w<weight>`` (weight above 1), ``t<tokens>`` (tokens above 0)."""
    lease_id = base_id if priority == 0 else f"{base_id}b{_rank(priority)}"
    lease_id = lease_id if weight == 1 else f"{lease_id}w{weight}"
    return lease_id if tokens == 0 else f"{lease_id}t{tokens}"


def resized_id(lease_id: str, tokens: int) -> str:
    """The id of ``lease_id`` resized to hold ``tokens`` (as ``lua/resize.lua`` makes it)."""
    match = _TOKENED.search(lease_id)
    base = lease_id[: match.start(1) - 1] if match else lease_id
    return base if tokens == 0 else f"{base}t{tokens}"


def tokens_of(lease_id: str) -> int:
    """The tokens a lease id holds: ``T`` of a trailing ``t<T>``, else 0."""
    match = _TOKENED.search(lease_id)
    return int(match.group(1)) if match else 0


def weight_of(lease_id: str) -> int:
    """The weight a lease id carries: ``W`` of a trailing ``:<n>w<W>``, else 1."""
    match = _WEIGHTED.search(lease_id)
    return int(match.group(1)) if match else 1
