"""The AIMD step with what a server states or hides: the request capacity it publishes (slots,
max requests) as the ramp's target and the ceiling of probes, a dispatch queue it does not
count (llama.cpp) inferred from the fleet's in-flight, and preemptions as saturation."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from fleetgate.coordinator.controller import ControllerParams, Observation, Reason, step

from ._aimd import P, state


@dataclass
class Published:
    """An engine of ``capacity`` slots that says so (``max_requests``); no KV gauge."""

    capacity: int
    states: bool = True

    def observe(self, target: int) -> Observation:
        running = min(target, self.capacity)
        return Observation(
            running=running,
            waiting_capacity=max(0, target - self.capacity),
            in_flight=target,
            max_requests=self.capacity if self.states else None,
        )


def ramp(engine: Published, p: ControllerParams, polls: int) -> list[int]:
    s = state(p.floor)
    targets = []
    for n in range(polls):
        d = step(s, engine.observe(s.target), p, now=n * p.poll_interval)
        targets.append(d.target)
        s = d.state
    return targets


@pytest.mark.parametrize(("capacity", "floor"), [(4, 2), (64, 4), (256, 4), (200, 4)])
def test_published_capacity_ends_the_first_ramp_at_it(capacity: int, floor: int) -> None:
    """Without a KV gauge the first ramp doubled past the capacity to find it (llama.cpp -np 4:
    2 4 8 4; 256: 512 then 256). A capacity the server states is the ramp's target: straight
    to it, no saturation on the way, and no probe above it after (a probe could only queue)."""
    p = ControllerParams(floor=floor, ceiling=512, poll_interval=2.0)
    targets = ramp(Published(capacity), p, 40)
    assert max(targets) == capacity
    assert targets[-30:] == [capacity] * 30
    unstated = ramp(Published(capacity, states=False), p, 40)
    assert max(unstated) > capacity  # the overshoot the published figure avoids


def test_a_learned_capacity_below_the_published_one_wins() -> None:
    """Others share the engine, or its KV cache binds first: what saturation showed stays the
    ramp's target; the published figure only bounds the probes."""
    s = state(16, slow_start=False, capacity=40.0)
    d = step(s, Observation(running=16, waiting_capacity=0, in_flight=16, max_requests=64), P, 0)
    assert (d.target, d.reason) == (32, Reason.SLOW_START)
    d = step(
        d.state,
        Observation(running=32, waiting_capacity=0, in_flight=32, max_requests=64),
        P,
        now=12,
    )
    assert (d.target, d.reason) == (40, Reason.INCREASE)
    # At C the probes may still find room up to what the server admits, never above it.
    s = state(60, slow_start=False, capacity=60.0)
    targets = []
    for n in range(40):
        t = s.target
        obs = Observation(running=min(t, 64), waiting_capacity=0, in_flight=t, max_requests=64)
        d = step(s, obs, P, now=12.0 * n)
        targets.append(d.target)
        s = d.state
    assert max(targets) == 64 and targets[-10:] == [64] * 10


def test_hidden_dispatch_queue_is_saturation_when_every_slot_is_busy() -> None:
    """llama.cpp answers /metrics ahead of queued tasks: a request not yet dispatched is neither
    processing nor deferred. With every slot busy, what the fleet holds beyond what runs is
    queued: ``in_flight=5 running=4 waiting=0`` after a probe to 5 is a saturation (the probe
    stepped on to 6 before)."""
    hidden = Observation(running=4, waiting_capacity=0, in_flight=5, hidden_queue=True)
    s = state(5, slow_start=False, capacity=4.0, probes=1)
    d = step(s, hidden, P, now=0)
    assert (d.target, d.reason, d.saturated) == (4, Reason.DECREASE, True)
    # With the slots stated the same, at any learned capacity.
    stated = Observation(
        running=4, waiting_capacity=0, in_flight=5, hidden_queue=True, max_requests=4
    )
    d = step(state(5, slow_start=False), stated, P, now=0)
    assert (d.target, d.saturated) == (4, True)


def test_a_permit_between_requests_is_no_hidden_queue() -> None:
    """The fleet holds a permit a round trip longer than the server runs its request: with a
    slot free, in_flight > running is that gap, not a queue. Servers that count their queue
    (vLLM) are never inferred."""
    gap = Observation(running=3, waiting_capacity=0, in_flight=4, hidden_queue=True, max_requests=4)
    d = step(state(4, slow_start=False, capacity=4.0), gap, P, now=0)
    assert (d.target, d.saturated, d.reason) == (4, False, Reason.HOLD_IDLE)
    vllm = Observation(running=4, waiting_capacity=0, in_flight=5)
    d = step(state(5, slow_start=False, capacity=4.0, probes=1), vllm, P, now=0)
    assert not d.saturated
    # A cold start knows no capacity: nothing to infer from (the deferred gauge shows the
    # slow start's overshoot).
    d = step(
        state(8),
        Observation(running=4, waiting_capacity=0, in_flight=5, hidden_queue=True),
        P,
        now=0,
    )
    assert not d.saturated


def test_preemptions_since_the_last_poll_are_saturation() -> None:
    """The engine preempted (retracted, paused) running requests since the last poll: it
    admitted more than its KV cache holds, though no request waits at the instant of the
    scrape. Cut as a saturation; none (0) or unknown (None) changes nothing."""
    s = state(64, slow_start=True)
    obs = Observation(running=64, waiting_capacity=0, in_flight=64, preempted=3)
    d = step(s, obs, P, now=0)
    assert (d.target, d.reason, d.saturated, d.state.slow_start) == (
        51,
        Reason.DECREASE,
        True,
        False,
    )
    for preempted in (0.0, None):
        obs = Observation(running=64, waiting_capacity=0, in_flight=64, preempted=preempted)
        assert step(s, obs, P, now=0).reason is Reason.SLOW_START
