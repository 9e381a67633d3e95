"""What ``fleetgate demo`` records and shows: samples, the live view, demo.json, the summary.

Kept apart from the process orchestration in :mod:`fleetgate.demo`; the picture (``demo.png``)
is drawn from this record by :mod:`fleetgate.demo.picture`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from fleetgate.demo.token_budget import TOLERANCE, token_budget_run

__all__ = [
    "DemoRecord",
    "Event",
    "Failover",
    "GateInfo",
    "GateSample",
    "Sample",
    "format_summary",
    "progress_line",
    "render_view",
    "summarize",
    "worker_totals",
]


class GateInfo(msgspec.Struct, kw_only=True):
    """One gate of the demo and the simulator behind it."""

    name: str
    kind: str
    floor: int
    adaptive: bool
    capacity: int
    url: str
    #: the simulator's KV cache (tokens; None: slots alone) and the gate's token budget as
    #: configured: where tuning starts, and the most it may reach (None: no token budget)
    kv_tokens: int | None = None
    token_limit: int | None = None
    token_ceiling: int | None = None


class GateSample(msgspec.Struct, kw_only=True):
    """One gate at one instant: the fleet's view (Redis) and the server's (``/admin/stats``)."""

    limit: int
    target: int | None
    in_flight: int
    queued: int
    saturated: bool
    reason: str | None
    server_running: int | None
    server_waiting: int | None
    server_capacity: int | None
    #: the token budget in force (the tuned one, else the configured ``token_limit``; None: the
    #: gate has none) and the tokens the fleet's leases hold (Redis)
    token_limit: int | None = None
    tokens_held: int | None = None
    token_reason: str | None = None
    #: tokens the calls used per token charged, as the coordinator measured it (None: unknown)
    token_use_ratio: float | None = None
    #: the KV cache the server states (blocks x block size), what it uses, its preemptions
    server_kv_tokens: int | None = None
    server_kv_used: int | None = None
    server_preemptions: int | None = None


class Sample(msgspec.Struct, kw_only=True):
    """The whole fleet at ``t`` seconds after the load started."""

    t: float
    leader: str | None
    epoch: int | None
    gates: dict[str, GateSample]
    requests_ok: int = 0
    errors: int = 0
    #: the search pod's interactive calls asked in the last second: wait p50 and max (ms)
    search_wait_p50_ms: float | None = None
    search_wait_max_ms: float | None = None
    #: its batch loops on the same gate
    ingest_loops: int | None = None


class Event(msgspec.Struct, kw_only=True):
    """Something the demo did or saw (kill, new leader, capacity change, ...)."""

    t: float
    kind: str
    text: str
    #: the gate it concerns, if one (a capacity change: the gate whose server changed)
    gate: str | None = None


class Failover(msgspec.Struct, kw_only=True):
    """The leader kill and what followed, times in seconds after the load started."""

    killed: str
    killed_pid: int
    old_epoch: int
    kill_t: float
    new_leader: str | None = None
    new_epoch: int | None = None
    elected_after: float | None = None
    published_after: float | None = None


class DemoRecord(msgspec.Struct, kw_only=True):
    """Everything written to ``demo.json``."""

    version: int = 1
    started_at: float
    duration: float
    redis: str
    prefix: str
    gates: list[GateInfo]
    pids: dict[str, int] = msgspec.field(default_factory=dict)
    events: list[Event] = msgspec.field(default_factory=list)
    samples: list[Sample] = msgspec.field(default_factory=list)
    failover: Failover | None = None
    workers: dict[str, Any] = msgspec.field(default_factory=dict)
    servers: dict[str, Any] = msgspec.field(default_factory=dict)
    #: the search pod: every interactive call as [t (s since the load started), wait ms],
    #: outcomes (search_ok, search_errors, ingest_ok, ingest_errors), the gate it used
    interactive: dict[str, Any] = msgspec.field(default_factory=dict)
    interrupted: bool = False
    summary: dict[str, Any] = msgspec.field(default_factory=dict)
    #: what ``fleetgate init`` said before the fleet started (the prefix stamped as new)
    stamp: str = ""


def worker_totals(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """Sum the workers' stats files: requests and errors per gate, errors by kind."""
    requests: dict[str, int] = {}
    errors: dict[str, dict[str, int]] = {}
    for s in stats:
        for gate, n in s.get("requests", {}).items():
            requests[gate] = requests.get(gate, 0) + int(n)
        for gate, kinds in s.get("errors", {}).items():
            into = errors.setdefault(gate, {})
            for kind, n in kinds.items():
                into[kind] = into.get(kind, 0) + int(n)
    return {
        "workers": len(stats),
        "requests_ok": sum(requests.values()),
        "errors": sum(n for kinds in errors.values() for n in kinds.values()),
        "requests": requests,
        "errors_by_gate": {g: k for g, k in errors.items() if k},
    }


def _v(x: object) -> str:
    return "-" if x is None else str(x)


def render_view(rec: DemoRecord, s: Sample, width: int = 100) -> str:
    """The live screen: leader and epoch, one row per gate, worker totals, recent events."""
    bar_w = 30
    nw = max(12, min(28, width - 66))  # the gate column shrinks to fit narrow terminals
    done = min(1.0, s.t / rec.duration) if rec.duration else 1.0
    bar = "#" * int(done * bar_w) + "." * (bar_w - int(done * bar_w))
    lines = [
        f"fleetgate demo  [{bar}] {s.t:5.1f}/{rec.duration:.0f} s   (Ctrl-C stops everything)",
        f"leader: {s.leader or '- (none: failover in progress)'}   epoch: {_v(s.epoch)}   "
        f"redis: {rec.redis}",
        "",
        f"{'gate':<{nw}} {'limit':>5} {'target':>6} {'in-fl':>5} {'queued':>6} {'sat':>3} "
        f"{'reason':<15} {'srv run':>7} {'wait':>4} {'cap':>4}",
    ]
    for info in rec.gates:
        g = s.gates.get(info.name)
        if g is None:
            lines.append(f"{info.name[:nw]:<{nw}} (not registered yet)")
            continue
        reason = g.reason if info.adaptive else "fixed"
        lines.append(
            f"{info.name[:nw]:<{nw}} {g.limit:>5} {_v(g.target):>6} {g.in_flight:>5} "
            f"{g.queued:>6} {'yes' if g.saturated else 'no':>3} {_v(reason)[:15]:<15} "
            f"{_v(g.server_running):>7} {_v(g.server_waiting):>4} {_v(g.server_capacity):>4}"
        )
    for info in rec.gates:
        g = s.gates.get(info.name)
        if g is not None and g.token_limit is not None:
            lines.append(
                f"{info.name[:nw]:<{nw}} tokens {_v(g.tokens_held)}/{g.token_limit} "
                f"{_v(g.token_reason)}  srv KV {_v(g.server_kv_tokens)} used "
                f"{_v(g.server_kv_used)} preempted {_v(g.server_preemptions)}"
            )
    lines += ["", f"workers: {s.requests_ok} requests done, {s.errors} failed"]
    if s.ingest_loops is not None:
        lines.append(
            f"search pod: interactive wait p50 {_ms(s.search_wait_p50_ms)}, max "
            f"{_ms(s.search_wait_max_ms)} (last second, priority 10) beside "
            f"{s.ingest_loops} batch loops (priority 0)"
        )
    lines += ["", "events:"]
    lines += [f"  {e.t:6.1f} s  {e.text}" for e in rec.events[-8:]] or ["  (none yet)"]
    return "\n".join(line[:width] for line in lines)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f} ms"


def progress_line(s: Sample) -> str:
    """One plain line for a non-TTY stdout."""
    gates = "  ".join(
        f"{name.split('/')[0][:14]}: limit {g.limit} in-fl {g.in_flight} q {g.queued}"
        + (f" tokens {g.tokens_held}/{g.token_limit}" if g.token_limit is not None else "")
        for name, g in s.gates.items()
    )
    return f"[{s.t:5.1f}s] leader {s.leader or '-'} epoch {_v(s.epoch)} | {gates} | " + (
        f"ok {s.requests_ok} err {s.errors}"
    )


def summarize(rec: DemoRecord) -> dict[str, Any]:
    """Peak targets, failover times, worker outcomes and server peaks, as plain data."""
    peaks: dict[str, int | None] = {}
    for info in rec.gates:
        values = [
            x.gates[info.name].target
            for x in rec.samples
            if info.name in x.gates and x.gates[info.name].target is not None
        ]
        peaks[info.name] = max(values) if values else None  # type: ignore[type-var]
    fo = rec.failover
    leaders = sorted({x.leader for x in rec.samples if x.leader})
    epochs = [x.epoch for x in rec.samples if x.epoch is not None]
    return {
        "peak_targets": peaks,
        "leaders_seen": leaders,
        "epochs_seen": [min(epochs), max(epochs)] if epochs else [],
        "failover_killed": fo.killed if fo else None,
        "failover_new_leader": fo.new_leader if fo else None,
        "failover_elected_s": fo.elected_after if fo else None,
        "failover_published_s": fo.published_after if fo else None,
        "requests_ok": rec.workers.get("requests_ok", 0),
        "worker_errors": rec.workers.get("errors", 0),
        "worker_errors_by_gate": rec.workers.get("errors_by_gate", {}),
        "gateway": rec.workers.get("gateway", {}),
        "token_budgets": _token_summary(rec),
        **_interactive_summary(rec),
    }


def _token_summary(rec: DemoRecord) -> dict[str, Any]:
    """Per gate with a token budget: where it started, reached the stated cache and settled."""
    out = {}
    for info in rec.gates:
        run = token_budget_run(rec.samples, info.name)
        if run is not None:
            out[info.name] = run.as_dict()
    return out


def _interactive_summary(rec: DemoRecord) -> dict[str, Any]:
    """The search pod's waits (p50/p99/max ms) and the rerank queue from first to peak."""
    it = rec.interactive
    waits = sorted(w for _, w in it.get("waits", []))
    if not waits:
        return {}
    gate = it.get("gate", "")
    queued = [x.gates[gate].queued for x in rec.samples if gate in x.gates]

    def pct(p: float) -> float:
        return float(waits[min(len(waits) - 1, int(p / 100 * len(waits)))])

    return {
        "search_calls": len(waits),
        "search_wait_ms": {"p50": pct(50), "p99": pct(99), "max": waits[-1]},
        "search_errors": it.get("search_errors", 0),
        "batch_queue_first_peak": [queued[0], max(queued)] if queued else [],
    }


def _token_line(gate: str, run: dict[str, Any]) -> str:
    """Where a gate's token budget went: from the configured one to the stated cache (in tokens
    the calls use), when."""
    stated = run["stated"]
    cache = f"{stated:,}" if stated is not None else "unknown"
    if run["reached_at"] is None:
        where = f"never within {TOLERANCE:.0%} of the server's KV cache ({cache} tokens)"
    else:
        kept = "and stayed there" if run["stayed"] else "but left it"
        where = (
            f"within {TOLERANCE:.0%} of the server's KV cache ({cache} tokens) at "
            f"{run['reached_at']:.1f} s {kept}"
        )
    ratio = run.get("use_ratio")
    use = (
        f" ({run['final_in_use']:,} in tokens used: calls use {ratio:.2f} of their charge)"
        if ratio
        else ""
    )
    pre = run["preemptions"]
    return (
        f"  token budget {gate}: {run['first']:,} tokens at the start (the configured "
        f"token_limit), {where}; converged at {run['final']:,} from {run['final_since']:.1f} s"
        f"{use}; peak held {run['peak_held']:,} tokens, {'-' if pre is None else pre} "
        "preemptions"
    )


def format_summary(rec: DemoRecord, out: Path) -> str:
    """The text printed at the end of the demo."""
    s = rec.summary
    lines = [f"fleetgate demo: {rec.samples[-1].t if rec.samples else 0:.0f} s of load"]
    lines.append("  peak targets:")
    for info in rec.gates:
        peak = s["peak_targets"].get(info.name)
        srv = rec.servers.get(info.name, {})
        what = f"{peak}" if peak is not None else f"fixed at {info.floor}"
        lines.append(
            f"    {info.name:<30} {what:>12}  (floor {info.floor}, server capacity "
            f"{info.capacity}, server peak running {srv.get('peak_running', '-')})"
        )
    lines += [_token_line(name, run) for name, run in s.get("token_budgets", {}).items()]
    fo = rec.failover
    if fo is None:
        lines.append("  failover: not exercised")
    else:
        kill = f"  failover: SIGKILL {fo.killed} (epoch {fo.old_epoch}) at {fo.kill_t:.1f} s; "
        if fo.published_after is None or fo.elected_after is None:
            lines.append(kill + "no new epoch published before the end")
        else:
            lines.append(
                f"{kill}{fo.new_leader} elected with epoch {fo.new_epoch} after "
                f"{fo.elected_after:.2f} s, targets published under it after "
                f"{fo.published_after:.2f} s"
            )
    by_gate = s["worker_errors_by_gate"]
    errs = "; ".join(f"{g}: {k}" for g, k in by_gate.items()) if by_gate else "none"
    lines.append(
        f"  workers: {s['requests_ok']} requests succeeded, {s['worker_errors']} failed ({errs})"
    )
    if "search_calls" in s:
        w, q = s["search_wait_ms"], s["batch_queue_first_peak"]
        grew = f"; the rerank queue grew from {q[0]} to {q[1]}" if q else ""
        lines.append(
            f"  search (priority 10): {s['search_calls']} calls waited p50 {w['p50']:.0f} ms, "
            f"p99 {w['p99']:.0f} ms, max {w['max']:.0f} ms{grew} (batch at priority 0)"
        )
    gw = s.get("gateway") or {}
    if gw:
        lines.append(
            f"  curl through fleetgate proxy (same rerank gate): {gw['requests']} requests, "
            f"{gw['ok']} ok, status codes {gw['codes']}"
        )
    lines.append(f"  wrote {out / 'demo.png'} and {out / 'demo.json'}")
    return "\n".join(lines)
