"""``demo.png``: what the picture keeps and marks (pure functions, tested) and the drawing.

The decisions are apart from matplotlib: :func:`kept_samples` and :func:`kept_waits` (nothing
from before the load started, t < 0, is drawn), :func:`capacity_marks` (where a server's
capacity was changed, at the change's own time), :func:`over_lowered_limit` (where the fleet's
in-flight sits above a limit that was lowered: lowering a limit never revokes a lease, the calls
already admitted finish). matplotlib is imported only when the figure is drawn (the ``bench``
extra), always with the Agg canvas, never pyplot.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleetgate.demo.report import DemoRecord, GateInfo, Sample
from fleetgate.demo.token_budget import TOLERANCE, token_budget_run

__all__ = [
    "BATCH_QUEUE_COLOUR",
    "BUDGET_LABEL",
    "SERVER_QUEUE_COLOUR",
    "STATED_KV_LABEL",
    "TOKENS_HELD_LABEL",
    "TOKEN_PANEL_TITLE",
    "CapacityMark",
    "OverLimit",
    "capacity_marks",
    "figure",
    "kept_samples",
    "kept_waits",
    "over_lowered_limit",
    "plot",
    "token_gates",
]

SERVER_QUEUE_COLOUR = "tab:red"  # requests waiting inside a model server (saturation)
BATCH_QUEUE_COLOUR = "tab:purple"  # callers parked in the gate (the batch backlog)
CAPACITY_MARK_COLOUR = "dimgrey"
OVER_LIMIT_COLOUR = "tab:orange"
OVER_LIMIT_NOTE_APART = 5.0  # seconds: over-limit spans closer than this share one note
BUDGET_COLOUR = "tab:blue"
TOKENS_HELD_COLOUR = "tab:orange"
KV_USED_COLOUR = "tab:green"
STATED_KV_COLOUR = "tab:brown"
TOKEN_PANEL_TITLE = "token budget"
BUDGET_LABEL = "token budget in force (tuned)"
TOKENS_HELD_LABEL = "tokens held by the fleet"
STATED_KV_LABEL = "server's stated KV cache"
_NEVER_REVOKES = "lowering a limit never revokes a lease;\nthe calls admitted before it finish"


@dataclass(frozen=True)
class CapacityMark:
    """A change of a gate's server capacity: when (the event's time) and from what to what (as the
    samples saw it change; None when they did not)."""

    t: float
    before: int | None
    after: int | None


@dataclass(frozen=True)
class OverLimit:
    """A stretch of samples, ``start`` to ``end`` (the next sample's time), where the fleet's
    in-flight is above a limit lowered earlier in the run; its peak in-flight and that limit."""

    start: float
    end: float
    in_flight: int
    limit: int


def kept_samples(rec: DemoRecord) -> list[Sample]:
    """The samples the picture draws: none from before the load started (t < 0)."""
    return [s for s in rec.samples if s.t >= 0]


def kept_waits(waits: Iterable[Sequence[float]]) -> list[tuple[float, float]]:
    """The interactive calls ``[t, wait ms]`` the picture draws: none from before t = 0 (the
    search pod starts before the load does)."""
    return [(float(t), float(w)) for t, w in waits if t >= 0]


def capacity_marks(rec: DemoRecord, gate: str) -> list[CapacityMark]:
    """The capacity changes of ``gate``'s server (the demo's ``capacity`` events), at their time,
    from and to the capacities of the samples' change nearest to it (the sample of the tick that
    made the change is stamped with the tick's start, just before the event, yet already shows
    the new capacity)."""
    seen = [
        (s.t, g.server_capacity)
        for s in rec.samples
        if (g := s.gates.get(gate)) is not None and g.server_capacity is not None
    ]
    changes = [(t, old, new) for (_, old), (t, new) in itertools.pairwise(seen) if old != new]
    marks = []
    for e in rec.events:
        if e.kind != "capacity" or e.gate != gate:
            continue
        near = min(changes, key=lambda c: abs(c[0] - e.t), default=None)
        before, after = (near[1], near[2]) if near is not None else (None, None)
        marks.append(CapacityMark(t=e.t, before=before, after=after))
    return marks


def over_lowered_limit(samples: Sequence[Sample], gate: str) -> list[OverLimit]:
    """Where ``gate``'s in-flight is above its limit after the limit came down (the leases granted
    under the higher limit run on until they finish; none is revoked)."""
    spans: list[OverLimit] = []
    highest: int | None = None
    run: list[tuple[float, int, int]] = []  # (t, in_flight, limit) of the open stretch

    def close(end: float) -> None:
        if run:
            _, peak, limit = max(run, key=lambda x: x[1])
            spans.append(OverLimit(start=run[0][0], end=end, in_flight=peak, limit=limit))
            run.clear()

    for s in samples:
        g = s.gates.get(gate)
        if g is None:
            continue
        if highest is not None and g.limit < highest and g.in_flight > g.limit:
            run.append((s.t, g.in_flight, g.limit))
        else:
            close(s.t)
        highest = g.limit if highest is None else max(highest, g.limit)
    close(samples[-1].t if samples else 0.0)
    return spans


def _series(samples: Sequence[Sample], gate: str, field: str) -> list[float]:
    """One field of one gate over the samples (NaN where it is unknown)."""
    out: list[float] = []
    for x in samples:
        g = x.gates.get(gate)
        v = getattr(g, field) if g is not None else None
        out.append(float("nan") if v is None else float(v))
    return out


def _mark_failover(ax: Any, rec: DemoRecord) -> None:
    """A vertical line where the leader was killed, shaded until the new leader published."""
    fo = rec.failover
    if fo is not None:
        ax.axvline(fo.kill_t, color="black", ls="--", lw=1.2, label="leader SIGKILLed")
        if fo.published_after is not None:
            end = fo.kill_t + fo.published_after
            ax.axvspan(fo.kill_t, end, color="gold", alpha=0.25, label="no live leader")


def _mark_capacity(ax: Any, rec: DemoRecord, info: GateInfo) -> None:
    """A vertical line where the server's capacity was changed, and from what to what."""
    for m in capacity_marks(rec, info.name):
        label = "server capacity changed"
        ax.axvline(m.t, color=CAPACITY_MARK_COLOUR, ls="-.", lw=1.4, label=label)
        what = f"{m.before} → {m.after}" if m.before is not None and m.after is not None else ""
        ax.text(
            m.t, 0.35, f"server capacity {what} ", transform=ax.get_xaxis_transform(),
            ha="right", va="center", fontsize=8, color=CAPACITY_MARK_COLOUR,
        )  # fmt: skip


def _mark_over_limit(ax: Any, samples: Sequence[Sample], info: GateInfo) -> None:
    """Hatch where in-flight sits above a lowered limit and say why it may, in a note beside it
    (right of it, or left when it is late in the run), up in the panel, clear of the lines. Spans
    a few seconds apart (a limit lowered in two steps) share the first one's note."""
    right = samples[-1].t if samples else 0.0
    noted: float | None = None  # the start of the last span with a note
    for span in over_lowered_limit(samples, info.name):
        ax.axvspan(span.start, span.end, fill=False, hatch="///", ec=OVER_LIMIT_COLOUR, lw=0,
                   label="in-flight above a lowered limit")  # fmt: skip
        if noted is not None and span.start - noted <= OVER_LIMIT_NOTE_APART:
            continue
        noted = span.start
        late = span.end > 0.75 * right
        ax.annotate(
            f"in-flight {span.in_flight} > limit {span.limit}:\n{_NEVER_REVOKES}",
            xy=(span.start, span.in_flight), xycoords="data",
            xytext=(span.start - 1.0 if late else span.end + 1.0, 0.75),
            textcoords=ax.get_xaxis_transform(), ha="right" if late else "left", va="center",
            fontsize=8, arrowprops={"arrowstyle": "->", "color": OVER_LIMIT_COLOUR},
            bbox={"boxstyle": "round", "fc": "white", "ec": OVER_LIMIT_COLOUR, "alpha": 0.9},
        )  # fmt: skip


def _plot_gate(ax: Any, rec: DemoRecord, samples: Sequence[Sample], info: GateInfo) -> None:
    """One gate's panel: server queue, capacity and running; fleet in-flight, limit, floor."""
    t = [x.t for x in samples]
    waiting = [0.0 if w != w else w for w in _series(samples, info.name, "server_waiting")]
    ax.fill_between(t, 0, waiting, step="post", color=SERVER_QUEUE_COLOUR, alpha=0.25,
                    label="server queue (saturation)")  # fmt: skip
    capacity = _series(samples, info.name, "server_capacity")
    ax.step(t, capacity, where="post", color="grey", ls="--", lw=1.2, label="server capacity")
    running = _series(samples, info.name, "server_running")
    ax.plot(t, running, color="tab:green", lw=1, alpha=0.8, label="server running")
    in_flight = _series(samples, info.name, "in_flight")
    ax.plot(t, in_flight, color="tab:orange", lw=1.4, label="fleet in-flight")
    limit = _series(samples, info.name, "limit")
    ax.step(t, limit, where="post", color="tab:blue", lw=2.2, label="limit (target, else floor)")
    ax.axhline(info.floor, color="tab:blue", ls=":", lw=1, label="floor")
    _mark_failover(ax, rec)
    _mark_capacity(ax, rec, info)
    _mark_over_limit(ax, samples, info)
    kind = "adaptive (AIMD on vLLM metrics)" if info.adaptive else "fixed"
    ax.set_title(f"gate {info.name} — {kind}, floor {info.floor}", loc="left", fontsize=10)
    ax.set_ylabel("requests")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)


def token_gates(rec: DemoRecord) -> list[GateInfo]:
    """The gates that get a token panel: those with a token budget recorded."""
    return [
        info
        for info in rec.gates
        if any((g := x.gates.get(info.name)) and g.token_limit is not None for x in rec.samples)
    ]


def _plot_tokens(ax: Any, rec: DemoRecord, samples: Sequence[Sample], info: GateInfo) -> None:
    """A gate's token panel: the budget in force (tuned from the configured token_limit), the
    tokens the fleet holds, the KV cache the server uses and states (dashed)."""
    t = [x.t for x in samples]
    used = [0.0 if v != v else v for v in _series(samples, info.name, "server_kv_used")]
    ax.fill_between(t, 0, used, step="post", color=KV_USED_COLOUR, alpha=0.2,
                    label="server KV cache used")  # fmt: skip
    ax.step(t, _series(samples, info.name, "server_kv_tokens"), where="post",
            color=STATED_KV_COLOUR, ls="--", lw=1.6, label=STATED_KV_LABEL, zorder=3)  # fmt: skip
    ax.plot(t, _series(samples, info.name, "tokens_held"), color=TOKENS_HELD_COLOUR, lw=1.4,
            label=TOKENS_HELD_LABEL)  # fmt: skip
    ax.step(t, _series(samples, info.name, "token_limit"), where="post", color=BUDGET_COLOUR,
            lw=2.2, label=BUDGET_LABEL)  # fmt: skip
    _mark_failover(ax, rec)
    _mark_capacity(ax, rec, info)
    run = token_budget_run(samples, info.name)
    if run is not None and run.reached_at is not None:
        late = run.reached_at > 0.6 * (samples[-1].t if samples else 0.0)  # the note's side
        ax.annotate(
            f"within {TOLERANCE:.0%} of the stated cache (in tokens used) at "
            f"{run.reached_at:.1f} s;\nconverged at {run.final:,} charged, "
            f"{run.final_in_use:,} used",
            xy=(run.reached_at, run.final), xycoords="data",
            xytext=(run.reached_at + (-1.0 if late else 1.0), 0.3),
            textcoords=ax.get_xaxis_transform(), ha="right" if late else "left", va="center",
            fontsize=8,
            arrowprops={"arrowstyle": "->", "color": BUDGET_COLOUR},
            bbox={"boxstyle": "round", "fc": "white", "ec": BUDGET_COLOUR, "alpha": 0.9},
        )  # fmt: skip
    start = f" from {info.token_limit:,}" if info.token_limit is not None else ""
    ax.set_title(
        f"gate {info.name} — {TOKEN_PANEL_TITLE}{start} (configured token_limit), tuned to "
        "fill the KV cache the server states with what calls use",
        loc="left",
        fontsize=10,
    )
    ax.set_ylabel("tokens")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)


def _plot_priority(ax: Any, rec: DemoRecord, samples: Sequence[Sample]) -> None:
    """The search pod's panel: each interactive call's wait (priority 10) and the rerank gate's
    queue, which the batch backlog (priority 0) keeps growing."""
    it = rec.interactive
    gate = it.get("gate", "")
    t = [x.t for x in samples]
    queued = [float(x.gates[gate].queued) if gate in x.gates else float("nan") for x in samples]
    right = ax.twinx()
    right.fill_between(t, 0, queued, step="post", color=BATCH_QUEUE_COLOUR, alpha=0.2)
    right.step(t, queued, where="post", color=BATCH_QUEUE_COLOUR, lw=1.2,
               label="batch queue (waiters in the gate)")  # fmt: skip
    right.set_ylabel("waiters in the gate", color=BATCH_QUEUE_COLOUR)
    right.set_ylim(bottom=0)
    waits = kept_waits(it.get("waits", []))
    ax.scatter([w[0] for w in waits], [w[1] for w in waits], s=6, color="tab:blue",
               label="interactive call wait (priority 10)", zorder=3)  # fmt: skip
    ax.set_ylabel("interactive wait (ms)", color="tab:blue")
    ax.set_ylim(bottom=0, top=max([w[1] for w in waits] + [50.0]) * 1.2)
    ax.set_zorder(right.get_zorder() + 1)
    ax.patch.set_visible(False)
    ax.set_title(
        f"gate {gate} — interactive calls (priority 10) vs a growing batch backlog (priority 0)",
        loc="left",
        fontsize=10,
    )
    ax.grid(alpha=0.3)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = right.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="upper left", fontsize=8)


def figure(rec: DemoRecord) -> Any:
    """The demo's figure: limit, fleet in-flight and server load per gate over time, the search
    pod's panel when it ran; from t = 0 (a ``matplotlib.figure.Figure`` on the Agg canvas)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    samples = kept_samples(rec)
    tokens = {info.name for info in token_gates(rec)}
    panels: list[tuple[Any, GateInfo]] = []  # (draw, gate): a gate's token panel follows it
    for info in rec.gates:
        panels.append((_plot_gate, info))
        if info.name in tokens:
            panels.append((_plot_tokens, info))
    n = len(panels)
    extra = 1 if rec.interactive.get("waits") else 0
    fig = Figure(figsize=(11, 2.9 * (n + extra)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(n + extra, 1, sharex=True, squeeze=False)[:, 0]
    legend: dict[str, Any] = {}  # label → handle, over every gate's panel, in order
    for ax, (draw, info) in zip(axes[:n], panels, strict=True):
        draw(ax, rec, samples, info)
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            legend.setdefault(label, handle)
    if extra:
        _plot_priority(axes[-1], rec, samples)
    fig.legend(list(legend.values()), list(legend), loc="outside lower center", ncol=4, fontsize=8)
    axes[-1].set_xlim(0, max(samples[-1].t if samples else 0.0, 1.0))
    axes[-1].set_xlabel("seconds since the load started")
    title = "fleetgate demo: fleet-wide limits follow the servers; failover keeps them"
    fo = rec.failover
    if fo is not None and fo.published_after is not None:
        title += f" (failover {fo.published_after:.1f} s)"
    fig.suptitle(title, fontsize=11)
    return fig


def plot(rec: DemoRecord, path: Path) -> None:
    """Draw :func:`figure` into ``path`` (PNG)."""
    figure(rec).savefig(str(path), dpi=100)
