"""The AIMD step over many polls: simulated ramps to a capacity (the traces of docs/aimd.md),
capacity lost and regained, foreign load that must not teach the capacity, and the target
within its bounds whatever the observations (by property). Rule by rule:
test_aimd_rules.py; the capacity memory: test_aimd_capacity.py."""

from __future__ import annotations

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

from ._aimd import Engine, P, busy, polls_to_reach, run, state

# ---------------------------------------------------------------------------------- simulated ramps


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


# ---------------------------------------------------- foreign load does not teach the capacity


def foreign(capacity: int, in_flight: float = 0, kv: bool = False, queue: int = 12) -> Observation:
    """Callers that bypass the gate fill the engine and queue ``queue`` more; the fleet holds
    ``in_flight`` (none by default), as measured against a llama.cpp server."""
    return Observation(
        running=capacity,
        waiting_capacity=queue,
        in_flight=in_flight,
        kv_cache_usage=1.0 if kv else None,
    )


def after_foreign(
    capacity: int, floor: int, polls: int, kv: bool, warm: bool, held: float = 0, queue: int = 12
) -> tuple[list[Decision], list[Decision], ControllerState]:
    """The fleet's own ramp (40 polls when ``warm``), ``polls`` of foreign saturation (the fleet
    holding ``held``), then the foreign callers leave and the fleet fills every permit again:
    (foreign decisions, the decisions after, the state before the foreign load)."""
    p = ControllerParams(floor=floor, ceiling=512, poll_interval=2.0)
    engine = Engine(capacity, kv=kv)
    s = run(engine, p, polls=40)[-1].state if warm else ControllerState.initial(p)
    before = s
    out = []
    for n in range(polls):
        d = step(s, foreign(capacity, held, kv, queue), p, now=1000.0 + 2.0 * n)
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
    more, the saturation is the fleet's (or it can relieve it): the fleet's own rule, C learned."""
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
    # In-flight unknown (Redis did not answer): the fleet's own rule, its cut learned as C.
    unknown = Observation(running=64, waiting_capacity=12, in_flight=None)
    assert step(state(64), unknown, P, now=0).state.capacity == 51


def test_the_fleet_joining_a_foreign_stretch_cuts_by_the_old_rule() -> None:
    """Once the fleet holds most of what runs, a foreign stretch's saturation is cut by the
    fleet's own rule (its cut learned as C), the 'old rule' of the name."""
    d = step(state(64, slow_start=False, capacity=64.0), foreign(64), P, now=0)
    assert d.target == 51
    # Our callers arrive while the foreign load stays: the fleet now holds most of what runs
    # and still queues; its in-flight is at the cut, so the drain period is over.
    d = step(d.state, Observation(running=64, waiting_capacity=30, in_flight=50), P, now=12)
    assert (d.target, d.reason, d.state.capacity) == (25, Reason.DECREASE, 25)


@pytest.mark.parametrize("kv", [False, True])
@pytest.mark.parametrize(("capacity", "floor"), [(4, 1), (64, 4), (256, 8)])
def test_a_fleet_holding_less_than_the_queue_cannot_relieve_it(
    capacity: int, floor: int, kv: bool
) -> None:
    """The fleet holds half of what runs (not 'under half': the old test passes it as ours) but
    less than the queue: even dropping every permit it holds would leave the server queueing,
    so the queue is not the fleet's to relieve and teaches nothing. Against llama.cpp with
    ``-np 4`` and 12 callers outside the gate, the fleet's 2 of 4 running were read as ours and
    the cut stored as C (4 -> 2, then 2 -> 1: 13-25 polls back to 0.8 N). The queue: 12 at
    N = 4 (the measured case), N otherwise."""
    queue = 12 if capacity == 4 else capacity
    held = capacity / 2
    during, back, before = after_foreign(capacity, floor, 10, kv, True, held, queue)
    assert {d.state.capacity for d in during} == {before.capacity}
    assert {d.state.kv_capacity for d in during} == {before.kv_capacity}
    assert polls_to_reach(back, 0.8 * capacity) <= 3
    cold = run(Engine(capacity, kv=kv), ControllerParams(floor, 512, poll_interval=2.0), 60)
    during, back, _ = after_foreign(capacity, floor, 10, kv, False, held, queue)
    assert all(d.state.slow_start and d.state.capacity is None for d in during)
    assert polls_to_reach(back, 0.8 * capacity) == polls_to_reach(cold, 0.8 * capacity)
