"""A gate's settings as given to ``fleet.gate(name, ...)``: defaults filled in and checked.

(To be replaced by the core's one settings struct, ``fleetgate/settings.py``.)
"""

from __future__ import annotations

from fleetgate.errors import ConfigError
from fleetgate.scripts import GateDefaults

__all__ = ["gate_defaults", "validate_gate_settings"]


def gate_defaults(
    name: str,
    *,
    floor: int | None,
    ceiling: int | None,
    max_queued: int | None,
    lease_ms: int | None,
    waiter_ms: int | None,
) -> GateDefaults:
    """The settings a client registers for gate ``name`` where Redis has none yet: the values
    given, the defaults for the rest (the ceiling at least the floor); ConfigError if bad."""
    d = GateDefaults()
    fl = d.floor if floor is None else floor
    values = {
        "floor": fl,
        "ceiling": max(fl, d.ceiling) if ceiling is None else ceiling,
        "max_queued": d.max_queued if max_queued is None else max_queued,
        "lease_ms": d.lease_ms if lease_ms is None else lease_ms,
        "waiter_ms": d.waiter_ms if waiter_ms is None else waiter_ms,
    }
    return GateDefaults(**validate_gate_settings(name, values))


def validate_gate_settings(name: str, values: dict[str, int]) -> dict[str, int]:
    """Check gate settings; the error names the gate and the field."""
    rules = {
        "floor": (1, "a cap <= 0 would block every call"),
        "ceiling": (1, "a cap <= 0 would block every call"),
        "max_queued": (0, "a negative queue bound is meaningless"),
        "lease_ms": (100, "leases shorter than 100 ms cannot be renewed in time"),
        "waiter_ms": (100, "waiters shorter than 100 ms cannot be refreshed in time"),
    }
    for field, (low, why) in rules.items():
        v = values[field]
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ConfigError(f"gate {name!r}: {field}: expected int >= {low}, got {v!r} ({why})")
    floor, ceiling = values["floor"], values["ceiling"]
    if ceiling < floor:
        raise ConfigError(f"gate {name!r}: ceiling: expected >= floor ({floor}), got {ceiling}")
    return values
