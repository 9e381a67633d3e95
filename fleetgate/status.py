"""Fleet status as one object: leader, epoch and one row per registered gate.

Shared by ``fleetgate status``, ``fleetgate inspect`` and the demo's live view.
"""

from __future__ import annotations

import logging

import msgspec
import redis.asyncio as aredis

from fleetgate.keys import GateKeys, fleet_keys
from fleetgate.protocol import Stat
from fleetgate.registry import read_registry
from fleetgate.scripts import GateScripts, Snapshot
from fleetgate.util_hash import UtilHash

__all__ = [
    "STATUS_LANES",
    "TENANTS_SHOWN",
    "BandQueue",
    "FleetStatus",
    "GateStatus",
    "TenantQueue",
    "format_status",
    "gather_status",
    "tenant_shown",
]

#: Lanes (priority, tenant) one status read lists per gate, in service order (the inspect script
#: lists as many head waiters and holders with them): each gate costs O(log n + this) whatever
#: its queue. The breakdowns are exact while a gate has at most this many lanes; the waiters of
#: the lanes beyond are counted in ``unlisted`` (and in the tenants' ``other``).
STATUS_LANES = 32
#: Tenants listed per gate by default (the largest queues first); the rest are summed in `other`.
TENANTS_SHOWN = 5

log = logging.getLogger("fleetgate.status")
# Invalid registry entries already logged by this process (`status --watch` logs each once).
_warned: set[str] = set()


class BandQueue(msgspec.Struct, kw_only=True):
    """Waiters of one priority band (of the lanes read), and whom its free units are kept for."""

    priority: int
    queued: int
    #: lanes (tenants) of the band that were read
    lanes: int
    #: the waiter the band's free units are reserved for (its head did not fit), if any
    reserved: str | None = None
    #: that waiter's tenant ('' = the default tenant)
    reserved_tenant: str | None = None


class TenantQueue(msgspec.Struct, kw_only=True):
    """Waiters of one tenant over all bands ('' = the default tenant)."""

    tenant: str
    queued: int


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
    #: units held (the holders' weights); ``in_flight`` counts the leases
    units: int = 0
    #: the token budget in force (None: none) and the tokens held
    token_limit: int | None = None
    tokens: int = 0
    #: the budget in force is the coordinator's tuned one (its reason at the last poll, and
    #: the KV cache the server states, in tokens; None: unknown)
    token_tuned: bool = False
    token_reason: str | None = None
    kv_tokens: float | None = None
    #: tokens the settled calls used per token charged (None: unknown)
    token_use_ratio: float | None = None
    #: the schema of the gate's state (``fg:{G}:cfg`` field ``schema``; 0: no configuration yet)
    schema: int = 0
    max_queued_per_tenant: int = 0
    shed_below: int = 0
    #: configured tenant weights (tenant -> weight)
    tenant_weights: dict[str, int] = {}
    #: queue per band, highest priority (served first) first
    bands: list[BandQueue] = []
    #: queue per tenant, the largest first, at most ``tenants`` of them (see gather_status)
    tenants: list[TenantQueue] = []
    #: waiters of the other tenants, and of lanes beyond STATUS_LANES
    tenants_other: int = 0
    #: waiters of lanes beyond STATUS_LANES: in no band row (0 when the breakdowns are exact)
    unlisted: int = 0
    evicted: int = 0
    shed: int = 0
    rejected_tenant: int = 0
    too_heavy: int = 0
    #: "latency" when the client-observed signal drives the target (docs/aimd.md), else None
    signal: str | None = None
    #: the last poll's median call latency and the no-load estimate (seconds; latency gates)
    latency_p50: float | None = None
    latency_no_load: float | None = None
    #: calls reported in the last poll, and the overloaded / timed-out ones among them
    obs_calls: int | None = None
    obs_overloaded: int | None = None
    obs_timeout: int | None = None
    #: what the coordinator's last scrape of the gate's metrics found wrong (None: nothing)
    metrics_error: str | None = None


class FleetStatus(msgspec.Struct, kw_only=True):
    leader: str | None
    epoch: int | None
    gates: list[GateStatus]
    #: registry entries that are no valid gate name (skipped; shown as Python literals)
    invalid_gates: list[str] = []


def tenant_shown(tenant: str | None) -> str:
    """A tenant for people: the default tenant ('' or None) is ``(default)``."""
    return tenant or "(default)"


def _bands(snap: Snapshot) -> list[BandQueue]:
    bands: dict[int, BandQueue] = {}
    for lane in snap.lanes:
        band = bands.get(lane.priority)
        if band is None:
            band = bands[lane.priority] = BandQueue(priority=lane.priority, queued=0, lanes=0)
        band.queued += lane.queued
        band.lanes += 1
        if lane.reserved:
            band.reserved, band.reserved_tenant = lane.reserved, lane.tenant
    return sorted(bands.values(), key=lambda b: -b.priority)


def _tenants(snap: Snapshot, shown: int) -> tuple[list[TenantQueue], int]:
    per: dict[str, int] = {}
    for lane in snap.lanes:  # in service order: a tie keeps the tenant served first first
        per[lane.tenant] = per.get(lane.tenant, 0) + lane.queued
    ranked = sorted(per.items(), key=lambda kv: -kv[1])
    top = [TenantQueue(tenant=t, queued=q) for t, q in ranked[: max(0, shown)]]
    listed = sum(t.queued for t in top)
    return top, max(0, snap.queued - listed)


def _tenant_weights(snap: Snapshot) -> dict[str, int]:
    out: dict[str, int] = {}
    for tenant, raw in snap.tenant_weights.items():
        try:
            out[tenant] = int(float(raw))
        except ValueError:
            out[tenant] = 1  # what the scripts weigh a garbled entry
    return out


def gate_status(name: str, snap: Snapshot, *, tenants: int = TENANTS_SHOWN) -> GateStatus:
    """One status row from a gate's snapshot; ``tenants``: how many tenants to list."""
    util = UtilHash.decode(snap.util)
    top, other = _tenants(snap, tenants)
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
        granted=snap.stat(Stat.GRANTED),
        rejected=snap.stat(Stat.REJECTED),
        expired_leases=snap.stat(Stat.EXPIRED_LEASES),
        abandoned_waiters=snap.stat(Stat.ABANDONED_WAITERS),
        units=snap.units,
        token_limit=snap.token_limit,
        tokens=snap.tokens,
        token_tuned=snap.token_tuned,
        token_reason=util.token_reason,
        kv_tokens=util.kv_tokens,
        token_use_ratio=util.token_use_ratio,
        schema=_int(snap.cfg.get("schema")) or 0,
        max_queued_per_tenant=snap.max_queued_per_tenant,
        shed_below=snap.shed_below,
        tenant_weights=_tenant_weights(snap),
        bands=_bands(snap),
        tenants=top,
        tenants_other=other,
        unlisted=max(0, snap.queued - sum(lane.queued for lane in snap.lanes)),
        evicted=snap.stat(Stat.EVICTED),
        shed=snap.stat(Stat.SHED),
        rejected_tenant=snap.stat(Stat.REJECTED_TENANT),
        too_heavy=snap.stat(Stat.TOO_HEAVY),
        signal=util.signal,
        latency_p50=util.latency_p50,
        latency_no_load=util.latency_no_load,
        obs_calls=util.obs_calls,
        obs_overloaded=util.obs_overloaded,
        obs_timeout=util.obs_timeout,
        metrics_error=util.error,
    )


def _int(raw: str | None) -> int | None:
    try:
        return int(float(raw)) if raw else None
    except ValueError:
        return None


async def gather_status(
    client: aredis.Redis, prefix: str, *, tenants: int = TENANTS_SHOWN
) -> FleetStatus:
    """Read the leader, the epoch and a snapshot of every registered gate (``tenants``: how
    many tenants each gate lists; the rest are summed in ``tenants_other``)."""
    fk = fleet_keys(prefix)
    leader = await client.get(fk.leader)
    epoch = await client.get(fk.epoch)
    registry = await read_registry(client, prefix)
    for shown, why in registry.invalid:
        if shown not in _warned and len(_warned) < 10_000:
            _warned.add(shown)
            log.warning("%s holds an invalid gate name %s (%s); skipped", fk.gates, shown, why)
    scripts = GateScripts(client)
    # The counts are exact whatever the queue; the script lists STATUS_LANES lanes (and as many
    # head waiters and holders, unused here), so each gate costs O(log n + STATUS_LANES).
    gates = [
        gate_status(
            n, await scripts.snapshot(GateKeys.of(prefix, n), STATUS_LANES), tenants=tenants
        )
        for n in registry.names
    ]
    return FleetStatus(
        leader=str(leader) if leader is not None else None,
        epoch=int(epoch) if epoch is not None else None,
        gates=gates,
        invalid_gates=[shown for shown, _ in registry.invalid],
    )


def format_status(status: FleetStatus, now: float) -> str:
    """A human table: one line per gate, and under a gate with waiters its queue by priority
    band and by tenant."""
    lines = [f"leader: {status.leader or '-'}  epoch: {status.epoch if status.epoch else '-'}"]
    header = (
        f"{'gate':<36} {'limit':>6} {'target':>6} {'epoch':>5} {'units':>11} {'in-fl':>6} "
        f"{'queued':>7} {'sat':>4} {'running':>8} {'last poll':>9} {'server':<8} {'schema':>6}"
    )
    lines.append(header)
    for g in status.gates:
        age = f"{now - g.last_poll:.0f}s ago" if g.last_poll else "-"
        running = f"{g.running:.0f}" if g.running is not None else "-"
        units = f"{g.units}/{g.limit}"
        lines.append(
            f"{g.name[:36]:<36} {g.limit:>6} {g.target if g.target is not None else '-':>6} "
            f"{g.epoch if g.epoch is not None else '-':>5} {units:>11} {g.in_flight:>6} "
            f"{g.queued:>7} {'yes' if g.saturated else 'no':>4} {running:>8} {age:>9} "
            f"{g.server or '-':<8} {g.schema or '-':>6}"
        )
        if g.token_limit is not None:
            lines.append(f"  tokens held: {g.tokens}/{g.token_limit}{_tuned(g)}")
        lines.extend(_observed_lines(g))
        if g.metrics_error and not g.metrics_ok:
            shown = (
                g.metrics_error if len(g.metrics_error) <= 300 else g.metrics_error[:297] + "..."
            )
            lines.append(f"  metrics unusable: {shown}")
        lines.extend(_queue_lines(g))
    if not status.gates:
        lines.append("(no gates registered)")
    if status.invalid_gates:
        shown = ", ".join(status.invalid_gates[:5])
        more = f" (+{len(status.invalid_gates) - 5} more)" if len(status.invalid_gates) > 5 else ""
        lines.append(f"skipped invalid registry entries: {shown}{more}")
    return "\n".join(lines)


def _tuned(g: GateStatus) -> str:
    """How the token budget in force came about: tuned (why, and the KV cache stated)."""
    if not g.token_tuned:
        return ""
    kv = f", server's KV cache {g.kv_tokens:,.0f}" if g.kv_tokens is not None else ""
    use = f", calls use {g.token_use_ratio:.2f} of their charge" if g.token_use_ratio else ""
    return f" (tuned: {g.token_reason or '-'}{kv}{use})"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def _observed_lines(g: GateStatus) -> list[str]:
    """The client-observed signal of a gate, when it drives the target or reports arrived."""
    if g.signal != "latency" and not g.obs_calls:
        return []
    text = "  observed:"
    if g.signal == "latency":
        text += f" latency p50 {_ms(g.latency_p50)}, no-load {_ms(g.latency_no_load)};"
    if g.obs_calls is not None:
        text += (
            f" last poll {g.obs_calls} calls, {g.obs_overloaded or 0} overloaded, "
            f"{g.obs_timeout or 0} timed out"
        )
    return [text.rstrip(";")]


def _queue_lines(g: GateStatus) -> list[str]:
    """The queue of a gate with waiters, by band (served first first) and by tenant."""
    if not g.queued or not (g.bands or g.unlisted):
        return []
    bands = []
    for b in g.bands:
        text = f"p{b.priority} {b.queued}"
        if b.reserved:
            text += f" (units kept for {b.reserved} of {tenant_shown(b.reserved_tenant)})"
        bands.append(text)
    if g.unlisted:
        bands.append(f"unlisted {g.unlisted}")
    tenants = [f"{tenant_shown(t.tenant)} {t.queued}" for t in g.tenants]
    if g.tenants_other or not tenants:
        tenants.append(f"other {g.tenants_other}")
    return [
        f"  queued by priority: {', '.join(bands)}",
        f"  queued by tenant:   {', '.join(tenants)}",
    ]
