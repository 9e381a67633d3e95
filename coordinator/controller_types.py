"""The AIMD controller's values: its parameters, its state, one poll's observation, one decision.

The rule that maps them (one pure step per poll) is :mod:`.controller`, whose docstring explains
every constant. The state is what the leader stores in Redis after every step
(:func:`.controller.dump_state`), so a standby that takes over continues where the old leader
stopped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from fleetgate.errors import ConfigError

from .control import ControlParams, Reason

if TYPE_CHECKING:
    from .config import GateConfig
    from .scrape.signal_struct import Signals

__all__ = ["ControllerParams", "ControllerState", "Decision", "Observation"]


class ControllerParams(ControlParams, frozen=True):
    """Bounds and constants of one gate's controller. Defaults are the documented rule."""

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
    #: KV-cache usage below this is too coarse to extrapolate the capacity from
    kv_min: float = 0.05
    #: clean near-full polls at the capacity estimate before a probe above it
    probe_polls: int = 10
    #: the first probe's step as a fraction of the target; it doubles per clean probe (<= increase)
    probe: float = 0.05
    #: a saturation is foreign (not the fleet's doing: it cuts the target once but teaches no
    #: capacity) when the fleet holds nothing or less than this fraction of what the server runs
    fleet_share: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (
            0 < self.near_full <= 1
            and self.increase > 0
            and self.slow_start_factor > 1
            and 0 < self.deepest_cut <= self.decrease < 1
            and self.saturation_threshold >= 0
            and self.recovery_polls >= 1
            and 0 <= self.min_decrease_polls <= self.drain_polls
            and 0 < self.kv_min <= 1
            and self.probe_polls >= 1
            and 0 < self.probe <= self.increase
            and 0 < self.fleet_share <= 1
        ):
            raise ConfigError(f"controller constants out of range: {self!r}")

    @classmethod
    def adapts(cls, gate: GateConfig) -> bool:
        """The AIMD rule reads the server's gauges: the gate needs a metrics source."""
        return gate.has_metrics


class ControllerState(msgspec.Struct, frozen=True):
    """What the controller remembers between polls; stored by the leader for warm failover.

    Every field has a default, so a state stored by an older version (without ``capacity``,
    ``kv_capacity``, ``probes``) loads as one without capacity memory, and an older leader
    reading a newer state ignores the fields it does not know.
    """

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
    #: the target chosen at the last saturation: what the engine sustained for us (``C``)
    capacity: float | None = None
    #: the KV-cache estimate (running / KV usage) at that saturation, None when unknown
    kv_capacity: float | None = None
    #: consecutive probes above ``capacity`` that did not saturate (the next probe's step doubles)
    probes: int = 0

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
    #: KV-cache usage, a fraction (1 = full); None when the server does not report it
    kv_cache_usage: float | None = None
    #: the requests the server admits at once, as it states them (llama.cpp's slots, NIM's
    #: ``num_request_max``, TensorRT-LLM's ``max_num_active_requests``); None when unstated
    max_requests: float | None = None
    #: requests preempted, retracted, paused or refused admission since the last poll (None:
    #: unknown); any is saturation
    preempted: float | None = None
    #: the server does not count requests it has not dispatched yet (llama.cpp): they are
    #: inferred from the fleet's in-flight when every slot is busy
    hidden_queue: bool = False

    @classmethod
    def from_signals(cls, signals: Signals, in_flight: float | None = None) -> Observation:
        """Combine parsed signals with the fleet in-flight count."""
        return cls(
            signals.running,
            signals.waiting_capacity,
            in_flight,
            signals.ok,
            signals.kv_cache_usage,
            max_requests=signals.max_requests,
            preempted=signals.preempted,
            hidden_queue=signals.hidden_queue,
        )


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
