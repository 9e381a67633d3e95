"""The contract between a gate's controller and the rest of the coordinator.

Two controllers drive targets: the AIMD controller on the server's gauges
(:mod:`.controller`) and the latency-gradient controller on what the callers report
(:mod:`.gradient`). Both are pure rules; :mod:`.gate_control` wraps each in a
:class:`GateController`, so the daemon steps every gate the same way and never asks which
controller it has:

* per poll the daemon hands the controller a :class:`PollView` (what it saw of the gate) and
  gets an :class:`Outcome` (the target, and whether to publish it) and :class:`Observed` (what the
  callers reported, for the gate's util snapshot);
* a poll that could not be decided (a bug of ours on some input) is :meth:`GateController.held`;
* a new leader resumes each controller from the state the last one stored
  (:meth:`GateController.resume`) or starts it cold.

:class:`Reason` is shared by both controllers (and is the ``reason`` label of the coordinator's
metrics).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Protocol, TypeVar

import msgspec

from fleetgate.errors import ConfigError
from fleetgate.observed import Reading

if TYPE_CHECKING:
    from .config import CoordinatorSettings, GateConfig
    from .scrape.signal_struct import Signals

__all__ = [
    "ControlParams",
    "GateController",
    "Observed",
    "Outcome",
    "PollView",
    "Reason",
    "State",
]

_P = TypeVar("_P", bound="ControlParams")


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
    HOLD_CAPACITY = "hold_capacity"
    PROBE = "probe"
    #: callers saw overload responses (429/503/529; timeouts too on latency gates): cut
    OVERLOAD = "overload"
    #: the latency controller lowers the target for a few polls to re-measure the no-load
    #: latency (coordinator/gradient.py)
    MEASURE = "measure_no_load"

    def __str__(self) -> str:
        return self.value


class ControlParams(msgspec.Struct, frozen=True):
    """What every controller's parameters start with: the gate's bounds, whether it adapts,
    the poll pace and when a target nobody can read has expired. Each controller's
    parameters (:class:`.controller_types.ControllerParams`,
    :class:`.gradient_types.GradientParams`) add its own constants after these."""

    floor: int
    ceiling: int
    adaptive: bool = True
    poll_interval: float = 2.0
    #: polls without a usable reading after which the published target has expired: reset to
    #: the floor
    unknown_reset_polls: int = 3

    def __post_init__(self) -> None:
        if self.floor < 1 or self.ceiling < self.floor:
            raise ConfigError(f"need 1 <= floor <= ceiling, got {self.floor}..{self.ceiling}")
        if not (self.poll_interval > 0 and self.unknown_reset_polls >= 1):
            raise ConfigError(f"controller constants out of range: {self!r}")

    @classmethod
    def adapts(cls, gate: GateConfig) -> bool:
        """Whether this controller can adapt ``gate`` (it has the source the rule reads)."""
        raise NotImplementedError

    @classmethod
    def for_gate(cls: type[_P], gate: GateConfig, coordinator: CoordinatorSettings) -> _P:
        """Parameters of ``gate`` under ``coordinator``'s settings, the constants at their
        defaults (adaptive when the coordinator adapts and :meth:`adapts` holds)."""
        return cls(
            floor=gate.floor,
            ceiling=gate.ceiling,
            adaptive=coordinator.adaptive and cls.adapts(gate),
            poll_interval=coordinator.poll_interval,
            unknown_reset_polls=coordinator.target_ttl_polls,
        )

    @classmethod
    def from_params(cls: type[_P], p: ControlParams) -> _P:
        """This controller's parameters for a gate another controller has as ``p``: the shared
        fields taken over, this controller's constants at their defaults."""
        return cls(**{name: getattr(p, name) for name in ControlParams.__struct_fields__})


class State(Protocol):
    """A controller's state between polls (stored for warm failover): at least its target."""

    @property
    def target(self) -> int: ...


class Outcome(Protocol):
    """One step's outcome (:class:`.controller.Decision`, :class:`.gradient.GradientDecision`).

    ``publish`` tells the leader whether to (re)write the target with a fresh lease;
    ``saturated`` whether the engine queued (None: unknown).
    """

    @property
    def state(self) -> State: ...

    @property
    def target(self) -> int: ...

    @property
    def reason(self) -> Reason: ...

    @property
    def publish(self) -> bool: ...

    @property
    def saturated(self) -> bool | None: ...


class PollView(msgspec.Struct, frozen=True):
    """What one poll saw of one gate; each part None when unknown or not read.

    ``signals``: its server's gauges (scraped gates only); ``in_flight``: units held fleet-wide;
    ``outcomes``: the calls the releases reported since the last poll; ``latency``: the window of
    their latencies (it spans several polls when one had too few samples).
    """

    signals: Signals | None = None
    in_flight: int | None = None
    outcomes: Reading | None = None
    latency: Reading | None = None


class Observed(msgspec.Struct, frozen=True):
    """The client-observed figures of one decided poll, for the util snapshot.

    ``outcomes``: the calls the releases reported since the last poll (None: no window, e.g.
    the first poll of a term); ``latency_driven``: the gate's target follows the latency, read
    as ``p50`` (the window's median) against ``no_load`` (seconds; None: not known yet).
    """

    outcomes: Reading | None = None
    latency_driven: bool = False
    p50: float | None = None
    no_load: float | None = None


class GateController(Protocol):
    """One gate's controller as the daemon drives it; not thread-safe, one poll at a time."""

    @property
    def adaptive(self) -> bool:
        """Whether the coordinator adapts the gate (its callers' reports are read); else its
        target is its floor, never published."""
        ...

    @property
    def scraped(self) -> bool:
        """Whether the gate's server ``/metrics`` are read every poll (:attr:`PollView.signals`)."""
        ...

    @property
    def state(self) -> State | None:
        """The state after the last step or resume; None before either."""
        ...

    def decide(self, view: PollView, now: float) -> tuple[Outcome, Observed]:
        """One poll's step at ``now`` (Redis server time, seconds: a clock every leader shares)."""
        ...

    def held(self) -> Outcome:
        """A poll that could not be decided: unknown (held, unpublished, then the floor)."""
        ...

    def resume(self, stored: str | None, *, lapsed: bool) -> None:
        """Continue from the state the last leader stored (None, or unreadable: a cold start;
        ``lapsed``: its last target has run out, so from the floor)."""
        ...

    def cold_start(self) -> None:
        """Forget the state (the stored ones could not be read)."""
        ...
