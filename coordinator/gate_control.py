"""The two controllers behind one protocol (:class:`~.control.GateController`).

:func:`control_for` picks a gate's controller once, from its configuration: the latency-gradient
controller for a gate driven by what its callers report (``signal = "latency"``, or no metrics
source), else the AIMD controller -- adaptive with a metrics source, static (the floor) without.
After that the daemon never asks which one a gate has.

Each wrapper owns its gate's parameters and state and calls its controller's pure rule
(:func:`.controller.step`, :func:`.gradient.step_latency`), looked up when called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import controller, gradient
from .control import GateController, Observed, Outcome, PollView
from .controller_types import ControllerParams, ControllerState, Decision, Observation
from .gradient_types import GradientDecision, GradientParams, GradientState, LatencyView

if TYPE_CHECKING:
    from .config import CoordinatorSettings, GateConfig

__all__ = ["AimdControl", "LatencyControl", "control_for"]


def control_for(gate: GateConfig, settings: CoordinatorSettings) -> GateController:
    """The controller of ``gate`` under the coordinator's ``settings``."""
    if gate.latency_driven:
        return LatencyControl(GradientParams.for_gate(gate, settings))
    return AimdControl(ControllerParams.for_gate(gate, settings))


class AimdControl:
    """A gate driven by its server's gauges: the AIMD rule, cut further when the callers saw
    overloads (:func:`.gradient.cut_for_overload`); static without a metrics source."""

    def __init__(self, params: ControllerParams) -> None:
        self.params = params
        self.state: ControllerState | None = None

    @property
    def adaptive(self) -> bool:
        """Whether the target adapts (adaptation on, a metrics source set)."""
        return self.params.adaptive

    @property
    def scraped(self) -> bool:
        """Whether the server is scraped: exactly when the target adapts."""
        return self.params.adaptive

    def decide(self, view: PollView, now: float) -> tuple[Outcome, Observed]:
        """One AIMD step on the scraped signals, then the callers' overload cut."""
        p = self.params
        s = view.signals
        obs = Observation.from_signals(s, view.in_flight) if s is not None else None
        decision = controller.step(self._state(), obs, p, now)
        decision = gradient.cut_for_overload(decision, view.outcomes, p, now)
        self.state = decision.state
        return decision, Observed(view.outcomes)

    def held(self) -> Decision:
        """An unknown poll (:func:`.controller.unknown_poll`)."""
        decision = controller.unknown_poll(self._state(), self.params)
        self.state = decision.state
        return decision

    def resume(self, stored: str | None, *, lapsed: bool) -> None:
        """The stored state (:func:`.controller.load_state`)."""
        self.state = controller.load_state(stored, self.params, lapsed=lapsed)

    def cold_start(self) -> None:
        """No state: the next poll starts from the floor."""
        self.state = None

    def _state(self) -> ControllerState:
        return self.state or ControllerState.initial(self.params)


class LatencyControl:
    """A gate driven by what its callers report: the latency-gradient rule."""

    def __init__(self, params: GradientParams) -> None:
        self.params = params
        self.state: GradientState | None = None

    @property
    def adaptive(self) -> bool:
        """Whether the target adapts (adaptation on)."""
        return self.params.adaptive

    @property
    def scraped(self) -> bool:
        """Never: the gate has no metrics source."""
        return False

    def decide(self, view: PollView, now: float) -> tuple[Outcome, Observed]:
        """One gradient step on the callers' outcome and latency windows."""
        p = self.params
        latency = LatencyView(view.outcomes, view.latency, view.in_flight) if p.adaptive else None
        decision = gradient.step_latency(self._state(), latency, p, now)
        self.state = decision.state
        observed = Observed(view.outcomes, True, decision.p50, decision.state.no_load)
        return decision, observed

    def held(self) -> GradientDecision:
        """An unknown poll (:func:`.gradient.unknown_latency_poll`)."""
        decision = gradient.unknown_latency_poll(self._state(), self.params)
        self.state = decision.state
        return decision

    def resume(self, stored: str | None, *, lapsed: bool) -> None:
        """The stored state (:func:`.gradient.load_gradient_state`)."""
        self.state = gradient.load_gradient_state(stored, self.params, lapsed=lapsed)

    def cold_start(self) -> None:
        """No state: the next poll starts from the floor."""
        self.state = None

    def _state(self) -> GradientState:
        return self.state or GradientState.initial(self.params)
