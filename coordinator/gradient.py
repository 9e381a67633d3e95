"""The latency-gradient controller: one pure step per poll for gates driven by what callers see.

For a gate with ``signal = "latency"`` (or no metrics source) the coordinator has no server
gauge, only the fleet's reports (:mod:`fleetgate.observed`): per poll, the calls that ended ok,
overloaded (429/503/529) or timed out, and the latency distribution of the ok ones. Queueing
in the server shows as latency above the **no-load latency**; the rule takes that ratio as a
gradient (Envoy's adaptive-concurrency gradient controller, Netflix concurrency-limits'
Gradient2; ``docs/aimd.md`` cites what is taken from each)::

    gradient = clamp((1 + buffer) * no_load / p50, min_gradient, 1 + buffer)
    T'       = T * gradient + headroom

With every permit in use and a FIFO server, ``T * no_load / p50`` is Little's law's estimate
of what the server runs without queueing (throughput x no-load latency), so one step lands
near the capacity; ``buffer`` is the queue allowed on top (steady p50 ~ (1 + buffer) x no-load).
Before the first latency rise the target doubles per near-full poll (slow start, as the metrics
controller). Overload outcomes cut multiplicatively (:func:`overload_factor`), also on gates
driven by metrics (:func:`cut_for_overload`). The no-load latency is the lowest p50 seen,
re-measured every ``remeasure_polls`` by halving the target for a few polls (Envoy's periodic
minRTT window; a long-window minimum alone would only ever fall), or at once after
``floor_polls`` polls at the floor (Envoy's "minimum for 5 windows" trigger).

No I/O and no clock reads: ``now`` comes from the caller (Redis server time), like
:func:`.controller.step`. The values the rule works on (:class:`GradientParams`,
:class:`GradientState`, :class:`LatencyView`, :class:`GradientDecision`) are defined in
:mod:`.gradient_types` and exported here too.
"""

from __future__ import annotations

import math

import msgspec

from fleetgate.observed import Reading, median_error, typical_latency

from .control import Reason
from .controller_types import ControllerParams, Decision
from .gradient_types import GradientDecision, GradientParams, GradientState, LatencyView

__all__ = [
    "GradientDecision",
    "GradientParams",
    "GradientState",
    "LatencyView",
    "cut_for_overload",
    "load_gradient_state",
    "overload_factor",
    "step_latency",
    "unknown_latency_poll",
]

_EPS = 1e-9


def overload_factor(calls: int, overloaded: int, p: GradientParams) -> float:
    """The cut for ``overloaded`` of ``calls`` calls: the share the server accepted, between
    ``deepest_cut`` and ``overload_cut`` (one 429 in thousands cuts 20 %; half refused, half)."""
    accepted = 1 - overloaded / calls if calls > 0 else 0.0
    return min(p.overload_cut, max(p.deepest_cut, accepted))


def _clamp(value: float, p: GradientParams) -> int:
    return max(p.floor, min(p.ceiling, math.floor(value + _EPS)))


def _may_cut(last_cut: float | None, now: float, p: GradientParams) -> bool:
    if last_cut is None or now < last_cut:  # a clock that stepped back never blocks a cut
        return True
    return now - last_cut >= p.cut_polls * p.poll_interval


def step_latency(
    state: GradientState, view: LatencyView | None, p: GradientParams, now: float
) -> GradientDecision:
    """Advance one latency-driven gate by one poll. Pure: same inputs, same decision.

    (:func:`_step` decides; this notes when the target moved by much, see :func:`_settled`.)
    """
    d = _step(state, view, p, now)
    old = max(1, state.target)
    if d.target != state.target:
        moved = now if abs(d.target - old) > p.settle_change * old else d.state.moved_at
        new = msgspec.structs.replace(d.state, moved_at=moved, changed_at=now)
        d = msgspec.structs.replace(d, state=new)
    return d


def _step(
    state: GradientState, view: LatencyView | None, p: GradientParams, now: float
) -> GradientDecision:
    """Advance one latency-driven gate by one poll.

    In order: an unknown window (no difference to read, or errors only) holds (unpublished;
    reset after ``unknown_reset_polls``);
    overload or timeout outcomes cut; a no-load measurement under way continues; no latency
    window holds; otherwise slow start or the gradient step, after a due re-measurement.
    """
    if not p.adaptive:
        return GradientDecision(GradientState.initial(p), p.floor, Reason.STATIC, False)
    target = _clamp(state.target, p)
    state = msgspec.structs.replace(state, target=target)
    if view is None or view.outcomes is None or _errors_only(view.outcomes):
        return unknown_latency_poll(state, p)
    state = msgspec.structs.replace(state, unknown_streak=0)
    p50, se = _median(view.latency)
    if view.outcomes.overloaded + view.outcomes.timeout > 0:
        return _cut(state, view.outcomes, p, now, p50)
    if state.measuring:
        return _measure(state, None if p50 is None else p50 + 2 * se, p, p50)
    if p50 is None:
        # Nothing published until the callers report: a gate nobody reports for stays at its
        # floor exactly as a fixed gate does (no target in its status).
        untouched = state.no_load is None and target == p.floor
        return GradientDecision(state, target, Reason.HOLD_IDLE, not untouched, False, p50)
    state = _rebase(state, view, p, p50, p50 + 2 * se)
    if state.since_measure >= p.remeasure_polls and target > p.floor:
        return _start_measuring(state, p, now)
    return _follow(state, view, p, p50, se)


def _median(latency: Reading | None) -> tuple[float | None, float]:
    """The window's median latency (None: no usable one) and its standard error (seconds).

    The no-load estimate takes p50 + 2 se (a minimum of noisy medians would sink below the
    truth and read every later median as a queue), a queue must exceed the buffer by 2 se to
    end slow start, and the gradient reads p50 - se.
    """
    p50 = typical_latency(latency) if latency is not None else None
    if p50 is None or not (p50 > 0 and math.isfinite(p50)):
        return None, 0.0  # latencies reported as 0 (allowed, sub-resolution) say nothing
    return p50, p50 * median_error(latency) if latency else 0.0


def _cut(
    state: GradientState, w: Reading, p: GradientParams, now: float, p50: float | None
) -> GradientDecision:
    """Callers saw overloads or timeouts: cut by the share refused (once per ``cut_polls``),
    from the target a measurement under way would return to."""
    target = state.target
    if not _may_cut(state.last_cut, now, p):
        return GradientDecision(state, target, Reason.HOLD_COOLDOWN, True, True, p50)
    base = state.resume if state.measuring and state.resume is not None else target
    cut = _clamp(base * overload_factor(w.calls, w.overloaded + w.timeout, p), p)
    new = msgspec.structs.replace(
        state,
        target=cut,
        slow_start=False,
        last_cut=now,
        measuring=0,
        resume=None,
        measured=None,
    )
    reason = Reason.OVERLOAD if cut < target else Reason.CLAMP
    return GradientDecision(new, cut, reason, True, True, p50)


def _rebase(
    state: GradientState, view: LatencyView, p: GradientParams, p50: float, candidate: float
) -> GradientState:
    """The no-load latency after this window (``candidate``: its p50 + 2 se), and the polls
    counted toward a re-measurement."""
    no_load = state.no_load
    if no_load is None or (candidate < no_load and _settled(state, view, p50)):
        no_load = candidate
    floor_streak = state.floor_streak + 1 if state.target <= p.floor else 0
    since = state.since_measure + 1
    if floor_streak >= p.floor_polls:
        # At the floor for a while: the latency seen there is the new baseline (a server
        # that became slower per call would otherwise hold the gate at the floor for ever).
        no_load, floor_streak, since = candidate, 0, 0
    return msgspec.structs.replace(
        state, no_load=no_load, floor_streak=floor_streak, since_measure=since
    )


def _follow(
    state: GradientState, view: LatencyView, p: GradientParams, p50: float, se: float
) -> GradientDecision:
    """Slow start while no queue shows, else the gradient step toward ``(1 + buffer)`` times
    the no-load latency; growth only while the fleet uses its target and the window saw it."""
    target, no_load = state.target, state.no_load
    assert no_load is not None  # (_rebase)
    loads = [v for v in (view.in_flight, view.latency.busy if view.latency else None) if v]
    near_full = bool(loads) and max(loads) >= p.near_full * target
    queueing = p50 - 2 * se > (1 + p.buffer) * no_load
    if state.slow_start and not queueing:
        if not near_full:
            return GradientDecision(state, target, Reason.HOLD_IDLE, True, False, p50)
        grown = _clamp(max(target + 1, target * p.slow_start_factor), p)
        new = msgspec.structs.replace(state, target=grown)
        return GradientDecision(new, grown, _grew(grown, target), True, False, p50)

    seen = max(no_load, p50 - se)
    gradient = min(1 + p.buffer, max(p.min_gradient, (1 + p.buffer) * no_load / seen))
    wanted = _clamp(target * gradient + p.headroom, p)
    if wanted > target and not near_full:
        # App-limited (Gradient2's guard): the fleet does not use the target it has.
        new = msgspec.structs.replace(state, slow_start=False)
        return GradientDecision(new, target, Reason.HOLD_IDLE, True, queueing, p50)
    if wanted > target and not _saw_target(state, view, p50):
        # The window's calls mostly began before the last change: its latency does not show
        # the queue of the current target yet. Growing on it overshot the server's 429 bound
        # poll after poll (benchmarks/latency.py); a cut never waits.
        new = msgspec.structs.replace(state, slow_start=False)
        return GradientDecision(new, target, Reason.HOLD_COOLDOWN, True, queueing, p50)
    new = msgspec.structs.replace(state, target=wanted, slow_start=False)
    if wanted > target:
        reason = _grew(wanted, target)
    elif wanted < target:
        reason = Reason.DECREASE
    else:
        reason = Reason.HOLD_CAPACITY
    return GradientDecision(new, wanted, reason, True, queueing, p50)


def _from_floor(state: GradientState, p: GradientParams) -> GradientState:
    """Once the last published target has run out: the floor, the no-load latency kept."""
    return GradientState(target=p.floor, no_load=state.no_load)


def unknown_latency_poll(state: GradientState, p: GradientParams) -> GradientDecision:
    """A poll with nothing to read (see :func:`step_latency`): held, unpublished; the floor
    (the no-load latency kept, published once) after ``unknown_reset_polls`` of them."""
    target = _clamp(state.target, p)
    streak = state.unknown_streak + 1
    if streak >= p.unknown_reset_polls:
        # As the AIMD controller's reset: the floor is published once (the last target may
        # outlive these polls by a leader takeover: CoordinatorSettings.target_ttl).
        reset = msgspec.structs.replace(_from_floor(state, p), unknown_streak=streak)
        first = streak == p.unknown_reset_polls
        reason = Reason.RESET if first else Reason.HOLD_UNKNOWN
        return GradientDecision(reset, p.floor, reason, first and target > p.floor)
    held = msgspec.structs.replace(state, target=target, unknown_streak=streak)
    return GradientDecision(held, target, Reason.HOLD_UNKNOWN, False)


def _errors_only(w: Reading) -> bool:
    """Every call of the window failed with an error (no answer, a 5xx other than overload):
    nothing about the server's queue, so the poll is unknown (a server failing every call must
    not keep the last target published for ever)."""
    return w.error > 0 and w.ok + w.overloaded + w.timeout == 0


def _grew(new: int, old: int) -> Reason:
    return Reason.CLAMP if new == old else Reason.INCREASE


def _saw_target(state: GradientState, view: LatencyView, p50: float) -> bool:
    """Whether the latency window began a p50 after the target last changed."""
    if state.changed_at is None or view.latency is None:
        return True
    return view.latency.at - view.latency.seconds >= state.changed_at + p50


def _settled(state: GradientState, view: LatencyView, p50: float) -> bool:
    """Whether the latency window began a p50 after the target last moved by much.

    Right after a step up, the calls that complete first are the short ones (the new callers
    started together), so a window then reads low: with 2 s calls and 2 s polls, a slow start
    saw medians of 1.2-1.5 s for a true 1.8 s and the gate then held 40 % of the capacity
    (benchmarks/latency.py). Such windows update the p50, never the no-load latency.
    """
    if state.moved_at is None or view.latency is None:
        return True
    began = view.latency.at - view.latency.seconds
    return began >= state.moved_at + p50


def _start_measuring(state: GradientState, p: GradientParams, now: float) -> GradientDecision:
    """Lower the target for a few polls to see the latency without our queue."""
    low = _clamp(state.target * p.measure_factor, p)
    no_load = state.no_load or 0.0
    polls = 2 + math.ceil(no_load / p.poll_interval)  # one to drain, one clean, + slow calls
    new = msgspec.structs.replace(
        state, target=low, measuring=polls, resume=state.target, measured=None, moved_at=now
    )
    return GradientDecision(new, low, Reason.MEASURE, True, False, None)


def _measure(
    state: GradientState, sample: float | None, p: GradientParams, p50: float | None
) -> GradientDecision:
    """A measurement poll: keep the lowest sample (p50 + 2 se); at the end it becomes the
    no-load latency and the target returns to where it was."""
    measured = state.measured
    if sample is not None:
        measured = sample if measured is None else min(measured, sample)
    left = state.measuring - 1
    if left > 0:
        new = msgspec.structs.replace(state, measuring=left, measured=measured)
        return GradientDecision(new, state.target, Reason.MEASURE, True, False, p50)
    resume = _clamp(state.resume if state.resume is not None else state.target, p)
    new = msgspec.structs.replace(
        state,
        target=resume,
        measuring=0,
        resume=None,
        measured=None,
        since_measure=0,
        no_load=measured if measured is not None else state.no_load,
    )
    return GradientDecision(new, resume, Reason.MEASURE, True, False, p50)


def cut_for_overload(
    decision: Decision, window: Reading | None, params: ControllerParams, now: float
) -> Decision:
    """A metrics-driven gate's decision, cut when callers saw overloads in ``window``.

    A server that refuses calls (TGI/TEI's 429 past ``--max-concurrent-requests``, a NIM's
    503) is over its admission limit whatever its gauges say. The cut is taken from the
    current target (as :func:`overload_factor`), at most once per drain period of the metrics
    controller, and is remembered as its capacity, so the ramp stops there instead of
    returning to the level that was refused.
    """
    if window is None or window.overloaded <= 0 or not params.adaptive:
        return decision
    state = decision.state
    last = state.last_decrease
    if last is not None and 0 <= now - last < params.min_decrease_polls * params.poll_interval:
        return decision
    g = GradientParams.from_params(params)
    base = min(decision.target, state.target)
    cut = _clamp(base * overload_factor(window.calls, window.overloaded, g), g)
    if cut >= decision.target:
        return decision
    new = msgspec.structs.replace(
        state,
        target=cut,
        capacity=float(cut),
        kv_capacity=None,
        slow_start=False,
        last_decrease=now,
        drained=False,
        recovering=True,
        near_full_streak=0,
        probes=0,
    )
    return Decision(new, cut, Reason.OVERLOAD, publish=True, saturated=True)


def load_gradient_state(
    data: bytes | str | None, params: GradientParams, *, lapsed: bool = False
) -> GradientState:
    """The stored state, clamped; a fresh one if absent, unreadable or the metrics
    controller's (a gate that changed its signal starts cold, which is always safe).
    ``lapsed``: the last published target has run out: the floor, keeping the no-load
    latency (as :func:`.controller.load_state`)."""
    if not data:
        return GradientState.initial(params)
    try:
        raw = msgspec.json.decode(data)
        if not isinstance(raw, dict) or raw.get("kind") != "latency":
            return GradientState.initial(params)  # the metrics controller's state, or junk
        state = msgspec.convert(raw, GradientState)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return GradientState.initial(params)
    if lapsed:
        return _from_floor(state, params)
    return msgspec.structs.replace(state, target=_clamp(state.target, params))
