"""The latency-gradient controller's values: its parameters, its state, one poll's view, one
decision.

The rule that maps them (one pure step per poll) is :mod:`.gradient`; ``docs/aimd.md`` explains
every constant. The state is stored like the AIMD controller's, for warm failover.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from fleetgate.errors import ConfigError
from fleetgate.observed import Reading

from .control import ControlParams, Reason

if TYPE_CHECKING:
    from .config import GateConfig

__all__ = ["GradientDecision", "GradientParams", "GradientState", "LatencyView"]


class GradientParams(ControlParams, frozen=True):
    """Bounds and constants of one latency-driven gate (docs/aimd.md explains each)."""

    #: queue allowed above the no-load latency before the gradient drops below 1 (Envoy's B)
    buffer: float = 0.1
    #: the deepest cut one latency reading can make (Gradient2's and Envoy's 0.5)
    min_gradient: float = 0.5
    #: units added per step, so a flat latency at a small target still grows it
    headroom: int = 1
    #: growth per near-full poll before the first latency rise
    slow_start_factor: float = 2.0
    #: grow only when the fleet holds at least this fraction of the target
    near_full: float = 0.8
    #: an overload cut leaves at least this fraction of the target ...
    deepest_cut: float = 0.5
    #: ... and at most this fraction (0.8, as in ``agent_utilities``' ``model_concurrency``)
    overload_cut: float = 0.8
    #: a second overload cut waits this many polls (the calls of the first are still finishing)
    cut_polls: float = 1.5
    #: the no-load latency is re-measured after this many polls ...
    remeasure_polls: int = 150
    #: ... or after this many polls at the floor
    floor_polls: int = 5
    #: the target is multiplied by this while the no-load latency is measured
    measure_factor: float = 0.5
    #: a window counts toward the no-load latency only if the target moved by no more than
    #: this fraction since a p50 before it began (see _settled)
    settle_change: float = 0.2

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (
            0 <= self.buffer <= 1
            and 0 < self.min_gradient <= 1
            and self.headroom >= 0
            and self.slow_start_factor > 1
            and 0 < self.near_full <= 1
            and 0 < self.deepest_cut <= self.overload_cut < 1
            and self.cut_polls >= 0
            and self.remeasure_polls >= 1
            and self.floor_polls >= 1
            and 0 < self.measure_factor < 1
        ):
            raise ConfigError(f"gradient controller constants out of range: {self!r}")

    @classmethod
    def adapts(cls, gate: GateConfig) -> bool:
        """The gradient rule reads what the callers report: the gate must be latency-driven."""
        return gate.latency_driven


class GradientState(msgspec.Struct, frozen=True, tag_field="kind", tag="latency"):
    """What the latency controller remembers between polls (stored like the metrics
    controller's state, in ``fg:{G}:util`` ``state``, for warm failover; the ``kind`` tag
    tells the two apart)."""

    target: int
    slow_start: bool = True
    #: the lowest p50 seen since the last measurement (seconds); None before any
    no_load: float | None = None
    #: ``now`` of the last overload cut
    last_cut: float | None = None
    #: polls since the no-load latency was last (re-)measured
    since_measure: int = 0
    #: consecutive polls at the floor
    floor_streak: int = 0
    #: polls left of a no-load measurement (0: none under way)
    measuring: int = 0
    #: the target to return to after the measurement, and the lowest p50 it saw
    resume: int | None = None
    measured: float | None = None
    unknown_streak: int = 0
    #: ``now`` of the last step that moved the target by more than ``settle_change``
    moved_at: float | None = None
    #: ``now`` of the last step that changed the target at all
    changed_at: float | None = None

    @classmethod
    def initial(cls, params: GradientParams) -> GradientState:
        return cls(target=params.floor)


class LatencyView(msgspec.Struct, frozen=True):
    """One poll's client-observed view of a gate.

    ``outcomes``: the window of outcome counts since the last poll (None: no reading to
    difference, e.g. the first poll or a counter reset); ``latency``: the window of latencies,
    which spans several polls when one poll had too few samples (None: not enough yet);
    ``in_flight``: leases held fleet-wide.
    """

    outcomes: Reading | None
    latency: Reading | None = None
    in_flight: float | None = None


class GradientDecision(msgspec.Struct, frozen=True):
    """A latency step's outcome (the fields of :class:`.controller.Decision`, and what it saw)."""

    state: GradientState
    target: int
    reason: Reason
    publish: bool
    saturated: bool | None = None
    #: the window's typical (p50) latency, seconds
    p50: float | None = None
