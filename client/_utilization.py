"""``fleet.utilization(name)``: a gate's snapshot in the seed's ``get_utilization`` shape."""

from __future__ import annotations

from typing import Any

import msgspec

from fleetgate.scripts import Snapshot

__all__ = ["GateUtilization", "utilization_of"]


class GateUtilization(msgspec.Struct, kw_only=True):
    """A snapshot of one gate: the seed's ``get_utilization`` fields plus fleet-wide state."""

    name: str
    limit: int
    #: the limit the gate applies now (the seed's name for it): live target, else floor
    current_target: int
    #: the coordinator's published target while its lease is live, else None
    target: int | None
    in_flight: int
    queued: int
    floor: int
    ceiling: int
    max_queued: int
    epoch: int | None
    live_pods: int
    running: float | None = None
    waiting_capacity: float | None = None
    metrics_ok: bool = False
    saturated: bool = False
    last_poll: float | None = None
    metrics_url: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)


def utilization_of(name: str, snap: Snapshot) -> GateUtilization:
    """The utilisation of gate ``name`` from its ``inspect`` snapshot."""
    util, target = snap.util, snap.target
    return GateUtilization(
        name=name,
        limit=snap.limit,
        current_target=snap.limit,
        target=_live_target(target, snap.now),
        in_flight=snap.holders,
        queued=snap.queued,
        floor=snap.floor,
        ceiling=snap.ceiling,
        max_queued=snap.max_queued,
        epoch=_int(target.get("epoch")),
        live_pods=snap.live_pods,
        running=_float(util.get("running")),
        waiting_capacity=_float(util.get("waiting_capacity")),
        metrics_ok=util.get("metrics_ok") == "1",
        saturated=util.get("saturated") == "1",
        last_poll=_float(util.get("last_poll")),
        metrics_url=util.get("metrics_url") or None,
    )


def _live_target(target: dict[str, str], now_ms: int) -> int | None:
    expires = _int(target.get("expires_at"))
    if expires is None or expires <= now_ms:
        return None
    return _int(target.get("value"))


def _int(v: str | None) -> int | None:
    try:
        return int(float(v)) if v is not None else None
    except ValueError:
        return None


def _float(v: str | None) -> float | None:
    try:
        return float(v) if v not in (None, "") else None
    except ValueError:
        return None
