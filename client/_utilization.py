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
    """The utilisation of gate ``name`` from its snapshot (parsed by :class:`Snapshot`)."""
    util = snap.utilization()
    return GateUtilization(
        name=name,
        limit=snap.limit,
        current_target=snap.limit,
        target=snap.live_target,
        in_flight=snap.holders,
        queued=snap.queued,
        floor=snap.floor,
        ceiling=snap.ceiling,
        max_queued=snap.max_queued,
        epoch=snap.epoch,
        live_pods=snap.live_pods,
        running=util.running,
        waiting_capacity=util.waiting_capacity,
        metrics_ok=util.metrics_ok,
        saturated=util.saturated,
        last_poll=util.last_poll,
        metrics_url=util.metrics_url,
    )
