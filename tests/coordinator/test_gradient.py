"""The latency-gradient controller (coordinator/gradient.py), the overload cut of metrics gates,
and the ``signal`` config field: pure functions, no I/O."""

from __future__ import annotations

import msgspec
import pytest

from fleetgate.coordinator.config import Config
from fleetgate.coordinator.controller import (
    ControllerParams,
    ControllerState,
    Decision,
    Reason,
)
from fleetgate.coordinator.gradient import (
    GradientParams,
    GradientState,
    LatencyView,
    cut_for_overload,
    load_gradient_state,
    overload_factor,
    step_latency,
)
from fleetgate.errors import ConfigError
from fleetgate.observed import Reading, bucket_of

P = GradientParams(floor=4, ceiling=512, poll_interval=2.0)


def window(
    ok: int, latency: float, overloaded: int = 0, timeout: int = 0, at: float = 1e6
) -> Reading:
    """A 2 s window ending at ``at`` (by default long after any move of the target)."""
    return Reading(
        at=at,
        ok=ok,
        overloaded=overloaded,
        timeout=timeout,
        lat_n=ok,
        lat_us=round(ok * latency * 1e6),
        buckets={bucket_of(latency): ok} if ok else {},
        seconds=2.0,
    )


def fifo(target: int, capacity: int, service: float = 0.2, queue: int | None = None) -> LatencyView:
    """A FIFO server of ``capacity`` slots with every permit in use: latency grows with the
    queue beyond the capacity; past ``queue`` waiting, calls are refused."""
    ok = max(1, int(min(target, capacity) / service * 2))
    refused = 0
    if queue is not None and target > capacity + queue:
        refused = int(ok * (target - capacity - queue) / target)
    w = window(ok, service * max(1.0, target / capacity), refused)
    return LatencyView(w, w, float(target))


def run(capacity: int, polls: int, p: GradientParams = P, **kw: int) -> list[tuple[int, str]]:
    state, trace, now = GradientState.initial(p), [], 0.0
    for _ in range(polls):
        now += p.poll_interval
        d = step_latency(state, fifo(state.target, capacity, **kw), p, now)
        trace.append((d.target, d.reason.value))
        state = d.state
    return trace


@pytest.mark.parametrize("capacity", [5, 16, 64, 200, 256, 500])
def test_ramp_reaches_the_capacity_and_holds_near_it(capacity: int) -> None:
    trace = run(capacity, 60, queue=capacity // 4)
    targets = [t for t, _ in trace]
    first = next(i for i, t in enumerate(targets) if t >= 0.9 * min(capacity, 512))
    assert first + 1 <= 10, trace[:12]
    steady = targets[20:]
    # latency at the steady target: <= (1 + buffer) x no-load plus one unit of headroom
    assert max(steady) <= max(capacity * 1.1 + 2, capacity + 2), trace
    assert min(steady) >= capacity, trace  # never below what the server runs without a queue
    assert all(r != "overload" for _, r in trace[20:])


def test_slow_start_doubles_then_the_gradient_lands_on_the_capacity() -> None:
    trace = run(100, 10)
    assert [t for t, _ in trace[:5]] == [8, 16, 32, 64, 128]
    assert trace[0][1] == "increase"
    # at 128 the latency is 1.28 x no-load: T x 1.1 / 1.28 + 1 = 111
    assert trace[5] == (111, "decrease")
    assert all(100 <= t <= 112 for t, _ in trace[6:])


def test_no_target_is_published_before_anyone_reports() -> None:
    idle = LatencyView(Reading(seconds=2.0), None, 0.0)
    d = step_latency(GradientState.initial(P), idle, P, 2.0)
    assert (d.target, d.reason, d.publish) == (4, Reason.HOLD_IDLE, False)


def test_unknown_window_holds_unpublished_then_resets() -> None:
    state = GradientState(target=100, no_load=0.2, slow_start=False)
    reasons = []
    for i in range(4):
        d = step_latency(state, LatencyView(None), P, 2.0 * i)
        reasons.append((d.target, d.reason.value, d.publish))
        state = d.state
    assert reasons == [
        (100, "hold_unknown", False),
        (100, "hold_unknown", False),
        (4, "reset", True),  # the floor, published once: the last target may still be live
        (4, "hold_unknown", False),
    ]
    assert state.no_load == 0.2  # the no-load latency is kept across the reset


def test_a_window_of_errors_only_is_unknown_and_a_thin_one_holds_published() -> None:
    """Every call failing says nothing of a queue: unknown, decaying to the floor (never
    the last target published for ever). A window with calls but too few ok
    latencies holds the target, published: the fleet does not use it (app-limited)."""
    state = GradientState(target=100, no_load=0.2, slow_start=False)
    errors = Reading(error=30, at=2.0, seconds=2.0)
    reasons = []
    for i in range(3):
        d = step_latency(state, LatencyView(errors, None, 5.0), P, 2.0 * i)
        reasons.append((d.target, d.reason.value, d.publish))
        state = d.state
    assert reasons == [
        (100, "hold_unknown", False),
        (100, "hold_unknown", False),
        (4, "reset", True),
    ]
    state = GradientState(target=100, no_load=0.2, slow_start=False)
    thin = Reading(ok=3, error=1, at=2.0, seconds=2.0)
    d = step_latency(state, LatencyView(thin, None, 3.0), P, 2.0)
    assert (d.target, d.reason.value, d.publish) == (100, "hold_idle", True)


def test_app_limited_fleet_does_not_grow_the_target() -> None:
    state = GradientState(target=100, no_load=0.2, slow_start=False)
    w = window(200, 0.2)
    d = step_latency(state, LatencyView(w, w, 10.0), P, 2.0)
    assert (d.target, d.reason) == (100, Reason.HOLD_IDLE)
    # but a latency rise cuts, whatever the load
    w = window(200, 0.4)
    d = step_latency(state, LatencyView(w, w, 10.0), P, 2.0)
    assert (d.target, d.reason) == (56, Reason.DECREASE)


def test_overload_cuts_by_the_share_refused_once_per_period() -> None:
    assert overload_factor(1000, 1, P) == 0.8
    assert overload_factor(100, 30, P) == pytest.approx(0.7)
    assert overload_factor(100, 90, P) == 0.5
    assert overload_factor(0, 0, P) == 0.5
    state = GradientState(target=200, no_load=0.2, slow_start=False)
    w = window(70, 0.2, overloaded=30)
    d = step_latency(state, LatencyView(w, w, 200.0), P, 10.0)
    assert (d.target, d.reason, d.saturated) == (140, Reason.OVERLOAD, True)
    again = step_latency(d.state, LatencyView(w, w, 140.0), P, 12.0)  # 1 poll later: too soon
    assert (again.target, again.reason) == (140, Reason.HOLD_COOLDOWN)
    later = step_latency(again.state, LatencyView(w, w, 140.0), P, 14.0)
    assert (later.target, later.reason) == (98, Reason.OVERLOAD)
    # timeouts count as congestion too; the cut stops at the floor
    low = GradientState(target=5, no_load=0.2)
    t = window(10, 0.2, timeout=10)
    d = step_latency(low, LatencyView(t, t, 5.0), P, 1.0)
    assert (d.target, d.reason, d.state.slow_start) == (4, Reason.OVERLOAD, False)
    floor = step_latency(d.state, LatencyView(t, t, 4.0), P, 100.0)
    assert (floor.target, floor.reason) == (4, Reason.CLAMP)


def test_no_load_is_remeasured_below_the_target_and_may_rise() -> None:
    p = msgspec.structs.replace(P, remeasure_polls=3)
    state = GradientState(target=100, no_load=0.2, slow_start=False)
    seen = []
    for i in range(8):
        # the server became slower per call: 0.3 s without a queue (capacity 120)
        d = step_latency(state, fifo(state.target, 120, service=0.3), p, 2.0 * i)
        seen.append((d.target, d.reason.value))
        state = d.state
    # the latency reads as a queue at first (cuts), then the 3rd poll measures below the target
    assert [r for _, r in seen[:6]] == ["decrease", "decrease"] + ["measure_no_load"] * 4
    assert seen[2][0] == seen[1][0] // 2  # measured at half the target ...
    assert seen[5][0] == seen[1][0]  # ... which returns afterwards
    assert state.no_load == pytest.approx(0.3, rel=0.05)  # the new, higher no-load latency
    assert seen[6][1] == "increase" and seen[7][1] == "increase"


def test_a_gate_stuck_at_the_floor_takes_its_latency_as_the_baseline() -> None:
    state = GradientState(target=4, no_load=0.1, slow_start=False)
    for i in range(P.floor_polls):
        w = window(40, 0.5)
        d = step_latency(state, LatencyView(w, w, 4.0), P, 2.0 * i)
        state = d.state
    assert state.no_load == pytest.approx(0.5, rel=0.05)
    assert d.target == 5  # flat at the new baseline: it grows again


def test_metrics_gates_are_cut_by_overload_reports_and_remember_it() -> None:
    params = ControllerParams(floor=4, ceiling=512, poll_interval=2.0)
    held = Decision(
        ControllerState(target=200, slow_start=False, capacity=256.0), 200, Reason.HOLD_IDLE, True
    )
    assert cut_for_overload(held, None, params, 10.0) is held
    assert cut_for_overload(held, window(100, 0.1), params, 10.0) is held
    d = cut_for_overload(held, window(90, 0.1, overloaded=10), params, 10.0)
    assert (d.target, d.reason, d.state.capacity, d.state.last_decrease) == (
        160,
        Reason.OVERLOAD,
        160.0,
        10.0,
    )
    # within the drain period of a decrease: no second cut
    assert cut_for_overload(d, window(90, 0.1, overloaded=10), params, 10.5) is d
    static = msgspec.structs.replace(params, adaptive=False)
    assert cut_for_overload(held, window(1, 0.1, overloaded=1), static, 10.0) is held


def test_state_round_trip_and_foreign_states() -> None:
    s = GradientState(target=77, no_load=0.25, slow_start=False, last_cut=3.0)
    assert load_gradient_state(msgspec.json.encode(s), P) == s
    assert load_gradient_state(msgspec.json.encode(ControllerState(target=9)), P).target == 4
    assert load_gradient_state(b"garbage", P).target == 4
    assert load_gradient_state(None, P).target == 4
    assert load_gradient_state(msgspec.json.encode(GradientState(target=9999)), P).target == 512
    # its last target ran out: the floor, the no-load latency kept
    lapsed = load_gradient_state(msgspec.json.encode(s), P, lapsed=True)
    assert lapsed == GradientState(target=4, no_load=0.25)


def test_adaptation_off_is_static() -> None:
    off = msgspec.structs.replace(P, adaptive=False)
    d = step_latency(GradientState(target=50), fifo(50, 100), off, 1.0)
    assert (d.target, d.reason, d.publish) == (4, Reason.STATIC, False)


def _gate(**kw: object) -> Config:
    return Config.from_mapping({"gates": [{"name": "g", "floor": 2, **kw}]}, env={})


def test_signal_config_field() -> None:
    assert _gate().gates[0].latency_driven
    assert not _gate(signal="fixed").gates[0].latency_driven
    assert not _gate(base_url="http://m/v1").gates[0].latency_driven
    assert _gate(signal="latency").gates[0].latency_driven
    with pytest.raises(ConfigError, match=r"gates\[0\]\.signal: expected one of auto"):
        _gate(signal="gauges")
    with pytest.raises(ConfigError, match=r"gates\[0\]\.signal: 'metrics' needs base_url"):
        _gate(signal="metrics")
    with pytest.raises(ConfigError, match=r"gates\[0\]\.signal: 'latency' reads no metrics"):
        _gate(signal="latency", base_url="http://m/v1")
    latency = GradientParams.for_gate(_gate().gates[0], _gate().coordinator)
    assert latency.adaptive and latency.floor == 2
    gates = {"gates": [{"name": "g", "floor": 2}]}
    off = Config.from_mapping(gates, env={"FLEETGATE_ADAPTIVE": "0"})
    assert not GradientParams.for_gate(off.gates[0], off.coordinator).adaptive


def test_growth_waits_for_a_window_that_saw_the_current_target() -> None:
    """A window whose calls began before the last change does not show its queue yet: no
    increase on it (a cut never waits); nor does it lower the no-load latency after a big move."""
    state = GradientState(target=100, no_load=0.2, slow_start=False, changed_at=10.0, moved_at=10.0)
    stale = window(200, 0.19, at=11.0)  # began at 9.0, before the change at 10.0
    d = step_latency(state, LatencyView(stale, stale, 100.0), P, 11.0)
    assert (d.target, d.reason) == (100, Reason.HOLD_COOLDOWN)
    assert d.state.no_load == 0.2  # unsettled: the low median is not taken
    slow = window(200, 0.4, at=11.0)
    assert step_latency(state, LatencyView(slow, slow, 100.0), P, 11.0).reason == Reason.DECREASE
    fresh = window(200, 0.2, at=14.0)  # began at 12.0 >= 10.0 + p50
    d = step_latency(state, LatencyView(fresh, fresh, 100.0), P, 14.0)
    assert (d.target, d.reason, d.state.changed_at) == (111, Reason.INCREASE, 14.0)
