"""Shared by the AIMD tests: the parameters, observations and states they start from, and a
model engine run poll after poll."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from fleetgate.coordinator.controller import (
    ControllerParams,
    ControllerState,
    Decision,
    Observation,
    step,
)

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
