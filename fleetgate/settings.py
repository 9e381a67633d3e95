"""A gate's settings -- floor, ceiling, max_queued, lease_ms, waiter_ms, the admission order's
max_queued_per_tenant, shed_below, tenant_weights, the token budget's token_limit and
token_ceiling, deadline_admission and band_share -- with their defaults and bounds, written
once.

:class:`GateSettings` is what the scripts are given (``argv()``),
what a client registers for a gate that has no configuration yet, and what the coordinator's
:class:`~fleetgate.coordinator.config.GateConfig` is made of (it reuses the annotated field types
below). ``lua/lib_cfg.lua`` (``load_cfg``) applies the same defaults and lower bounds to whatever it
finds in ``fg:{G}:cfg``; ``tests/core/test_settings.py`` runs the real script to prove they agree
for the int fields of :data:`FIELDS`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Annotated, Any, Final, TypedDict

import msgspec
from msgspec import Meta

from fleetgate.admission import (
    MAX_PRIORITY,
    MAX_TOKENS,
    MIN_PRIORITY,
    TenantWeights,
    validate_tenant_weights,
)
from fleetgate.bands import BandShare, validate_band_share
from fleetgate.deadlines import (
    DeadlineAdmission,
    RevokeAfter,
    admission_code,
    check_deadline_admission,
    check_revoke_after,
    revoke_ms,
)
from fleetgate.errors import ConfigError

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack is Python 3.11+

__all__ = [
    "ADMISSION_FIELDS",
    "BAND_FIELDS",
    "DEFAULT_CEILING",
    "FIELDS",
    "MAX_PERMITS",
    "MAX_QUEUED",
    "MAX_TTL_MS",
    "REVOKE_FIELDS",
    "TIME_FIELDS",
    "TOKEN_FIELDS",
    "Ceiling",
    "Floor",
    "GateSettings",
    "GateSettingsKwargs",
    "LeaseMs",
    "MaxQueued",
    "MaxQueuedPerTenant",
    "ShedBelow",
    "TokenCeiling",
    "TokenLimit",
    "WaiterMs",
    "bounds",
    "check_admission",
    "check_ceiling",
    "check_setting_names",
    "check_tokens",
    "settings_differing",
    "validate_gate_settings",
]

# Upper bounds: beyond them a value is a typo, not a plan -- a lease of days outlives any crash
# it is meant to recover from, and the scripts compute with doubles (exact below 2^53).
MAX_PERMITS: Final = 1_000_000
MAX_QUEUED: Final = 10_000_000
MAX_TTL_MS: Final = 86_400_000  # one day

# The ceiling of a gate that names none (never below its floor). The coordinator's
# MODEL_MAX_CONCURRENCY environment variable overrides it for the gates of its config.
DEFAULT_CEILING: Final = 512

Floor = Annotated[int, Meta(ge=1, le=MAX_PERMITS, description="the static limit")]
Ceiling = Annotated[int, Meta(ge=1, le=MAX_PERMITS, description="bound of the adaptive target")]
MaxQueued = Annotated[int, Meta(ge=0, le=MAX_QUEUED, description="bound of the wait list")]
LeaseMs = Annotated[int, Meta(ge=100, le=MAX_TTL_MS, description="lease TTL (ms)")]
WaiterMs = Annotated[int, Meta(ge=100, le=MAX_TTL_MS, description="parked entry TTL (ms)")]
MaxQueuedPerTenant = Annotated[
    int, Meta(ge=0, le=MAX_QUEUED, description="bound of one tenant's waiters (all bands)")
]
ShedBelow = Annotated[
    int,
    Meta(ge=MIN_PRIORITY, le=MAX_PRIORITY, description="priorities below it never park"),
]
TokenLimit = Annotated[
    int, Meta(ge=1, le=MAX_TOKENS, description="tokens held at once by every lease of the gate")
]
TokenCeiling = Annotated[
    int, Meta(ge=1, le=MAX_TOKENS, description="bound of the token budget and of one call's tokens")
]
# Why each lower bound exists (appended to the client's error message).
_WHY_LOW = {
    "floor": "a cap <= 0 would block every call",
    "ceiling": "a cap <= 0 would block every call",
    "max_queued": "a negative queue bound is meaningless",
    "lease_ms": "leases shorter than 100 ms cannot be renewed in time",
    "waiter_ms": "waiters shorter than 100 ms cannot be refreshed in time",
}


class GateSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One gate's settings, in the order the scripts take them (``argv()``).

    Constructing one does not check the bounds (msgspec checks ``Annotated`` constraints when
    decoding); :meth:`validated` does, naming the gate and the field. ``tenant_weights`` is
    always held as a :class:`~fleetgate.admission.TenantWeights` (a plain mapping given to the
    constructor is converted), so settings stay immutable and hashable.
    """

    floor: Floor = 1
    ceiling: Ceiling = DEFAULT_CEILING
    max_queued: MaxQueued = 1000
    lease_ms: LeaseMs = 10_000
    waiter_ms: WaiterMs = 5_000
    #: bound of one tenant's waiters over all bands; None = the same as ``max_queued``
    max_queued_per_tenant: MaxQueuedPerTenant | None = None
    #: priorities below it are sheddable: granted at once or ``Overloaded``, never parked
    shed_below: ShedBelow = 0
    #: tenant name -> share weight (1..1000; absent tenants weigh 1)
    tenant_weights: Mapping[str, int] = msgspec.field(default_factory=TenantWeights)
    #: the token budget: tokens all leases hold at once (None: no token budget)
    token_limit: TokenLimit | None = None
    #: the most tokens one call may ask and a target may set the budget to (None: token_limit)
    token_ceiling: TokenCeiling | None = None
    #: refuse at once a call whose expected start (from the gate's measured drain) is past its
    #: deadline (:class:`~fleetgate.errors.DeadlineUnreachable`), instead of parking it (True,
    #: or ``"start"``); ``"finish"``: the deadline must cover the band's mean hold too; False:
    #: every call that fits the queue bounds waits out its deadline
    deadline_admission: DeadlineAdmission = True
    #: headroom between bands: priority -> the fraction of the limit that band and every band
    #: below it may hold together (:mod:`fleetgate.bands`); empty: strict bands only
    band_share: Mapping[int, float] = msgspec.field(default_factory=BandShare)
    #: revocation: seconds the head of a higher band may wait before the gate asks leases of
    #: the bands below it back (``lease.revoked``); None: never
    revoke_after: RevokeAfter | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.tenant_weights, TenantWeights):
            msgspec.structs.force_setattr(
                self, "tenant_weights", TenantWeights(self.tenant_weights)
            )
        if not isinstance(self.band_share, BandShare):
            msgspec.structs.force_setattr(self, "band_share", BandShare(self.band_share))

    def argv(self) -> list[int | str]:
        """ARGV of the scripts that take a gate's settings, 13 values: floor, ceiling,
        max_queued, lease_ms, waiter_ms, max_queued_per_tenant, shed_below, token_limit,
        token_ceiling (each ``''`` when None), deadline_admission (0 off, 1 start, 2 finish),
        band_share, revoke_after (in ms, ``''`` when None) and
        tenant_weights (encoded: :class:`~fleetgate.bands.BandShare`,
        :func:`~fleetgate.admission.encode_tenant_weights`)."""
        return [
            self.floor,
            self.ceiling,
            self.max_queued,
            self.lease_ms,
            self.waiter_ms,
            _text(self.max_queued_per_tenant),
            self.shed_below,
            _text(self.token_limit),
            _text(self.token_ceiling),
            admission_code(self.deadline_admission),
            self._band_share.encoded,
            revoke_ms(self.revoke_after),
            self._tenant_weights.encoded,
        ]

    def as_cfg(self) -> dict[str, int | str]:
        """The fields a publish writes: the :data:`FIELDS` of ``fg:{G}:cfg``, then
        ``max_queued_per_tenant`` (``''`` when unset: publish.lua deletes the field, so a bound
        removed from the configuration is removed in Redis too), ``shed_below``,
        ``tenant_weights`` (encoded; the scripts keep it apart from ``cfg``), ``token_limit``
        and ``token_ceiling`` (``''`` when unset, likewise), ``deadline_admission`` (0, 1 or 2),
        ``band_share`` (encoded; ``''`` when empty, which deletes the field),
        ``revoke_after_ms`` (``''`` when None, likewise)."""
        cfg: dict[str, int | str] = {name: getattr(self, name) for name in FIELDS}
        cfg["max_queued_per_tenant"] = _text(self.max_queued_per_tenant)
        cfg["shed_below"] = self.shed_below
        cfg["tenant_weights"] = self._tenant_weights.encoded
        cfg["token_limit"] = _text(self.token_limit)
        cfg["token_ceiling"] = _text(self.token_ceiling)
        cfg["deadline_admission"] = admission_code(self.deadline_admission)
        cfg["band_share"] = self._band_share.encoded
        cfg["revoke_after_ms"] = revoke_ms(self.revoke_after)
        return cfg

    @property
    def _band_share(self) -> BandShare:
        bs = self.band_share
        assert isinstance(bs, BandShare)  # __post_init__
        return bs

    @property
    def _tenant_weights(self) -> TenantWeights:
        tw = self.tenant_weights
        assert isinstance(tw, TenantWeights)  # __post_init__
        return tw

    @classmethod
    def validated(cls, gate: str, **values: Any) -> GateSettings:
        """Settings from ``values`` (every field of :data:`FIELDS`; those of
        :data:`ADMISSION_FIELDS` may be left out for their defaults), checked: a
        :class:`ConfigError` names the gate and the field, e.g. ``gate 'x': floor: expected
        int >= 1, got 0 (...)`` or ``gate 'x': tenant_weights['a b{']: tenant ...``."""
        for name in FIELDS:
            problem = _field_problem(name, values.get(name))
            if problem:
                raise ConfigError(f"gate {gate!r}: {name}: {problem}")
        known = {
            *FIELDS,
            *ADMISSION_FIELDS,
            *TOKEN_FIELDS,
            *TIME_FIELDS,
            *BAND_FIELDS,
            *REVOKE_FIELDS,
        }
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"gate {gate!r}: {unknown[0]}: unknown setting")
        try:
            check_ceiling(values["floor"], values["ceiling"])
            check_admission(
                values.get("max_queued_per_tenant"),
                values.get("shed_below", 0),
                values.get("tenant_weights", {}),
            )
            check_tokens(values.get("token_limit"), values.get("token_ceiling"))
            check_deadline_admission(values.get("deadline_admission", True))
            values["band_share"] = validate_band_share(values.get("band_share", {}))
            check_revoke_after(values.get("revoke_after"))
        except ConfigError as exc:
            raise ConfigError(f"gate {gate!r}: {exc}") from None
        return cls(**values)

    @classmethod
    def for_gate(cls, gate: str, **given: Unpack[GateSettingsKwargs]) -> GateSettings:
        """A client's settings for ``gate``: a setting left out or None takes the default (the
        ceiling's is never below the floor; ``max_queued_per_tenant``'s is "same as
        max_queued"), then :meth:`validated`. A name that is no setting is a ``TypeError``, as
        for any unknown keyword."""
        check_setting_names(given, "GateSettings.for_gate")
        named: Mapping[str, object] = given
        d = cls()
        values = {
            name: getattr(d, name) if named.get(name) is None else named[name]
            for name in cls.__struct_fields__
        }
        if named.get("ceiling") is None:
            values["ceiling"] = _default_ceiling(values["floor"], d.ceiling)
        return cls.validated(gate, **values)


class GateSettingsKwargs(TypedDict, total=False):
    """:class:`GateSettings` as keyword arguments (``fleet.gate(name, floor=4, ...)``,
    :meth:`GateSettings.for_gate`): each field, None for its default. Kept to the fields of
    :class:`GateSettings` by an import-time check."""

    floor: int | None
    ceiling: int | None
    max_queued: int | None
    lease_ms: int | None
    waiter_ms: int | None
    max_queued_per_tenant: int | None
    shed_below: int | None
    tenant_weights: Mapping[str, int] | None
    token_limit: int | None
    token_ceiling: int | None
    deadline_admission: DeadlineAdmission | None
    band_share: Mapping[int, float] | None
    revoke_after: float | None


assert tuple(GateSettingsKwargs.__annotations__) == GateSettings.__struct_fields__


def settings_differing(
    asked: GateSettings,
    given: Iterable[str],
    cfg: Mapping[str, str],
    tenant_weights: Mapping[str, str],
) -> dict[str, tuple[str, str]]:
    """The settings a caller ``given`` explicitly that the gate's stored configuration (``cfg``
    and ``tenant_weights`` as Redis holds them) sets otherwise: name -> (stored, asked), as
    text (``unset`` for a field Redis does not hold). The stored ones are what applies: they
    came from the coordinator's config or the process that first used the gate, and a field
    they lack takes its default in every script, not the caller's value. Nothing differs while
    no setting is stored (lua/lib_cfg.lua load_cfg: the gate is not configured yet)."""
    if not any(name in cfg for name in GateSettings.__struct_fields__):
        return {}
    mine = asked.as_cfg()
    out: dict[str, tuple[str, str]] = {}
    for name in sorted(set(given)):
        if name == "tenant_weights":
            stored = ",".join(f"{t}={w}" for t, w in sorted(tenant_weights.items()))
            wanted = ",".join(f"{t}={w}" for t, w in sorted(asked.tenant_weights.items()))
        elif name in mine:
            stored, wanted = cfg.get(name, ""), str(mine[name])
        else:
            continue
        if stored != wanted:
            out[name] = (stored or "unset", wanted or "unset")
    return out


def check_setting_names(names: Iterable[str], caller: str) -> None:
    """Raise ``TypeError("<caller>() got an unexpected keyword argument 'x'")`` for the first
    of ``names`` that is no field of :class:`GateSettings`."""
    for name in names:
        if name not in GateSettings.__struct_fields__:
            raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}")


#: The int fields every script reads from ``fg:{G}:cfg`` since the first schema (``lua/lib_cfg.lua``
#: ``load_cfg``), each with a lower and an upper bound (:func:`bounds`), in ``argv()`` order.
FIELDS: Final = GateSettings.__struct_fields__[:5]
#: The admission order's settings (docs/admission.md), after :data:`FIELDS`.
ADMISSION_FIELDS: Final = GateSettings.__struct_fields__[5:8]
#: The token budget's settings (docs/admission.md "Token budgets").
TOKEN_FIELDS: Final = GateSettings.__struct_fields__[8:10]
#: Admission that knows time (docs/admission.md "Deadline-aware admission").
TIME_FIELDS: Final = GateSettings.__struct_fields__[10:11]
#: Headroom between bands (docs/admission.md "Headroom between bands").
BAND_FIELDS: Final = GateSettings.__struct_fields__[11:12]
#: Revocation (docs/admission.md "Revocation"), last.
REVOKE_FIELDS: Final = GateSettings.__struct_fields__[12:]
assert FIELDS == ("floor", "ceiling", "max_queued", "lease_ms", "waiter_ms")
assert ADMISSION_FIELDS == ("max_queued_per_tenant", "shed_below", "tenant_weights")
assert TOKEN_FIELDS == ("token_limit", "token_ceiling")
assert TIME_FIELDS == ("deadline_admission",)
assert BAND_FIELDS == ("band_share",)
assert REVOKE_FIELDS == ("revoke_after",)


def _text(value: int | None) -> int | str:
    """An optional setting as the scripts take it: ``''`` for None."""
    return "" if value is None else value


def _default_ceiling(floor: object, default: int) -> object:
    # A bad floor is reported as the floor's problem, not turned into a TypeError here.
    if isinstance(floor, int) and not isinstance(floor, bool):
        return max(floor, default)
    return default


def _int_bounds() -> dict[str, tuple[int, int]]:
    """``{field: (lowest, highest)}`` of every int field of :class:`GateSettings` (None allowed
    or not), read from its annotation: the one declaration of the bounds, which msgspec checks
    when it decodes settings and :meth:`GateSettings.validated` when it is given them."""
    info = msgspec.inspect.type_info(GateSettings)
    assert isinstance(info, msgspec.inspect.StructType)
    out: dict[str, tuple[int, int]] = {}
    for f in info.fields:
        t = f.type
        if isinstance(t, msgspec.inspect.UnionType):  # ``X | None``
            t = next(u for u in t.types if not isinstance(u, msgspec.inspect.NoneType))
        if isinstance(t, msgspec.inspect.Metadata):  # a description wraps the constrained type
            t = t.type
        if isinstance(t, msgspec.inspect.IntType):
            assert t.ge is not None and t.le is not None, f.name
            out[f.name] = (t.ge, t.le)
    return out


_BOUNDS: Final = _int_bounds()
assert set(_BOUNDS) == {*FIELDS, "max_queued_per_tenant", "shed_below", *TOKEN_FIELDS}


def bounds() -> dict[str, tuple[int, int]]:
    """``{field: (lowest, highest)}`` of every field of :data:`FIELDS`, read from the
    annotations."""
    return {name: _BOUNDS[name] for name in FIELDS}


def _in_bounds(name: str, value: object) -> bool:
    low, high = _BOUNDS[name]
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _field_problem(name: str, value: object) -> str | None:
    low, high = _BOUNDS[name]
    if isinstance(value, bool) or not isinstance(value, int):
        return f"expected int >= {low}, got {value!r} ({_WHY_LOW[name]})"
    if value < low:
        return f"expected int >= {low}, got {value!r} ({_WHY_LOW[name]})"
    if value > high:
        return f"expected int <= {high}, got {value!r}"
    return None


def check_ceiling(floor: int, ceiling: int) -> None:
    """Raise ``ConfigError("ceiling: expected >= floor (4), got 2")`` when ceiling < floor."""
    if ceiling < floor:
        raise ConfigError(f"ceiling: expected >= floor ({floor}), got {ceiling}")


def check_admission(
    max_queued_per_tenant: object, shed_below: object, tenant_weights: object
) -> None:
    """Raise a :class:`ConfigError` naming the field when one of the admission order's settings
    is out of its bounds: ``max_queued_per_tenant`` None or an int in [0, MAX_QUEUED],
    ``shed_below`` an int in [-100, 100], ``tenant_weights`` a mapping tenant name -> int in
    [1, 1000] of at most 10,000 entries."""
    mqpt = max_queued_per_tenant
    if mqpt is not None and not _in_bounds("max_queued_per_tenant", mqpt):
        low, high = _BOUNDS["max_queued_per_tenant"]
        raise ConfigError(
            f"max_queued_per_tenant: expected None or int in [{low}, {high}], got {mqpt!r}"
        )
    if not _in_bounds("shed_below", shed_below):
        low, high = _BOUNDS["shed_below"]
        raise ConfigError(f"shed_below: expected int in [{low}, {high}], got {shed_below!r}")
    validate_tenant_weights(tenant_weights)


def check_tokens(token_limit: object, token_ceiling: object) -> None:
    """Raise a :class:`ConfigError` naming the field unless the token budget's settings are
    None or ints in [1, MAX_TOKENS], ``token_ceiling`` is given only with ``token_limit``, and
    never below it."""
    for name, value in (("token_limit", token_limit), ("token_ceiling", token_ceiling)):
        if value is not None and not _in_bounds(name, value):
            low, high = _BOUNDS[name]
            raise ConfigError(f"{name}: expected None or int in [{low}, {high}], got {value!r}")
    if token_ceiling is not None and token_limit is None:
        raise ConfigError(
            f"token_ceiling: {token_ceiling} without a token_limit (a gate without a token "
            "budget has no token ceiling)"
        )
    both = isinstance(token_limit, int) and isinstance(token_ceiling, int)
    if both and token_ceiling < token_limit:  # type: ignore[operator]
        raise ConfigError(
            f"token_ceiling: expected >= token_limit ({token_limit}), got {token_ceiling}"
        )


def validate_gate_settings(name: str, values: dict[str, Any]) -> dict[str, Any]:
    """Check the settings of gate ``name`` (every field of :data:`FIELDS`, optionally those of
    :data:`ADMISSION_FIELDS`); the error names the gate and the field.

    The client's check before it registers defaults. Returns ``values``.
    """
    GateSettings.validated(name, **values)
    return values
