"""The AIMD step's capacity memory: the KV-cache estimate, the capacity saturation showed,
probes above it, and cuts measured against it."""

from __future__ import annotations

from fleetgate.coordinator.controller import Observation, Reason, step

from ._aimd import P, busy, saturated, state


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


# --------------------------- the estimate under jitter, clean probes, a cut measured below the last


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
