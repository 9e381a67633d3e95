"""Every configured gate's controller, and what one poll decides for each gate.

:class:`Gates` turns what a poll saw of a gate (its server's signals, the fleet's in-flight,
the callers' reports) into a :class:`~.publisher.Publication`, through the gate's
:class:`~.control.GateController` (:func:`~.gate_control.control_for`): the same steps for
every gate, whichever controller drives it. It also keeps the coordinator's per-decision
metrics and log line, and what was last published (a target is logged when it changes).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from fleetgate.observed import Reading
from fleetgate.util_hash import LATENCY_FIELDS, OBSERVED_FIELDS

from .config import Config, GateConfig
from .control import GateController, PollView, State
from .errorlog import Faults
from .gate_control import control_for
from .metrics import CoordinatorMetrics
from .observations import ObsWindows
from .publisher import Publication
from .scrape.signal_struct import Signals
from .token_control import TokenControl, token_control_for
from .token_tuning import TokenDecision

__all__ = ["Gates"]

log = logging.getLogger("fleetgate.coordinator")


class Gates:
    """The controllers of ``config``'s gates (by name) and their decisions."""

    def __init__(self, config: Config, metrics: CoordinatorMetrics, faults: Faults) -> None:
        self.metrics = metrics
        self.faults = faults
        self.controllers: dict[str, GateController] = {
            g.name: control_for(g, config.coordinator) for g in config.gates
        }
        #: the token budget controllers of the gates whose budget is tuned
        self.tokens: dict[str, TokenControl] = {
            g.name: t
            for g in config.gates
            if (t := token_control_for(g, config.coordinator)) is not None
        }
        self.windows = ObsWindows()
        #: the target (and token budget) last published per gate in this term (a change is
        #: logged)
        self.published: dict[str, int] = {}
        self.published_tokens: dict[str, int] = {}

    @property
    def states(self) -> dict[str, State]:
        """Each gate's controller state, for the gates that have one (resumed or stepped)."""
        return {n: c.state for n, c in self.controllers.items() if c.state is not None}

    def resume(
        self, stored: Mapping[str, tuple[str | None, bool, str | None]] | None
    ) -> dict[str, int]:
        """A new term: every controller from its stored state (None: a cold start) -- the
        request limit's and the token budget's --, the windows and the published targets
        forgotten. Returns the resumed targets of the adapted gates."""
        self.windows.clear()
        self.published = {}
        self.published_tokens = {}
        for name, c in self.controllers.items():
            t = self.tokens.get(name)
            if stored is None:
                c.cold_start()
                if t is not None:
                    t.cold_start()
            else:
                state, lapsed, token_state = stored[name]
                c.resume(state, lapsed=lapsed)
                if t is not None:
                    t.resume(token_state, lapsed=lapsed)
        return {n: s.target for n, s in self.states.items() if self.controllers[n].adaptive}

    def decide(
        self,
        gate: GateConfig,
        signals: Signals | None,
        in_flight: int | None,
        now: float,
        reading: Reading | None = None,
        urls: Sequence[str] = (),
        tokens_held: int | None = None,
    ) -> Publication:
        """One gate's decision at ``now``. A failure (a bug of ours on some input) makes this
        gate's poll unknown -- held, unpublished, so its target decays -- instead of aborting
        the poll of every gate while the leader keeps its lease (no standby would take over).
        ``urls``: the metrics URLs the scrape read; ``tokens_held``: the tokens the fleet
        holds (read for the gates whose token budget is tuned)."""
        control = self.controllers[gate.name]
        tokens = self.tokens.get(gate.name)
        try:
            outcomes, latency = self.windows.update(gate.name, reading)
            view = PollView(signals, in_flight, outcomes, latency)
            decision, observed = control.decide(view, now)
            budget = (
                tokens.decide(signals, tokens_held, now, outcomes) if tokens is not None else None
            )
            pub = Publication(
                gate, decision, signals, in_flight, now, observed, tuple(urls), budget, tokens_held
            )
            self._account(pub)
        except Exception as exc:
            self.faults["poll"].error(
                f"gate {gate.name}: decision failed ({self.faults.text(exc)}); held as unknown",
                trace=True,
            )
            # held, not published, and from the floor (published once) after
            # unknown_reset_polls of them, as for a scrape that failed -- else the first good
            # poll would publish the stale target at once
            held = tokens.held() if tokens is not None else None
            return Publication(gate, control.held(), None, in_flight, now, tokens=held)
        return pub

    def _account(self, pub: Publication) -> None:
        """The coordinator's metrics and log line for one decision."""
        decision, signals, in_flight = pub.decision, pub.signals, pub.in_flight
        m, name = self.metrics, pub.gate.name
        m.decisions.labels(name, decision.reason.value).inc()
        m.target.labels(name).set(decision.target)
        m.floor.labels(name).set(pub.gate.floor)
        m.ceiling.labels(name).set(pub.gate.ceiling)
        if in_flight is not None:
            m.in_flight.labels(name).set(in_flight)
        if signals is not None:
            if signals.running is not None:
                m.running.labels(name).set(signals.running)
            if signals.waiting_capacity is not None:
                m.waiting_capacity.labels(name).set(signals.waiting_capacity)
            m.saturated.labels(name).set(1 if decision.saturated else 0)
        previous = self.published.get(name)
        if decision.publish and previous != decision.target:
            util = pub.snapshot().encode()
            observed = {k: util[k] for k in (*OBSERVED_FIELDS, *LATENCY_FIELDS) if k in util}
            log.info(
                "gate=%s target %s -> %d reason=%s running=%s waiting_capacity=%s in_flight=%s%s",
                name,
                previous if previous is not None else "-",
                decision.target,
                decision.reason.value,
                signals.running if signals else None,
                signals.waiting_capacity if signals else None,
                in_flight,
                "".join(f" {k}={v}" for k, v in observed.items() if v not in ("", "0")),
            )
        if decision.publish:
            self.published[name] = decision.target
        if pub.tokens is not None:
            self._account_tokens(pub, pub.tokens)

    def _account_tokens(self, pub: Publication, decision: TokenDecision) -> None:
        """The token budget's metrics and log line (a published change is logged)."""
        m, name, s = self.metrics, pub.gate.name, pub.signals
        m.token_decisions.labels(name, decision.reason.value).inc()
        m.token_target.labels(name).set(decision.budget)
        if pub.tokens_held is not None:
            m.tokens_held.labels(name).set(pub.tokens_held)
        if s is not None and s.kv_tokens is not None:
            m.kv_tokens.labels(name).set(s.kv_tokens)
        previous = self.published_tokens.get(name)
        if decision.publish and previous != decision.budget:
            log.info(
                "gate=%s token budget %s -> %d reason=%s kv_tokens=%s tokens_held=%s "
                "kv_usage=%s preempted=%s",
                name,
                previous if previous is not None else "-",
                decision.budget,
                decision.reason.value,
                s.kv_tokens if s else None,
                pub.tokens_held,
                s.kv_cache_usage if s else None,
                s.preempted if s else None,
            )
        if decision.publish:
            self.published_tokens[name] = decision.budget
