"""(temporary stand-in; replaced by the settings branch's module at merge)"""

from __future__ import annotations

from collections.abc import Mapping

from fleetgate.errors import ConfigError
from fleetgate.keys import validate_gate_name

MIN_PRIORITY = -100
MAX_PRIORITY = 100
MAX_TENANT_WEIGHT = 1000


def validate_weight(weight: object, *, ceiling: int | None = None) -> int:
    if isinstance(weight, bool) or not isinstance(weight, int) or weight < 1:
        raise ConfigError(f"weight: expected int >= 1, got {weight!r}")
    if ceiling is not None and weight > ceiling:
        raise ConfigError(f"weight: {weight} is above the gate's ceiling ({ceiling})")
    return weight


def validate_priority(priority: object) -> int:
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ConfigError(f"priority: expected int in [-100, 100], got {priority!r}")
    if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise ConfigError(f"priority: expected int in [-100, 100], got {priority!r}")
    return priority


def validate_tenant(tenant: object) -> str | None:
    if tenant is None:
        return None
    try:
        return validate_gate_name(tenant)
    except ConfigError as exc:
        raise ConfigError(f"tenant: {exc}") from None


def lane_class(priority: int, tenant: str | None) -> str:
    if priority == 0 and not tenant:
        return ""
    return f"{100 - priority:03d}}}{tenant or ''}"


def encode_tenant_weights(mapping: Mapping[str, int]) -> str:
    return "}".join(f"{k}}}{v}" for k, v in sorted(mapping.items()))


def waiter_member(priority: int, tenant: str | None, seq: int, lease_id: str) -> str:
    return f"{tenant or ''}}}{100 - priority:03d}}}{seq:020d}}}{lease_id}"


def weighted_id(base_id: str, weight: int) -> str:
    return base_id if weight == 1 else f"{base_id}w{weight}"


def weight_of(lease_id: str) -> int:
    _, sep, tail = lease_id.rpartition(":")
    if sep and "w" in tail:
        n, _, w = tail.partition("w")
        if n.isdigit() and w.isdigit():
            return int(w)
    return 1


def class_member(cls: str, seq: int, lease_id: str) -> str:
    """The waiter member of a call parked with class ``cls`` (:func:`lane_class`) and ``seq``."""
    lane = "}100" if not cls else f"{cls[4:]}}}{cls[:3]}"
    return f"{lane}}}{seq:020d}}}{lease_id}"


def member_id(member: str) -> str:
    """The lease id of a waiter member ('<tenant>}<R>}<seq20>}<id>')."""
    return member.rpartition("}")[2]
