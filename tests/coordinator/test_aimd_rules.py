"""The AIMD step, a pure function, rule by rule: growth, decrease, the drain period,
hysteresis, bounds, unknown signals, the stored state, and growth only while the server runs
near the target."""

from __future__ import annotations

import math

import msgspec
import pytest

from fleetgate.coordinator.controller import (
    ControllerParams,
    ControllerState,
    Observation,
    Reason,
    dump_state,
    load_state,
    step,
)
from fleetgate.coordinator.scrape.signals import Signals
from fleetgate.errors import ConfigError

from ._aimd import P, busy, saturated, state

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
    assert step(s, saturated(running=0, in_flight=200, waiting=150), P, now=0).target == 100


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
    d = step(s, saturated(running=4, in_flight=4, waiting=2), P, now=0)
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


def test_a_queue_no_larger_than_our_excess_is_the_drain_not_a_second_cut() -> None:
    """llama.cpp, 4 slots, polls every 0.5 s: the first ramp's 8 is cut to 4 (``run=4 wait=4
    held=8``). The leases of the overshoot end only as their calls do (~1 s each, longer on a
    loaded machine), so polls later the fleet still holds 5 of which 1 waits. A queue no larger
    than what the fleet holds above the target is that excess draining, however long it takes:
    it held the target (a second cut learned capacity 3 of a 4-slot server)."""
    p = ControllerParams(floor=1, ceiling=32, poll_interval=0.5)
    d = step(state(8), saturated(running=4, in_flight=8, waiting=4), p, now=0)
    assert (d.target, d.reason, d.state.capacity) == (4, Reason.DECREASE, 4)
    draining = [(8, 4), (6, 2), (5, 1), (5, 1), (5, 1), (5, 1), (4, 0)]
    for n, (held, queued) in enumerate(draining, 1):
        d = step(d.state, saturated(running=4, in_flight=held, waiting=queued), p, now=0.5 * n)
        assert (d.target, d.state.capacity) == (4, 4), (n, d)
        assert d.reason is (Reason.HOLD_COOLDOWN if queued else Reason.HOLD_CAPACITY), (n, d)
    # A queue larger than the excess is not only ours draining: after the drain period it cuts.
    d = step(state(8), saturated(running=4, in_flight=8, waiting=4), p, now=0)
    for n in (1, 2):
        d = step(d.state, saturated(running=4, in_flight=6, waiting=3), p, now=0.5 * n)
        assert d.reason is Reason.HOLD_COOLDOWN
    d = step(d.state, saturated(running=4, in_flight=6, waiting=3), p, now=1.5)
    assert (d.target, d.reason) == (3, Reason.DECREASE)


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
    # A stored state recovering from a cut with no capacity remembered (as older coordinators
    # stored it).
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


# --------------------------------------------------------------- the stored state (a warm failover)


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


def test_old_stored_state_loads() -> None:
    """A stored state without capacity memory (as an older coordinator wrote it) still resumes."""
    old = (
        b'{"target":77,"slow_start":false,"last_decrease":1.7e9,"drained":false,'
        b'"recovering":true,"near_full_streak":1,"unknown_streak":0}'
    )
    s = load_state(old, P)
    assert (s.target, s.slow_start, s.capacity, s.kv_capacity) == (77, False, None, None)


# ------------------------------------------------ growth only while the server runs near the target


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
