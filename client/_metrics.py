"""Client metrics (prometheus-client), labelled by gate.

Metrics are created once per registry, so several fleets in one process (or in tests, each with
a fresh ``CollectorRegistry``) never raise "Duplicated timeseries".
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from functools import cached_property

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["ClientMetrics", "GateMetrics", "client_metrics"]

WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


@dataclass(frozen=True)
class ClientMetrics:
    in_flight: Gauge
    queue_depth: Gauge
    wait_seconds: Histogram
    granted: Counter
    rejected: Counter
    deadline_exceeded: Counter
    lease_lost: Counter
    fallback: Gauge
    retries: Counter
    calls_per_request: Histogram
    background_errors: Counter


class GateMetrics:
    """One gate's series of the client metrics, each looked up once, on its first use.

    ``metric.labels(gate)`` takes the metric's lock and builds a key on every call; a permit
    counts into four series, so the gate keeps the children it used. Created lazily, a series
    still appears when it first counts something, as with ``labels()`` at the call site.
    """

    def __init__(self, metrics: ClientMetrics, gate: str) -> None:
        self._metrics = metrics
        self._gate = gate

    @cached_property
    def in_flight(self) -> Gauge:
        return self._metrics.in_flight.labels(self._gate)

    @cached_property
    def queue_depth(self) -> Gauge:
        return self._metrics.queue_depth.labels(self._gate)

    @cached_property
    def wait_seconds(self) -> Histogram:
        return self._metrics.wait_seconds.labels(self._gate)

    @cached_property
    def granted(self) -> Counter:
        return self._metrics.granted.labels(self._gate)

    @cached_property
    def rejected(self) -> Counter:
        return self._metrics.rejected.labels(self._gate)

    @cached_property
    def deadline_exceeded(self) -> Counter:
        return self._metrics.deadline_exceeded.labels(self._gate)

    @cached_property
    def lease_lost(self) -> Counter:
        return self._metrics.lease_lost.labels(self._gate)


_lock = threading.Lock()
# Keyed by the registry itself, held weakly: keyed by id(), a registry collected after one test
# gave its id to the next test's registry, which then got metrics registered in the dead one
# (tests/test_testing.py::test_overloaded_when_queue_full read no rejected count).
_by_registry: weakref.WeakKeyDictionary[CollectorRegistry, ClientMetrics] = (
    weakref.WeakKeyDictionary()
)


def client_metrics(registry: CollectorRegistry | None = None) -> ClientMetrics:
    """The client metrics registered in ``registry`` (the default registry if None)."""
    reg = REGISTRY if registry is None else registry
    with _lock:
        found = _by_registry.get(reg)
        if found is not None:
            return found
        g = ("gate",)
        m = ClientMetrics(
            in_flight=Gauge(
                "fleetgate_client_in_flight", "Permits this process holds", g, registry=reg
            ),
            queue_depth=Gauge(
                "fleetgate_client_queue_depth",
                "Acquires of this process parked in the fleet-wide wait list",
                g,
                registry=reg,
            ),
            wait_seconds=Histogram(
                "fleetgate_client_wait_seconds",
                "Time parked before a grant (parked grants only)",
                g,
                buckets=WAIT_BUCKETS,
                registry=reg,
            ),
            granted=Counter("fleetgate_client_granted", "Permits granted", g, registry=reg),
            rejected=Counter(
                "fleetgate_client_rejected", "Acquires rejected: wait list full", g, registry=reg
            ),
            deadline_exceeded=Counter(
                "fleetgate_client_deadline_exceeded", "Total deadlines that fired", g, registry=reg
            ),
            lease_lost=Counter(
                "fleetgate_client_lease_lost", "Leases that could not be renewed", g, registry=reg
            ),
            fallback=Gauge(
                "fleetgate_client_fallback",
                "1 while Redis is unreachable and the local fair-share bound applies",
                g,
                registry=reg,
            ),
            retries=Counter(
                "fleetgate_client_retries", "Retries of calls made inside a permit", g, registry=reg
            ),
            calls_per_request=Histogram(
                "fleetgate_client_calls_per_request",
                "Calls one gate.map() request made",
                g,
                buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000),
                registry=reg,
            ),
            background_errors=Counter(
                "fleetgate_client_background_errors",
                "Unexpected errors in background tasks (heartbeat, probe, wake listener, ...); "
                "each task logs, counts and carries on",
                ("task",),
                registry=reg,
            ),
        )
        _by_registry[reg] = m
        return m
