"""The coordinator's own metrics (prometheus-client), served on ``metrics_listen``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["CoordinatorMetrics"]


@dataclass(frozen=True)
class CoordinatorMetrics:
    target: Gauge
    floor: Gauge
    ceiling: Gauge
    running: Gauge
    waiting_capacity: Gauge
    saturated: Gauge
    in_flight: Gauge
    decisions: Counter
    token_target: Gauge
    tokens_held: Gauge
    kv_tokens: Gauge
    token_decisions: Counter
    scrape_errors: Counter
    scrape_seconds: Histogram
    poll_seconds: Histogram
    leader: Gauge
    epoch: Gauge
    refused: Counter
    reaped_gates: Counter
    pruned_gates: Counter
    redis_up: Gauge
    redis_errors: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry) -> CoordinatorMetrics:
        return cls(**_per_gate(registry), **_per_coordinator(registry))


def _per_gate(registry: CollectorRegistry) -> dict[str, Any]:
    """The metrics labelled by gate."""
    g = ("gate",)

    def gauge(name: str, doc: str) -> Gauge:
        return Gauge(f"fleetgate_coordinator_{name}", doc, g, registry=registry)

    return {
        "target": gauge("target", "Target published"),
        "floor": gauge("floor", "The gate's configured floor (the target never goes below it)"),
        "ceiling": gauge("ceiling", "The gate's configured ceiling"),
        "running": gauge("running", "Requests running on the engine (all clients)"),
        "waiting_capacity": gauge("waiting_capacity", "Requests waiting for engine capacity"),
        "saturated": gauge("saturated", "1 when capacity-waiting > 0"),
        "in_flight": gauge("fleet_in_flight", "Units held fleet-wide at the last poll"),
        "decisions": Counter(
            "fleetgate_coordinator_decisions",
            "Controller decisions by reason",
            ("gate", "reason"),
            registry=registry,
        ),
        "token_target": gauge(
            "token_target", "Token budget published (gates whose token budget is tuned)"
        ),
        "tokens_held": gauge("tokens_held", "Tokens held fleet-wide at the last poll"),
        "kv_tokens": gauge("kv_tokens", "The KV cache in tokens, as the server states it"),
        "token_decisions": Counter(
            "fleetgate_coordinator_token_decisions",
            "Token budget decisions by reason",
            ("gate", "reason"),
            registry=registry,
        ),
        "scrape_errors": Counter(
            "fleetgate_coordinator_scrape_errors",
            "Polls whose /metrics could not be used",
            g,
            registry=registry,
        ),
        "scrape_seconds": Histogram(
            "fleetgate_coordinator_scrape_seconds",
            "Time to scrape and parse one gate's endpoints",
            g,
            registry=registry,
        ),
    }


def _per_coordinator(registry: CollectorRegistry) -> dict[str, Any]:
    """The metrics of the coordinator as a whole."""
    return {
        "poll_seconds": Histogram(
            "fleetgate_coordinator_poll_seconds",
            "Time of one whole poll: scrape, decide, publish",
            registry=registry,
        ),
        "leader": Gauge(
            "fleetgate_coordinator_leader", "1 while this coordinator leads", registry=registry
        ),
        "epoch": Gauge(
            "fleetgate_coordinator_epoch", "Epoch of the current term", registry=registry
        ),
        "refused": Counter(
            "fleetgate_coordinator_refused_publishes",
            "Targets refused for a stale epoch (this coordinator was deposed)",
            registry=registry,
        ),
        "reaped_gates": Counter(
            "fleetgate_coordinator_reaper_sweeps", "Gate sweeps by the reaper", registry=registry
        ),
        "pruned_gates": Counter(
            "fleetgate_coordinator_pruned_gates",
            "Idle gates deleted and dropped from the registry (prune_idle_after)",
            registry=registry,
        ),
        "redis_up": Gauge(
            "fleetgate_coordinator_redis_up",
            "1 while this coordinator reaches Redis (0 until it first does, and in an outage)",
            registry=registry,
        ),
        "redis_errors": Counter(
            "fleetgate_coordinator_redis_errors",
            "Calls of this coordinator that found Redis unreachable",
            registry=registry,
        ),
    }
