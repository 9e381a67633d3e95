"""The AIMD step: a pure function, tested rule by rule, by simulation and by property."""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetgate.coordinator.controller import (
    ControllerParams,
    ControllerState,
    Decision,
    Observation,
    Reason,
    dump_state,
    load_state,
    step,
)
from fleetgate.coordinator.scrape.signals import Signals
from fleetgate.errors import ConfigError

P = ControllerParams(floor=4, ceiling=512, poll_interval=12.0)


def busy(target: int, **kw: float) -> Observation:
    """Fleet in-flight at the target, engine keeping up (no capacity-waiting)."""
    return Observation(
        running=kw.get("running", target), waiting_capacity=0, in_flight=kw.get("in_flight", target)
    )


def saturated(running: float, in_flight: float, waiting: float = 5) -> Observation:
    return Observation(running=running, waiting_capacity=waiting, in_flight=in_flight)


def state(target: int, **kw: object) -> ControllerState:
    return msgspec.structs.replace(ControllerState(target=target), **kw)


# --------------------------------------------------------------------------------- the rules


def test_slow_start_doubles_when_near_full() -> None:
    d = step(ControllerState.initial(P), busy(4), P, now=0)
    assert (d.target, d.reason, d.publish, d.saturated) == (8, Reason.SLOW_START, True, False)
    assert d.state.slow_start


def test_additive_increase_after_slow_start() -> None:
    s = state(100, slow_start=False)
    d = step(s, busy(100), P, now=0)
    assert (d.target, d.reason) == (125, Reason.INCREASE)
    d = step(state(5, slow_start=False), busy(5), P, now=0)
    assert d.target == 6  # max(1, 25 %)


def test_near_full_uses_fleet_in_flight_then_running() -> None:
    s = state(100, slow_start=False)
    # In-flight below 80 % of the target: hold, even if the engine is busy with other traffic.
    d = step(s, Observation(running=500, waiting_capacity=0, in_flight=79), P, now=0)
    assert d.reason is Reason.HOLD_IDLE and d.target == 100
    d = step(s, Observation(running=500, waiting_capacity=0, in_flight=80), P, now=0)
    assert d.reason is Reason.INCREASE
    # In-flight unknown: running stands in for it.
    d = step(s, Observation(running=80, waiting_capacity=0, in_flight=None), P, now=0)
    assert d.reason is Reason.INCREASE
    d = step(s, Observation(running=10, waiting_capacity=0, in_flight=None), P, now=0)
    assert d.reason is Reason.HOLD_IDLE
    d = step(s, Observation(running=None, waiting_capacity=0, in_flight=None), P, now=0)
    assert d.reason is Reason.HOLD_IDLE and d.publish


def test_idle_holds() -> None:
    s = state(64, slow_start=False)
    for n in range(5):
        d = step(s, busy(64, in_flight=3, running=3), P, now=12.0 * n)
        assert (d.target, d.reason, d.publish) == (64, Reason.HOLD_IDLE, True)
        s = d.state


def test_decrease_to_the_sustainable_level() -> None:
    s = state(200, slow_start=False)
    # The engine serves 120 of our 200 in flight: cut straight to that level.
    d = step(s, saturated(running=120, in_flight=200, waiting=80), P, now=0)
    assert (d.target, d.reason, d.publish, d.saturated) == (120, Reason.DECREASE, True, True)
    # Slightly over: a small, exact cut (no forced 20 % undershoot).
    d = step(s, saturated(running=195, in_flight=200, waiting=5), P, now=0)
    assert d.target == 195


def test_decrease_sees_other_traffic_through_fleet_in_flight() -> None:
    # Engine capacity 100, 30 slots taken by clients outside the fleet: running stays 100,
    # 30 of our 100 wait. Our sustainable share is 70.
    d = step(
        state(100, slow_start=False), saturated(running=100, in_flight=100, waiting=30), P, now=0
    )
    assert d.target == 70


def test_decrease_cuts_at_most_half() -> None:
    s = state(200, slow_start=False)
    assert step(s, saturated(running=30, in_flight=200, waiting=170), P, now=0).target == 100
    assert step(s, saturated(running=0, in_flight=5, waiting=400), P, now=0).target == 100


def test_decrease_without_estimate_is_twenty_percent() -> None:
    s = state(200, slow_start=False)
    for obs in (
        Observation(running=None, waiting_capacity=3, in_flight=None),
        Observation(running=0, waiting_capacity=3, in_flight=None),
        Observation(running=math.nan, waiting_capacity=3, in_flight=None),
        # Leases left over from a higher target: the estimate is above the target.
        Observation(running=250, waiting_capacity=5, in_flight=300),
    ):
        d = step(s, obs, P, now=0)
        assert (d.target, d.reason) == (160, Reason.DECREASE)
    nan_running = Observation(running=math.nan, waiting_capacity=5, in_flight=200)
    assert step(s, nan_running, P, now=0).target == 195


def test_decrease_never_below_floor() -> None:
    p = ControllerParams(floor=10, ceiling=100)
    d = step(state(12, slow_start=False), saturated(running=2, in_flight=12), p, now=0)
    assert (d.target, d.reason) == (10, Reason.DECREASE)
    d = step(d.state, saturated(running=2, in_flight=10), p, now=100)
    assert (d.target, d.reason) == (10, Reason.CLAMP)


def test_first_saturation_ends_slow_start() -> None:
    s = ControllerState.initial(P)
    d = step(state(64), saturated(running=50, in_flight=64), P, now=0)
    assert not d.state.slow_start and d.target == 50
    # At the floor a saturation cannot cut, but it still ends slow start.
    d = step(s, saturated(running=4, in_flight=4), P, now=0)
    assert d.reason is Reason.CLAMP and not d.state.slow_start and d.state.capacity == 4
    # The floor is remembered as the capacity: hold there, then probe (+max(1, 5 %)).
    for n in range(1, P.probe_polls):
        d = step(d.state, busy(4), P, now=12 * n)
        assert (d.reason, d.target) == (Reason.HOLD_CAPACITY, 4)
    d = step(d.state, busy(4), P, now=12 * P.probe_polls)
    assert (d.reason, d.target) == (Reason.PROBE, 5)


def test_one_decrease_per_drain_period() -> None:
    d = step(state(100, slow_start=False), saturated(running=50, in_flight=100), P, now=0)
    assert (d.target, d.reason) == (50, Reason.DECREASE)
    # Next poll: still saturated, but our old excess is still in flight (leases are not
    # revoked), so the cut has not taken effect yet.
    d = step(d.state, saturated(running=50, in_flight=90), P, now=12)
    assert (d.target, d.reason, d.publish) == (50, Reason.HOLD_COOLDOWN, True)
    # The excess has drained and the engine still queues: the cut was not enough, cut again.
    d = step(d.state, saturated(running=45, in_flight=50), P, now=24)
    assert (d.target, d.reason) == (45, Reason.DECREASE)


def test_no_second_decrease_within_half_a_poll() -> None:
    d = step(state(100, slow_start=False), saturated(running=50, in_flight=100), P, now=0)
    d = step(d.state, saturated(running=40, in_flight=40), P, now=5.9)
    assert d.reason is Reason.HOLD_COOLDOWN
    d = step(d.state, saturated(running=40, in_flight=40), P, now=6.0)
    assert d.reason is Reason.DECREASE


def test_drain_period_ends_after_timeout_when_in_flight_unknown() -> None:
    d = step(state(100, slow_start=False), saturated(running=50, in_flight=100), P, now=0)
    obs = Observation(running=50, waiting_capacity=5, in_flight=None)
    for now in (12.0, 24.0):
        d = step(d.state, obs, P, now=now)
        assert d.reason is Reason.HOLD_COOLDOWN
    d = step(d.state, obs, P, now=36.0)
    assert (d.reason, d.target) == (Reason.DECREASE, 40)


def test_drained_queue_ends_the_drain_period() -> None:
    d = step(state(100, slow_start=False), saturated(running=50, in_flight=100), P, now=0)
    d = step(d.state, Observation(running=50, waiting_capacity=0, in_flight=70), P, now=12)
    assert d.state.drained
    d = step(d.state, saturated(running=50, in_flight=70), P, now=24)
    assert d.reason is Reason.DECREASE


def test_clock_going_back_does_not_block_a_cut() -> None:
    d = step(state(100, slow_start=False), saturated(running=50, in_flight=100), P, now=1000)
    d = step(d.state, saturated(running=50, in_flight=90), P, now=10)
    assert d.reason is Reason.DECREASE


def test_after_a_decrease_the_target_holds_at_the_remembered_capacity() -> None:
    # The cut level is the capacity estimate and the target stays there (no +25 % after one
    # poll: no 256, 256, 320 sawtooth).
    d = step(state(100, slow_start=False), saturated(running=80, in_flight=100), P, now=0)
    assert d.target == 80 and d.state.recovering and d.state.capacity == 80
    for n in range(1, P.probe_polls):
        d = step(d.state, busy(80), P, now=12 * n)
        assert (d.target, d.reason, d.publish) == (80, Reason.HOLD_CAPACITY, True)


def test_hysteresis_after_a_decrease_without_capacity_memory() -> None:
    # A state stored by the previous version: recovering from a cut, no capacity remembered.
    s = state(80, slow_start=False, last_decrease=0.0, recovering=True)
    d = step(s, busy(80), P, now=12)
    assert (d.target, d.reason, d.publish) == (80, Reason.HOLD_HYSTERESIS, True)
    d = step(d.state, busy(80), P, now=24)
    assert (d.target, d.reason) == (100, Reason.INCREASE)
    # Once recovered, every near-full poll increases.
    d = step(d.state, busy(100), P, now=36)
    assert (d.target, d.reason) == (125, Reason.INCREASE)


def test_hysteresis_streak_resets_on_an_idle_poll() -> None:
    s = state(80, slow_start=False, last_decrease=0.0, recovering=True)
    d = step(s, busy(80), P, now=12)
    d = step(d.state, busy(80, in_flight=10), P, now=24)
    assert d.reason is Reason.HOLD_IDLE
    d = step(d.state, busy(80), P, now=36)
    assert d.reason is Reason.HOLD_HYSTERESIS


def test_never_above_ceiling() -> None:
    p = ControllerParams(floor=4, ceiling=50)
    d = step(state(40), busy(40), p, now=0)
    assert (d.target, d.reason) == (50, Reason.SLOW_START)
    d = step(d.state, busy(50), p, now=12)
    assert (d.target, d.reason) == (50, Reason.CLAMP)


def test_bounds_changed_under_a_stored_state() -> None:
    d = step(state(300, slow_start=False), busy(300, in_flight=0), P, now=0)
    assert d.target == 300
    tighter = ControllerParams(floor=4, ceiling=100)
    d = step(state(300, slow_start=False), busy(300, in_flight=0), tighter, now=0)
    assert (d.target, d.reason) == (100, Reason.CLAMP)
    higher_floor = ControllerParams(floor=20, ceiling=100)
    d = step(state(5, slow_start=False), busy(5, in_flight=0), higher_floor, now=0)
    assert (d.target, d.reason) == (20, Reason.CLAMP)


def test_unknown_holds_unpublished_then_resets_to_floor() -> None:
    s = state(200, slow_start=False, last_decrease=0.0, recovering=True)
    unknowns: list[Observation | None] = [
        None,
        Observation(running=10, waiting_capacity=None, in_flight=5),
        Observation(running=None, waiting_capacity=0, in_flight=5, ok=False),
    ]
    d = step(s, unknowns[0], P, now=12)
    assert (d.target, d.reason, d.publish) == (200, Reason.HOLD_UNKNOWN, False)
    d = step(d.state, unknowns[1], P, now=24)
    assert (d.target, d.reason, d.publish) == (200, Reason.HOLD_UNKNOWN, False)
    # Third unknown poll -> floor, slow start; the floor is published once (the last target
    # may still be live: its lifetime includes a leader takeover, config.target_ttl).
    d = step(d.state, unknowns[2], P, now=36)
    assert (d.target, d.reason, d.publish) == (4, Reason.RESET, True)
    assert d.state.slow_start and d.state.last_decrease is None
    d = step(d.state, None, P, now=48)
    assert (d.target, d.reason, d.publish) == (4, Reason.HOLD_UNKNOWN, False)
    # Signals come back: ramp from the floor again.
    d = step(d.state, busy(4), P, now=60)
    assert (d.target, d.reason, d.publish) == (8, Reason.SLOW_START, True)
    assert d.state.unknown_streak == 0


def test_a_good_poll_resets_the_unknown_streak() -> None:
    d = step(state(200, slow_start=False), None, P, now=0)
    d = step(d.state, None, P, now=12)
    d = step(d.state, busy(200, in_flight=0), P, now=24)
    d = step(d.state, None, P, now=36)
    assert (d.target, d.reason) == (200, Reason.HOLD_UNKNOWN)


def test_proven_saturation_acts_on_a_partial_view() -> None:
    partial = Observation(running=None, waiting_capacity=6, in_flight=100, ok=False)
    d = step(state(100, slow_start=False), partial, P, now=0)
    assert (d.target, d.reason, d.publish) == (94, Reason.DECREASE, True)
    d = step(d.state, partial, P, now=12)
    assert (d.reason, d.publish) == (Reason.HOLD_COOLDOWN, False)


def test_static_when_adaptation_is_off() -> None:
    off = ControllerParams(floor=16, ceiling=512, adaptive=False)
    for obs in (busy(300), saturated(10, 300), None):
        d = step(state(300, slow_start=False), obs, off, now=0)
        assert (d.target, d.reason, d.publish) == (16, Reason.STATIC, False)
        assert d.state == ControllerState.initial(off)


def test_observation_from_signals() -> None:
    sig = Signals(running=10, waiting_capacity=2, waiting=3, kv_cache_usage=0.5)
    assert Observation.from_signals(sig, in_flight=7) == Observation(10, 2, 7, True, 0.5)
    assert not Observation.from_signals(Signals.failure("x")).ok


def test_params_are_validated() -> None:
    with pytest.raises(ConfigError):
        ControllerParams(floor=0, ceiling=10)
    with pytest.raises(ConfigError):
        ControllerParams(floor=10, ceiling=5)
    with pytest.raises(ConfigError):
        ControllerParams(floor=1, ceiling=5, decrease=1.0)
    with pytest.raises(ConfigError):
        ControllerParams(floor=1, ceiling=5, deepest_cut=0.9)


def test_reason_is_a_plain_string() -> None:
    assert str(Reason.HOLD_COOLDOWN) == "hold_cooldown" and Reason("decrease") is Reason.DECREASE
    assert msgspec.json.encode(Reason.SLOW_START) == b'"slow_start"'


# ----------------------------------------------------------------------- warm failover state


def test_state_round_trips_and_clamps() -> None:
    s = state(
        77,
        slow_start=False,
        last_decrease=1.7e9,
        drained=False,
        recovering=True,
        near_full_streak=1,
        unknown_streak=2,
    )
    assert load_state(dump_state(s), P) == s
    assert load_state(dump_state(s).decode(), P) == s
    assert load_state(dump_state(state(9999)), P).target == 512
    for junk in (None, b"", b"{", b'{"target": "x"}', b"[]", b'{"slow_start": true}'):
        assert load_state(junk, P) == ControllerState.initial(P)


# ------------------------------------------------------------------------------- simulation


@dataclass
class Engine:
    """A model engine with capacity C; clients always have more work than the limit allows.

    With ``kv`` it reports KV-cache usage as vLLM's simulator does: running / capacity."""

    capacity: int
    kv: bool = False

    def observe(self, target: int) -> Observation:
        demand = target  # the fleet fills every permit
        running = min(demand, self.capacity)
        return Observation(
            running=running,
            waiting_capacity=max(0, demand - self.capacity),
            in_flight=demand,
            kv_cache_usage=running / self.capacity if self.kv else None,
        )


def run(
    engine: Engine, params: ControllerParams, polls: int, start: ControllerState | None = None
) -> list[Decision]:
    s = start or ControllerState.initial(params)
    out = []
    for n in range(polls):
        d = step(s, engine.observe(s.target), params, now=n * params.poll_interval)
        out.append(d)
        s = d.state
    return out


def polls_to_reach(decisions: list[Decision], level: float) -> int:
    return next(n for n, d in enumerate(decisions, 1) if d.target >= level)


def test_ramp_floor_4_to_capacity_200_with_kv() -> None:
    """The docs/aimd.md trace: x2 from 4 to 128, then straight to the KV estimate, never above."""
    decisions = run(Engine(200, kv=True), P, polls=40)
    assert [d.target for d in decisions[:7]] == [8, 16, 32, 64, 128, 200, 200]
    assert polls_to_reach(decisions, 0.9 * 200) == 6
    assert {d.target for d in decisions[5:]} == {200}  # flat: no probe, no sawtooth
    assert not any(d.saturated for d in decisions)


def test_ramp_floor_4_to_capacity_256_without_kv() -> None:
    """No KV signal: one slow-start overshoot finds the capacity, then it is remembered.

    Then a +5 % probe once every ``probe_polls`` + 1 polls (never a +25 % probe one poll in
    three: 256, 256, 320 for ever)."""
    decisions = run(Engine(256), P, polls=60)
    assert [d.target for d in decisions[:8]] == [8, 16, 32, 64, 128, 256, 512, 256]
    assert polls_to_reach(decisions, 0.9 * 256) == 6
    tail = decisions[7:]
    assert min(d.target for d in tail) == 256 and max(d.target for d in tail) == 268
    saturated_polls = sum(1 for d in tail if d.saturated)
    assert saturated_polls / len(tail) <= 0.10


@pytest.mark.parametrize("kv", [False, True])
@pytest.mark.parametrize("capacity", [5, 37, 100, 200, 256, 300, 511])
def test_ramp_reaches_ninety_percent_quickly(capacity: int, kv: bool) -> None:
    decisions = run(Engine(capacity, kv=kv), P, polls=40)
    assert polls_to_reach(decisions, 0.9 * capacity) <= 8
    tail = [d.target for d in decisions[12:]]
    assert min(tail) >= 0.9 * capacity or min(tail) == P.floor
    assert max(tail) <= max(capacity * 1.10, capacity + 1)
    if kv:  # the KV estimate stops the ramp at the capacity
        assert max(d.target for d in decisions) <= max(capacity, P.floor)


def test_capacity_loss_then_gain_with_kv() -> None:
    decisions = run(Engine(256, kv=True), P, polls=20)
    halved = run(Engine(128, kv=True), P, polls=6, start=decisions[-1].state)
    assert (halved[0].reason, halved[0].target) == (Reason.DECREASE, 128)
    assert {d.target for d in halved} == {128}
    doubled = run(Engine(256, kv=True), P, polls=10, start=halved[-1].state)
    assert (doubled[0].reason, doubled[0].target) == (Reason.INCREASE, 256)
    assert {d.target for d in doubled} == {256}


def test_capacity_loss_then_gain_without_kv() -> None:
    decisions = run(Engine(256), P, polls=20)
    halved = run(Engine(128), P, polls=6, start=decisions[-1].state)
    assert (halved[0].reason, halved[0].target) == (Reason.DECREASE, 128)
    assert max(d.target for d in halved[1:]) <= 128 * 1.05
    # Without a KV signal a grown capacity is found by probes: the first one after at most
    # probe_polls polls, then +10 %, +20 %, +25 % per poll (the figure in docs/aimd.md).
    doubled = run(Engine(512), P, polls=30, start=halved[-1].state)
    assert polls_to_reach(doubled, 0.9 * 512) <= P.probe_polls + 7


# ------------------------------------------------------------------------------- properties

_value = st.one_of(st.none(), st.floats(min_value=0, max_value=1e6))
_obs = st.one_of(
    st.none(),
    st.builds(Observation, _value, _value, _value, st.booleans(), _value),
)


@settings(max_examples=300, deadline=None)
@given(
    floor=st.integers(1, 64),
    span=st.integers(0, 600),
    start=st.integers(-10, 2000),
    memory=st.tuples(_value, _value),
    adaptive=st.booleans(),
    seq=st.lists(st.tuples(_obs, st.floats(0, 30)), max_size=25),
)
def test_target_always_within_bounds(
    floor: int,
    span: int,
    start: int,
    memory: tuple[float | None, float | None],
    adaptive: bool,
    seq: list[tuple[Observation | None, float]],
) -> None:
    params = ControllerParams(floor=floor, ceiling=floor + span, adaptive=adaptive)
    s = ControllerState(target=start, capacity=memory[0], kv_capacity=memory[1])
    now = 0.0
    for obs, gap in seq:
        now += gap
        d = step(s, obs, params, now)
        assert floor <= d.target <= floor + span
        assert d.target == d.state.target
        assert step(s, obs, params, now) == d  # pure
        assert load_state(dump_state(d.state), params) == d.state
        if not adaptive:
            assert d.target == floor and not d.publish
        if d.reason is Reason.DECREASE:
            assert d.target < s.target or s.target > params.ceiling
        if d.reason in (Reason.SLOW_START, Reason.INCREASE, Reason.PROBE):
            assert d.target > s.target
        s = d.state


# ------------------------------------------------------------------------------ capacity memory


def kv_busy(target: int, capacity: float, **kw: float) -> Observation:
    """Fleet at the target, engine below its capacity; KV-cache usage = running / capacity."""
    running = kw.get("running", min(target, capacity))
    return Observation(
        running=running,
        waiting_capacity=0,
        in_flight=kw.get("in_flight", target),
        kv_cache_usage=min(1.0, running / capacity),
    )


def test_kv_estimate_caps_the_ramp_at_the_capacity() -> None:
    # 128 of a 200-slot engine run, KV 64 % used: the next step is 200, not 256.
    d = step(state(128), kv_busy(128, 200), P, now=0)
    assert (d.target, d.reason) == (200, Reason.INCREASE)
    # Far below the estimate the ramp still doubles.
    d = step(state(32), kv_busy(32, 200), P, now=0)
    assert (d.target, d.reason) == (64, Reason.SLOW_START)


def test_kv_full_holds_at_the_capacity_without_probing() -> None:
    s = state(200)
    for n in range(30):
        d = step(s, kv_busy(200, 200, running=197), P, now=12.0 * n)
        assert (d.target, d.reason, d.publish) == (200, Reason.HOLD_CAPACITY, True)
        s = d.state


def test_too_little_kv_usage_gives_no_estimate() -> None:
    # 2 of 256 slots: 0.8 % KV, too coarse to extrapolate from; slow start as without KV.
    d = step(state(4), kv_busy(4, 256, running=2, in_flight=4), P, now=0)
    assert d.reason is Reason.HOLD_IDLE  # the server runs 2 of 4: not near-full
    d = step(state(4), kv_busy(4, 256), P, now=0)
    assert (d.target, d.reason) == (8, Reason.SLOW_START)


def test_saturation_remembers_the_capacity() -> None:
    d = step(state(512), saturated(running=256, in_flight=512, waiting=256), P, now=0)
    assert d.target == 256 and d.state.capacity == 256
    # At the remembered capacity, no KV signal: hold, no +25 % probe every third poll.
    s = d.state
    reasons = []
    for n in range(1, P.probe_polls):
        d = step(s, busy(256), P, now=12.0 * n)
        reasons.append(d.reason)
        assert d.target == 256
        s = d.state
    assert set(reasons) == {Reason.HOLD_CAPACITY}
    # After probe_polls clean polls: one small probe above it (+5 %).
    d = step(s, busy(256), P, now=12.0 * P.probe_polls)
    assert (d.target, d.reason) == (268, Reason.PROBE)
    # The probe saturates: back to what the engine ran, the estimate confirmed.
    d = step(d.state, saturated(running=256, in_flight=268, waiting=12), P, now=12.0 * 11)
    assert (d.target, d.reason, d.state.capacity) == (256, Reason.DECREASE, 256)


def test_clean_probes_grow_faster() -> None:
    s = state(100, slow_start=False, capacity=100.0, near_full_streak=P.probe_polls)
    targets = []
    for n in range(5):
        d = step(s, busy(s.target), P, now=12.0 * n)
        assert d.reason is Reason.PROBE
        targets.append(d.target)
        s = d.state
    assert targets == [105, 115, 138, 172, 215]  # +5 %, +10 %, +20 %, then +25 % per poll


def test_kv_estimate_follows_a_capacity_change_after_saturation() -> None:
    # Saturated at 128 with KV full: estimate 128. Capacity doubles: KV halves, estimate 256.
    obs = Observation(running=128, waiting_capacity=32, in_flight=160, kv_cache_usage=1.0)
    d = step(state(160, slow_start=False), obs, P, now=0)
    assert (d.target, d.state.capacity, d.state.kv_capacity) == (128, 128, 128)
    d = step(d.state, kv_busy(128, 256), P, now=12)
    assert (d.target, d.reason) == (256, Reason.INCREASE)


def test_kv_estimate_scaled_by_what_saturation_showed() -> None:
    # An engine bound by max_num_seqs, not memory: saturated at 100 running with KV 50 % used.
    # Later the same KV reading must not read as "room for 200".
    obs = Observation(running=100, waiting_capacity=10, in_flight=110, kv_cache_usage=0.5)
    d = step(state(110, slow_start=False), obs, P, now=0)
    assert (d.target, d.state.capacity, d.state.kv_capacity) == (100, 100, 200)
    busy_kv = Observation(running=100, waiting_capacity=0, in_flight=100, kv_cache_usage=0.5)
    d = step(d.state, busy_kv, P, now=12)
    assert (d.target, d.reason) == (100, Reason.HOLD_CAPACITY)


# ------------------------------------------------ the server must run near the target (item 5)


def test_client_side_bottleneck_never_increases() -> None:
    """The fleet holds every permit but the server runs few: the bottleneck is the clients'."""
    for s in (state(64), state(64, slow_start=False), state(64, capacity=500.0)):
        for n in range(20):
            obs = Observation(running=25, waiting_capacity=0, in_flight=64, kv_cache_usage=0.05)
            d = step(s, obs, P, now=12.0 * n)
            assert (d.target, d.reason) == (64, Reason.HOLD_IDLE)
            s = d.state


def test_server_busy_with_other_traffic_needs_our_fleet_near_full_too() -> None:
    d = step(state(64), Observation(running=300, waiting_capacity=0, in_flight=20), P, now=0)
    assert (d.target, d.reason) == (64, Reason.HOLD_IDLE)


def test_old_stored_state_loads() -> None:
    """A state stored by the previous version (no capacity memory) still resumes."""
    old = (
        b'{"target":77,"slow_start":false,"last_decrease":1.7e9,"drained":false,'
        b'"recovering":true,"near_full_streak":1,"unknown_streak":0}'
    )
    s = load_state(old, P)
    assert (s.target, s.slow_start, s.capacity, s.kv_capacity) == (77, False, None, None)


# ------------------------------------------- refinements from the ramp benchmark (same issue)


def test_kv_estimate_at_the_target_means_no_probe_even_when_fewer_run() -> None:
    """Measured: under client-side jitter running dips (226 of 256), KV usage reads 0.88, yet
    running / usage still says 256. The estimate, not the usage, decides: no probe."""
    s = state(256)
    for n in range(3 * P.probe_polls):
        running = 226 if n % 3 else 250
        obs = Observation(
            running=running, waiting_capacity=0, in_flight=256, kv_cache_usage=running / 256
        )
        d = step(s, obs, P, now=12.0 * n)
        assert (d.target, d.reason) == (256, Reason.HOLD_CAPACITY)
        s = d.state


def test_a_probe_counts_as_clean_only_when_the_server_ran_above_the_estimate() -> None:
    s = state(268, slow_start=False, capacity=256.0, near_full_streak=20, probes=1)
    # The probe's extra permits have not reached the engine: no proof of room, no next probe.
    d = step(s, busy(268, running=240), P, now=0)
    assert (d.target, d.reason, d.state.probes) == (268, Reason.HOLD_CAPACITY, 1)
    # The engine ran more than the remembered capacity without queueing: the capacity grew.
    d = step(d.state, busy(268, running=262), P, now=12)
    assert (d.target, d.reason) == (268 + 26, Reason.PROBE)


def test_saturated_engine_running_below_a_fresh_cut_cuts_again_at_once() -> None:
    """Capacity halved: the first poll sees the engine still draining (running 135 > 128); the
    next one sees it run 128 < the cut while still queueing: that is the capacity, cut to it
    without waiting for the drain period (it is a measurement, not a second punishment)."""
    d = step(state(256, slow_start=False), saturated(135, 256, 116), P, now=0)
    assert d.target == 135
    d = step(d.state, saturated(128, 172, 44), P, now=12)
    assert (d.target, d.reason) == (128, Reason.DECREASE)
    # Running at the cut (not below it): the drain period holds as before.
    d2 = step(state(256, slow_start=False), saturated(135, 256, 116), P, now=0)
    d2 = step(d2.state, saturated(135, 172, 37), P, now=12)
    assert d2.reason is Reason.HOLD_COOLDOWN


# ---------------------------------------------------- foreign load does not teach the capacity


def foreign(capacity: int, in_flight: float = 0, kv: bool = False) -> Observation:
    """Callers that bypass the gate fill the engine and queue 12 more; the fleet holds
    ``in_flight`` (none by default), as measured against a llama.cpp server."""
    return Observation(
        running=capacity,
        waiting_capacity=12,
        in_flight=in_flight,
        kv_cache_usage=1.0 if kv else None,
    )


def after_foreign(
    capacity: int, floor: int, polls: int, kv: bool, warm: bool
) -> tuple[list[Decision], list[Decision], ControllerState]:
    """The fleet's own ramp (40 polls when ``warm``), ``polls`` of foreign saturation, then the
    foreign callers leave and the fleet fills every permit again: (foreign decisions, the
    decisions after, the state before the foreign load)."""
    p = ControllerParams(floor=floor, ceiling=512, poll_interval=2.0)
    engine = Engine(capacity, kv=kv)
    s = run(engine, p, polls=40)[-1].state if warm else ControllerState.initial(p)
    before = s
    out = []
    for n in range(polls):
        d = step(s, foreign(capacity, kv=kv), p, now=1000.0 + 2.0 * n)
        out.append(d)
        s = d.state
    back = []
    for n in range(60):
        d = step(s, engine.observe(s.target), p, now=2000.0 + 2.0 * n)
        back.append(d)
        s = d.state
    return out, back, before


@pytest.mark.parametrize("kv", [False, True])
@pytest.mark.parametrize("polls", [1, 3, 10, 50])
@pytest.mark.parametrize(("capacity", "floor"), [(64, 4), (256, 8)])
def test_foreign_saturation_leaves_the_learned_capacity(
    capacity: int, floor: int, polls: int, kv: bool
) -> None:
    """Foreign saturation keeps the learned capacity, so the fleet is back at 0.8 C within a few
    polls once the foreign callers leave. Cutting toward the fleet's 'share' each foreign poll
    (in_flight - waiting < 0: by half) and storing the cut as C would cost 13-26 polls (with a
    KV gauge: for ever, E / E_sat stays 1)."""
    during, back, before = after_foreign(capacity, floor, polls, kv, warm=True)
    assert before.target == capacity  # learned: C (no KV gauge) or E (KV gauge)
    assert {d.state.capacity for d in during} == {before.capacity}
    assert {d.state.kv_capacity for d in during} == {before.kv_capacity}
    assert polls_to_reach(back, 0.8 * capacity) <= 3
    assert max(d.target for d in back[:5]) <= capacity  # no overshoot on the way back


@pytest.mark.parametrize("kv", [False, True])
@pytest.mark.parametrize(("capacity", "floor"), [(64, 4), (256, 8)])
def test_foreign_saturation_at_a_cold_start_costs_nothing_after_it(
    capacity: int, floor: int, kv: bool
) -> None:
    """Before the fleet has saturated anything itself, foreign load teaches nothing: once it
    leaves, the ramp is a cold start's (not C := floor: 23 polls at 64, 26 at 256)."""
    cold = run(Engine(capacity, kv=kv), ControllerParams(floor, 512, poll_interval=2.0), 60)
    during, back, _ = after_foreign(capacity, floor, 10, kv, warm=False)
    assert all(d.state.slow_start and d.state.capacity is None for d in during)
    assert polls_to_reach(back, 0.8 * capacity) == polls_to_reach(cold, 0.8 * capacity)


def test_foreign_saturation_cuts_once_per_saturated_stretch() -> None:
    """Foreign load may still cut the target (fewer of ours pile onto a queueing server), but
    once: further cuts would relieve nothing the fleet holds. No estimate of our share (the queue
    is not ours): the fallback cut, 0.8 T."""
    s = state(64, slow_start=False, capacity=64.0)
    d = step(s, foreign(64), P, now=0)
    assert (d.target, d.reason, d.publish, d.saturated) == (51, Reason.DECREASE, True, True)
    for n in range(1, 10):
        d = step(d.state, foreign(64), P, now=12.0 * n)
        assert (d.target, d.reason, d.publish) == (51, Reason.HOLD_COOLDOWN, True)
    assert d.state.capacity == 64
    # The foreign load leaves: straight back to what was learned.
    d = step(d.state, busy(51), P, now=120)
    assert (d.target, d.reason) == (64, Reason.INCREASE)


def test_a_fleet_holding_well_under_what_the_server_runs_is_not_the_cause() -> None:
    """Foreign: the fleet holds less than half of what the server runs (or nothing). At half or
    more, the saturation is the fleet's (or it can relieve it): the old rule, C learned."""
    s = state(64, slow_start=False, capacity=64.0)
    d = step(s, foreign(64, in_flight=31), P, now=0)
    assert (d.target, d.state.capacity, d.state.slow_start) == (51, 64, False)
    d = step(s, foreign(64, in_flight=32), P, now=0)
    assert (d.target, d.state.capacity) == (32, 32)  # max(0.5 T, 32 - 12)
    # Running unknown (TEI): only a fleet holding nothing is surely not the cause.
    tei = Observation(running=None, waiting_capacity=12, in_flight=0)
    d = step(state(64), tei, P, now=0)
    assert (d.target, d.state.capacity, d.state.slow_start) == (51, None, True)
    tei = Observation(running=None, waiting_capacity=12, in_flight=20)
    assert step(state(64), tei, P, now=0).state.capacity == 32
    # In-flight unknown (Redis did not answer): the old rule, as before.
    unknown = Observation(running=64, waiting_capacity=12, in_flight=None)
    assert step(state(64), unknown, P, now=0).state.capacity == 51


def test_the_fleet_joining_a_foreign_stretch_cuts_by_the_old_rule() -> None:
    d = step(state(64, slow_start=False, capacity=64.0), foreign(64), P, now=0)
    assert d.target == 51
    # Our callers arrive while the foreign load stays: the fleet now holds most of what runs
    # and still queues; its in-flight is at the cut, so the drain period is over.
    d = step(d.state, Observation(running=64, waiting_capacity=30, in_flight=50), P, now=12)
    assert (d.target, d.reason, d.state.capacity) == (25, Reason.DECREASE, 25)
