"""One gate's token budget controller as the daemon drives it: the pure rule
(:func:`.token_tuning.token_step`) with the gate's parameters and its state.

:func:`token_control_for` gives a gate one when the coordinator adapts and the gate has a token
budget and a metrics source (:attr:`~.config.GateConfig.tokens_tuned`), else None: the budget
stays the configured ``token_limit``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .token_tuning import (
    TokenDecision,
    TokenParams,
    TokenState,
    TokenView,
    load_token_state,
    token_step,
)

if TYPE_CHECKING:
    from fleetgate.observed import Reading

    from .config import CoordinatorSettings, GateConfig
    from .scrape.signal_struct import Signals

__all__ = ["TokenControl", "token_control_for"]


def token_control_for(gate: GateConfig, settings: CoordinatorSettings) -> TokenControl | None:
    """The token budget controller of ``gate`` (None: its budget is not tuned)."""
    if not (settings.adaptive and gate.tokens_tuned) or gate.token_limit is None:
        return None
    params = TokenParams(
        configured=gate.token_limit,
        high=gate.token_ceiling or gate.token_limit,
        poll_interval=settings.poll_interval,
        unknown_reset_polls=settings.target_ttl_polls,
    )
    return TokenControl(params)


class TokenControl:
    """A gate's token budget: its parameters, its state, one step per poll."""

    def __init__(self, params: TokenParams) -> None:
        self.params = params
        self.state: TokenState | None = None

    def decide(
        self,
        signals: Signals | None,
        held: int | None,
        now: float,
        settled: Reading | None = None,
    ) -> TokenDecision:
        """One step on the poll's signals, the tokens the fleet holds (None: unknown) and the
        calls settled since the last poll (``settled``: the obs window; None: unknown)."""
        view = None
        if signals is not None:
            view = TokenView(
                stated=signals.kv_tokens,
                kv_usage=signals.kv_cache_usage,
                preempted=signals.preempted,
                waiting=signals.waiting_capacity,
                held=held,
                ok=signals.ok,
                reports=settled.tok_reports if settled else 0,
                charged=settled.tok_asked if settled else 0,
                used=settled.tok_used if settled else 0,
            )
        decision = token_step(self._state(), view, self.params, now)
        self.state = decision.state
        return decision

    def held(self) -> TokenDecision:
        """A poll that could not be decided: unknown."""
        return self.decide(None, None, 0.0)

    def resume(self, stored: str | None, *, lapsed: bool) -> None:
        """The stored state (:func:`.token_tuning.load_token_state`)."""
        self.state = load_token_state(stored, self.params, lapsed=lapsed)

    def cold_start(self) -> None:
        """No state: the next poll starts from the configured budget."""
        self.state = None

    def _state(self) -> TokenState:
        return self.state or TokenState.initial(self.params)
