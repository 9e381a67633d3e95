"""A gate's settings -- floor, ceiling, max_queued, lease_ms, waiter_ms -- with their defaults and
bounds, written once.

:class:`GateSettings` is what the scripts are given (``argv()``, ARGV 3..7 of ``acquire.lua``),
what a client registers for a gate that has no configuration yet, and what the coordinator's
:class:`~fleetgate.coordinator.config.GateConfig` is made of (it reuses the annotated field types
below). ``lua/lib.lua`` (``load_cfg``) applies the same defaults and lower bounds to whatever it
finds in ``fg:{G}:cfg``; ``tests/test_settings.py`` runs the real script to prove they agree.
"""

from __future__ import annotations

from typing import Annotated, Any, Final

import msgspec
from msgspec import Meta

from fleetgate.errors import ConfigError

__all__ = [
    "DEFAULT_CEILING",
    "FIELDS",
    "MAX_PERMITS",
    "MAX_QUEUED",
    "MAX_TTL_MS",
    "Ceiling",
    "Floor",
    "GateSettings",
    "LeaseMs",
    "MaxQueued",
    "WaiterMs",
    "bounds",
    "check_ceiling",
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
    decoding); :meth:`validated` does, naming the gate and the field.
    """

    floor: Floor = 1
    ceiling: Ceiling = DEFAULT_CEILING
    max_queued: MaxQueued = 1000
    lease_ms: LeaseMs = 10_000
    waiter_ms: WaiterMs = 5_000

    def argv(self) -> list[int]:
        """ARGV of the scripts that take a gate's settings (floor, ceiling, max_queued,
        lease_ms, waiter_ms)."""
        return [self.floor, self.ceiling, self.max_queued, self.lease_ms, self.waiter_ms]

    def as_cfg(self) -> dict[str, int]:
        """The fields of ``fg:{G}:cfg``."""
        return {name: getattr(self, name) for name in FIELDS}

    @classmethod
    def validated(cls, gate: str, **values: Any) -> GateSettings:
        """Settings from ``values`` (every field), checked: a :class:`ConfigError` names the gate
        and the field, e.g. ``gate 'x': floor: expected int >= 1, got 0 (...)``."""
        for name in FIELDS:
            problem = _field_problem(name, values.get(name))
            if problem:
                raise ConfigError(f"gate {gate!r}: {name}: {problem}")
        unknown = sorted(set(values) - set(FIELDS))
        if unknown:
            raise ConfigError(f"gate {gate!r}: {unknown[0]}: unknown setting")
        try:
            check_ceiling(values["floor"], values["ceiling"])
        except ConfigError as exc:
            raise ConfigError(f"gate {gate!r}: {exc}") from None
        return cls(**values)

    @classmethod
    def for_gate(
        cls,
        gate: str,
        *,
        floor: int | None = None,
        ceiling: int | None = None,
        max_queued: int | None = None,
        lease_ms: int | None = None,
        waiter_ms: int | None = None,
    ) -> GateSettings:
        """A client's settings for ``gate``: None takes the default (the ceiling's is never
        below the floor), then :meth:`validated`."""
        d = cls()
        fl = d.floor if floor is None else floor
        return cls.validated(
            gate,
            floor=fl,
            ceiling=_default_ceiling(fl, d.ceiling) if ceiling is None else ceiling,
            max_queued=d.max_queued if max_queued is None else max_queued,
            lease_ms=d.lease_ms if lease_ms is None else lease_ms,
            waiter_ms=d.waiter_ms if waiter_ms is None else waiter_ms,
        )


FIELDS: Final = GateSettings.__struct_fields__


def _default_ceiling(floor: object, default: int) -> object:
    # A bad floor is reported as the floor's problem, not turned into a TypeError here.
    if isinstance(floor, int) and not isinstance(floor, bool):
        return max(floor, default)
    return default


def bounds() -> dict[str, tuple[int, int]]:
    """``{field: (lowest, highest)}`` of every setting, read from the annotations."""
    info = msgspec.inspect.type_info(GateSettings)
    assert isinstance(info, msgspec.inspect.StructType)
    out: dict[str, tuple[int, int]] = {}
    for f in info.fields:
        t = f.type
        if isinstance(t, msgspec.inspect.Metadata):  # a description wraps the constrained type
            t = t.type
        assert isinstance(t, msgspec.inspect.IntType) and t.ge is not None and t.le is not None
        out[f.name] = (t.ge, t.le)
    return out


_BOUNDS: Final = bounds()


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


def validate_gate_settings(name: str, values: dict[str, int]) -> dict[str, int]:
    """Check the settings of gate ``name`` (every field); the error names the gate and the field.

    The client's check before it registers defaults. Returns ``values``.
    """
    GateSettings.validated(name, **values)
    return values
