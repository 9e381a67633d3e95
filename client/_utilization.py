"""``fleet.utilization(name)``: a gate's snapshot in the shape of ``compat.get_utilization``."""

from __future__ import annotations

from typing import Any

import msgspec

from fleetgate.scripts import Snapshot
from fleetgate.util_hash import UtilHash

__all__ = ["GateUtilization", "utilization_of"]


class GateUtilization(msgspec.Struct, kw_only=True):
    """A snapshot of one gate: the fields of ``get_utilization`` in ``agent_utilities`` (the
    per-process helpers :mod:`fleetgate.client.compat` replaces) plus fleet-wide state
    (``in_flight`` counts leases, ``units`` their weights: the limit is in units)."""

    name: str
    limit: int
    #: the limit the gate applies now (``agent_utilities``' name for it): live target, else floor
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
    #: units held fleet-wide (the holders' weights; ``in_flight`` counts the leases): the
    #: limit counts units, so ``limit - units`` is what can still be granted
    units: int = 0
    #: the schema of the gate's state (0: no configuration yet)
    schema: int = 0
    max_queued_per_tenant: int = 0
    shed_below: int = 0

    def to_dict(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)


def utilization_of(name: str, snap: Snapshot) -> GateUtilization:
    """The utilisation of gate ``name`` from its snapshot (the coordinator's part of it, the
    util hash, read by :class:`~fleetgate.util_hash.UtilHash`)."""
    util = UtilHash.decode(snap.util)
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
        units=snap.units,
        schema=_schema(snap.cfg.get("schema")),
        max_queued_per_tenant=snap.max_queued_per_tenant,
        shed_below=snap.shed_below,
    )


def _schema(raw: str | None) -> int:
    try:
        return int(float(raw)) if raw else 0
    except ValueError:
        return 0
