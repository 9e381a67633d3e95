"""Today's AIMD controller, frozen as the ramp benchmark's baseline.

A verbatim copy of ``coordinator/controller.py``'s rule as of commit ee27f4f (slow start x2 until
the first saturation, +25 % probes after it, cut to the sustainable level), so
``benchmarks/ramp.py`` can run it next to the current controller in the same run and on the same
simulator. Not used by fleetgate itself; do not "fix" it -- it is the yardstick.

Only the config and signal imports are gone, with ``ControllerParams.for_gate`` and
``Observation.from_signals`` that needed them.
"""

from __future__ import annotations

import enum
import math

import msgspec

from fleetgate.errors import ConfigError

__all__ = [
    "ControllerParams",
    "ControllerState",
    "Decision",
    "Observation",
    "Reason",
    "dump_state",
    "load_state",
    "step",
]

_EPS = 1e-9  # so a product such as 0.29 * 100 = 28.999999999999996 does not floor one too low


class Reason(str, enum.Enum):
    """Why a step chose its target (also the ``reason`` label of the coordinator's metrics)."""

    STATIC = "static"
    SLOW_START = "slow_start"
    INCREASE = "increase"
    DECREASE = "decrease"
    HOLD_IDLE = "hold_idle"
    HOLD_UNKNOWN = "hold_unknown"
    HOLD_COOLDOWN = "hold_cooldown"
    HOLD_HYSTERESIS = "hold_hysteresis"
    CLAMP = "clamp"
    RESET = "reset"

    def __str__(self) -> str:
        return self.value


class ControllerParams(msgspec.Struct, frozen=True):
    """Bounds and constants of one gate's controller. Defaults are the documented rule."""

    floor: int
    ceiling: int
    adaptive: bool = True
    poll_interval: float = 12.0
    #: near-full when load >= near_full * target
    near_full: float = 0.8
    #: additive-increase step as a fraction of the target (at least 1)
    increase: float = 0.25
    #: growth per near-full poll before the first saturation
    slow_start_factor: float = 2.0
    #: without a usable estimate of the sustainable level, a decrease cuts to this fraction
    decrease: float = 0.8
    #: a decrease never cuts below this fraction of the target in one step
    deepest_cut: float = 0.5
    #: saturated when capacity-waiting > this
    saturation_threshold: float = 0.0
    #: consecutive near-full polls required for the first increase after a decrease
    recovery_polls: int = 2
    #: a decrease is repeated no sooner than this many poll intervals ...
    min_decrease_polls: float = 0.5
    #: ... and, unless the excess drained, no sooner than this many
    drain_polls: float = 3.0
    #: unknown polls after which the published target has expired: reset to floor
    unknown_reset_polls: int = 3

    def __post_init__(self) -> None:
        if self.floor < 1 or self.ceiling < self.floor:
            raise ConfigError(f"need 1 <= floor <= ceiling, got {self.floor}..{self.ceiling}")
        if not (
            self.poll_interval > 0
            and 0 < self.near_full <= 1
            and self.increase > 0
            and self.slow_start_factor > 1
            and 0 < self.deepest_cut <= self.decrease < 1
            and self.saturation_threshold >= 0
            and self.recovery_polls >= 1
            and 0 <= self.min_decrease_polls <= self.drain_polls
            and self.unknown_reset_polls >= 1
        ):
            raise ConfigError(f"controller constants out of range: {self!r}")


class ControllerState(msgspec.Struct, frozen=True):
    """What the controller remembers between polls; stored by the leader for warm failover."""

    target: int
    slow_start: bool = True
    #: ``now`` of the last decrease (shared clock), None before the first
    last_decrease: float | None = None
    #: a poll saw no capacity-waiting since the last decrease
    drained: bool = True
    #: a decrease happened and no increase since (hysteresis applies)
    recovering: bool = False
    near_full_streak: int = 0
    unknown_streak: int = 0

    @classmethod
    def initial(cls, params: ControllerParams) -> ControllerState:
        """A fresh controller: at the floor, in slow start."""
        return cls(target=params.floor)


class Observation(msgspec.Struct, frozen=True):
    """One poll's view of a gate: the engine's signals plus the fleet in-flight from Redis."""

    running: float | None = None
    waiting_capacity: float | None = None
    #: leases held fleet-wide (ZCARD of holders); None when Redis did not say
    in_flight: float | None = None
    ok: bool = True


class Decision(msgspec.Struct, frozen=True):
    """The outcome of one step.

    ``publish`` tells the leader whether to (re)write the target with a fresh lease: False for
    ``static`` (targets are never published) and for unknown signals (the old lease is left to
    expire, so a blind coordinator decays to the floor).
    """

    state: ControllerState
    target: int
    reason: Reason
    publish: bool
    saturated: bool | None = None


def _clamp(value: int, params: ControllerParams) -> int:
    return max(params.floor, min(params.ceiling, value))


def _may_decrease(
    state: ControllerState, obs: Observation, p: ControllerParams, now: float
) -> bool:
    """One decrease per drain period: the period ends when the cut has taken effect."""
    if state.last_decrease is None:
        return True
    elapsed = now - state.last_decrease
    if elapsed < 0:  # the shared clock stepped back: do not let it block a needed cut
        return True
    if elapsed < p.min_decrease_polls * p.poll_interval:
        return False
    settled = obs.in_flight is not None and obs.in_flight <= state.target
    return state.drained or settled or elapsed >= p.drain_polls * p.poll_interval


def _sustainable(obs: Observation) -> float | None:
    """How many of our requests the saturated engine serves: the level a decrease aims for.

    Running counts every client of the engine; ``in_flight - capacity_waiting`` is our part of
    it when other traffic shares the engine (ours in flight = ours running + ours waiting). The
    smaller one wins. None when neither is known.
    """
    estimates: list[float] = []
    if obs.running is not None and math.isfinite(obs.running) and obs.running > 0:
        estimates.append(obs.running)
    if (
        obs.in_flight is not None
        and obs.waiting_capacity is not None
        and math.isfinite(obs.in_flight - obs.waiting_capacity)
    ):
        estimates.append(obs.in_flight - obs.waiting_capacity)
    return min(estimates) if estimates else None


def step(
    state: ControllerState, obs: Observation | None, params: ControllerParams, now: float
) -> Decision:
    """Advance one gate's controller by one poll. Pure: same inputs, same decision."""
    p = params
    if not p.adaptive:
        return Decision(ControllerState.initial(p), p.floor, Reason.STATIC, publish=False)

    target = _clamp(state.target, p)
    clamped = target != state.target
    state = msgspec.structs.replace(state, target=target)
    sat: bool | None = None
    if obs is not None and obs.waiting_capacity is not None:
        sat = obs.waiting_capacity > p.saturation_threshold

    if obs is not None and sat:
        # Saturation acts even on a partial (not ok) view: it is proven, and a cut is safe.
        if not _may_decrease(state, obs, p, now):
            new = msgspec.structs.replace(state, near_full_streak=0, unknown_streak=0)
            return _out(new, Reason.HOLD_COOLDOWN, obs.ok, sat, clamped)
        estimate = _sustainable(obs)
        if estimate is None or estimate >= target:
            cut = math.floor(target * p.decrease + _EPS)
        else:
            cut = max(math.floor(target * p.deepest_cut + _EPS), math.floor(estimate + _EPS))
        new_target = _clamp(min(cut, target - 1), p)
        if new_target >= target:  # already at the floor
            new = msgspec.structs.replace(
                state, slow_start=False, near_full_streak=0, unknown_streak=0
            )
            return Decision(new, target, Reason.CLAMP, publish=True, saturated=sat)
        new = msgspec.structs.replace(
            state,
            target=new_target,
            slow_start=False,
            last_decrease=now,
            drained=False,
            recovering=True,
            near_full_streak=0,
            unknown_streak=0,
        )
        return Decision(new, new_target, Reason.DECREASE, publish=True, saturated=sat)

    if obs is None or not obs.ok or sat is None:
        streak = state.unknown_streak + 1
        if streak >= p.unknown_reset_polls:
            # The last published lease has run out by now: the fleet is at the floor, so the
            # controller restarts from there rather than jumping back to a stale target.
            new = ControllerState(target=p.floor, unknown_streak=streak)
            reason = Reason.RESET if streak == p.unknown_reset_polls else Reason.HOLD_UNKNOWN
            return Decision(new, p.floor, reason, publish=False, saturated=sat)
        new = msgspec.structs.replace(state, near_full_streak=0, unknown_streak=streak)
        return Decision(new, target, Reason.HOLD_UNKNOWN, publish=False, saturated=sat)

    state = msgspec.structs.replace(state, drained=True, unknown_streak=0)
    load = obs.in_flight if obs.in_flight is not None else obs.running
    if load is None or load < p.near_full * target:
        new = msgspec.structs.replace(state, near_full_streak=0)
        return _out(new, Reason.HOLD_IDLE, True, sat, clamped)

    streak = state.near_full_streak + 1
    if state.recovering and streak < p.recovery_polls:
        new = msgspec.structs.replace(state, near_full_streak=streak)
        return _out(new, Reason.HOLD_HYSTERESIS, True, sat, clamped)
    if state.slow_start:
        grown = max(target + 1, math.floor(target * p.slow_start_factor + _EPS))
        reason = Reason.SLOW_START
    else:
        grown = target + max(1, math.floor(target * p.increase + _EPS))
        reason = Reason.INCREASE
    new_target = _clamp(grown, p)
    if new_target == target:  # already at the ceiling
        reason = Reason.CLAMP
    new = msgspec.structs.replace(
        state, target=new_target, recovering=False, near_full_streak=streak
    )
    return Decision(new, new_target, reason, publish=True, saturated=sat)


def _out(
    state: ControllerState, reason: Reason, publish: bool, sat: bool | None, clamped: bool
) -> Decision:
    """A hold: the reason becomes ``clamp`` when only the bounds moved the target."""
    return Decision(state, state.target, Reason.CLAMP if clamped else reason, publish, sat)


_STATE_DECODER = msgspec.json.Decoder(ControllerState)


def dump_state(state: ControllerState) -> bytes:
    """Serialise ``state`` (JSON) for the leader to store in Redis."""
    return msgspec.json.encode(state)


def load_state(data: bytes | str | None, params: ControllerParams) -> ControllerState:
    """The stored state, clamped to ``params``; a fresh state if absent or unreadable.

    A corrupt or foreign value must not stop the new leader, and a cold start is always safe.
    """
    if not data:
        return ControllerState.initial(params)
    try:
        state = _STATE_DECODER.decode(data)
    except msgspec.DecodeError:
        return ControllerState.initial(params)
    return msgspec.structs.replace(state, target=_clamp(state.target, params))
