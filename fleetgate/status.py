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


def _num(v: str | None, kind: type[int] | type[float]) -> int | float | None:
    if v is None or v == "":
        return None
    try:
        return kind(float(v))
    except ValueError:
        return None


def gate_status(name: str, snap: Snapshot) -> GateStatus:
    """One status row from an ``inspect`` snapshot."""
    util, target, stats = snap.util, snap.target, snap.stats

    def stat(k: str) -> int:
        return int(_num(stats.get(k), int) or 0)

    live_target = _num(target.get("value"), int)
    expires = _num(target.get("expires_at"), int)
    if expires is not None and expires <= snap.now:
        live_target = None  # expired: the limit has decayed to the floor
    return GateStatus(
        name=name,
        limit=snap.limit,
        target=live_target,  # type: ignore[arg-type]
        floor=snap.floor,
        ceiling=snap.ceiling,
        epoch=_num(target.get("epoch"), int),  # type: ignore[arg-type]
        in_flight=snap.holders,
        queued=snap.queued,
        max_queued=snap.max_queued,
        live_pods=snap.live_pods,
        saturated=util.get("saturated") == "1",
        metrics_ok=util.get("metrics_ok") == "1",
        running=_num(util.get("running"), float),
        waiting_capacity=_num(util.get("waiting_capacity"), float),
        last_poll=_num(util.get("last_poll"), float),
        reason=util.get("reason") or None,
        server=util.get("server") or None,
        granted=stat("granted"),
        rejected=stat("rejected"),
        expired_leases=stat("expired_leases"),
        abandoned_waiters=stat("abandoned_waiters"),
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
        gate_status(n, await scripts.inspect(GateKeys.of(prefix, n), 0)) for n in registry.names
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
