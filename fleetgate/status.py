"""Fleet status as one object: leader, epoch and one row per registered gate.

Shared by ``fleetgate status``, ``fleetgate inspect`` and the demo's live view.
"""

from __future__ import annotations

import logging

import msgspec
import redis.asyncio as aredis

from fleetgate.keys import GateKeys, fleet_keys
from fleetgate.registry import read_registry
from fleetgate.scripts import GateScripts, Snapshot

__all__ = ["FleetStatus", "GateStatus", "format_status", "gather_status"]

log = logging.getLogger("fleetgate.status")
# Invalid registry entries already logged by this process (`status --watch` logs each once).
_warned: set[str] = set()


class GateStatus(msgspec.Struct, kw_only=True):
    name: str
    limit: int
    target: int | None
    floor: int
    ceiling: int
    epoch: int | None
    in_flight: int
    queued: int
    max_queued: int
    live_pods: int
    saturated: bool
    metrics_ok: bool
    running: float | None
    waiting_capacity: float | None
    last_poll: float | None
    reason: str | None
    server: str | None
    granted: int
    rejected: int
    expired_leases: int
    abandoned_waiters: int


class FleetStatus(msgspec.Struct, kw_only=True):
    leader: str | None
    epoch: int | None
    gates: list[GateStatus]
    #: registry entries that are no valid gate name (skipped; shown as Python literals)
    invalid_gates: list[str] = []


def gate_status(name: str, snap: Snapshot) -> GateStatus:
    """One status row from a gate's snapshot."""
    util = snap.utilization()
    return GateStatus(
        name=name,
        limit=snap.limit,
        target=snap.live_target,  # None once expired: the limit has decayed to the floor
        floor=snap.floor,
        ceiling=snap.ceiling,
        epoch=snap.epoch,
        in_flight=snap.holders,
        queued=snap.queued,
        max_queued=snap.max_queued,
        live_pods=snap.live_pods,
        saturated=util.saturated,
        metrics_ok=util.metrics_ok,
        running=util.running,
        waiting_capacity=util.waiting_capacity,
        last_poll=util.last_poll,
        reason=util.reason,
        server=util.server,
        granted=snap.stat("granted"),
        rejected=snap.stat("rejected"),
        expired_leases=snap.stat("expired_leases"),
        abandoned_waiters=snap.stat("abandoned_waiters"),
    )


async def gather_status(client: aredis.Redis, prefix: str) -> FleetStatus:
    """Read the leader, the epoch and a snapshot of every registered gate."""
    fk = fleet_keys(prefix)
    leader = await client.get(fk.leader)
    epoch = await client.get(fk.epoch)
    registry = await read_registry(client, prefix)
    for shown, why in registry.invalid:
        if shown not in _warned and len(_warned) < 10_000:
            _warned.add(shown)
            log.warning("%s holds an invalid gate name %s (%s); skipped", fk.gates, shown, why)
    scripts = GateScripts(client)
    # n=0: counts only; nothing is listed, so each gate costs O(log n) whatever its queue.
    gates = [
        gate_status(n, await scripts.snapshot(GateKeys.of(prefix, n), 0)) for n in registry.names
    ]
    return FleetStatus(
        leader=str(leader) if leader is not None else None,
        epoch=int(epoch) if epoch is not None else None,
        gates=gates,
        invalid_gates=[shown for shown, _ in registry.invalid],
    )


def format_status(status: FleetStatus, now: float) -> str:
    """A human table: one line per gate."""
    lines = [f"leader: {status.leader or '-'}  epoch: {status.epoch if status.epoch else '-'}"]
    header = (
        f"{'gate':<36} {'limit':>6} {'target':>6} {'epoch':>5} {'in-fl':>6} {'queued':>7} "
        f"{'sat':>4} {'running':>8} {'last poll':>9} {'server':<8}"
    )
    lines.append(header)
    for g in status.gates:
        age = f"{now - g.last_poll:.0f}s ago" if g.last_poll else "-"
        running = f"{g.running:.0f}" if g.running is not None else "-"
        lines.append(
            f"{g.name[:36]:<36} {g.limit:>6} {g.target if g.target is not None else '-':>6} "
            f"{g.epoch if g.epoch is not None else '-':>5} {g.in_flight:>6} {g.queued:>7} "
            f"{'yes' if g.saturated else 'no':>4} {running:>8} {age:>9} {g.server or '-':<8}"
        )
    if not status.gates:
        lines.append("(no gates registered)")
    if status.invalid_gates:
        shown = ", ".join(status.invalid_gates[:5])
        more = f" (+{len(status.invalid_gates) - 5} more)" if len(status.invalid_gates) > 5 else ""
        lines.append(f"skipped invalid registry entries: {shown}{more}")
    return "\n".join(lines)
