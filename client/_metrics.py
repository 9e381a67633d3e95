"""Client metrics (prometheus-client), labelled by gate; the per-call ones also by priority and
tenant.

Metrics are created once per registry, so several fleets in one process (or in tests, each with
a fresh ``CollectorRegistry``) never raise "Duplicated timeseries".

Cardinality: the ``priority`` label is the band as an int string ("-100" .. "100"); the
``tenant`` label is the tenant's name only for the tenants the gate allows
(:meth:`GateMetrics.allow_tenants`: the gate's configured ``tenant_weights``, or a list the
application passes; at most :data:`MAX_TENANT_LABELS` per gate), ``""`` for the default tenant
(Prometheus drops an empty label, so such series read as having none) and ``other`` for every
other tenant: tenant names from user input never create series.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

__all__ = [
    "CLASS_LABELS",
    "MAX_TENANT_LABELS",
    "OTHER_TENANT",
    "ClassMetrics",
    "ClientMetrics",
    "GateMetrics",
    "client_metrics",
]

WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


#: Labels of the per-call metrics (in flight, units in flight, wait seconds, granted, rejected).
CLASS_LABELS = ("gate", "priority", "tenant")
#: The tenant label of every tenant a gate does not name (and of those beyond the cap).
OTHER_TENANT = "other"
#: Tenants one gate labels by name at most (the first allowed); later ones count as ``other``.
MAX_TENANT_LABELS = 100


@dataclass(frozen=True)
class ClientMetrics:
    """The client's metrics of one registry (:func:`client_metrics`), labelled by gate (and,
    the per-call ones, :data:`CLASS_LABELS`)."""

    in_flight: Gauge
    in_flight_units: Gauge
    queue_depth: Gauge
    wait_seconds: Histogram
    expected_wait_seconds: Histogram
    granted: Counter
    revoked: Counter
    rejected: Counter
    deadline_exceeded: Counter
    deadline_unreachable: Counter
    lease_lost: Counter
    fallback: Gauge
    retries: Counter
    calls_per_request: Histogram
    background_errors: Counter


class _Class(Protocol):
    """What an acquire or a lease says about its class (an ``Ask``, a ``Lease``)."""

    @property
    def priority(self) -> int: ...

    @property
    def tenant(self) -> str | None: ...


class ClassMetrics:
    """The series of one (gate, priority, tenant label), each looked up on its first use.

    Keep the object a lease was granted with and count its release into the same one: the
    tenant label of a name can change while the lease runs (:meth:`GateMetrics.allow_tenants`).
    """

    def __init__(self, metrics: ClientMetrics, gate: str, priority: str, tenant: str) -> None:
        self._metrics = metrics
        self._labels = (gate, priority, tenant)

    @property
    def labels(self) -> tuple[str, str, str]:
        """(gate, priority, tenant) as exported."""
        return self._labels

    @cached_property
    def in_flight(self) -> Gauge:
        """Permits of this class this process holds."""
        return self._metrics.in_flight.labels(*self._labels)

    @cached_property
    def in_flight_units(self) -> Gauge:
        """Units (the permits' weights) of this class this process holds."""
        return self._metrics.in_flight_units.labels(*self._labels)

    @cached_property
    def wait_seconds(self) -> Histogram:
        return self._metrics.wait_seconds.labels(*self._labels)

    @cached_property
    def expected_wait_seconds(self) -> Histogram:
        """The waits the gate expected of this class's parked calls (beside wait_seconds)."""
        return self._metrics.expected_wait_seconds.labels(*self._labels)

    @cached_property
    def granted(self) -> Counter:
        return self._metrics.granted.labels(*self._labels)

    @cached_property
    def rejected(self) -> Counter:
        return self._metrics.rejected.labels(*self._labels)

    @cached_property
    def revoked(self) -> Counter:
        """Leases of this class the gate asked back (revocation)."""
        return self._metrics.revoked.labels(*self._labels)

    def hold(self, weight: int = 1) -> None:
        """A permit of ``weight`` units was granted (granted, in flight, units in flight)."""
        self.granted.inc()
        self.in_flight.inc()
        self.in_flight_units.inc(weight)

    def drop(self, weight: int = 1) -> None:
        """A permit of ``weight`` units ended (released or lost)."""
        self.in_flight.dec()
        self.in_flight_units.dec(weight)


class GateMetrics:
    """One gate's series of the client metrics, each looked up once, on its first use.

    ``metric.labels(...)`` takes the metric's lock and builds a key on every call; a permit
    counts into four series, so the gate keeps the children it used: the gate-wide ones as
    attributes, the per-call ones (priority, tenant) in one :class:`ClassMetrics` per (priority,
    tenant label), from :meth:`for_ask`. Created lazily, a series still appears when it first
    counts something, as with ``labels()`` at the call site.

    ``tenants``: the tenants labelled by name (the gate's configured ``tenant_weights``, or an
    allow-list of the application's); every other tenant is labelled ``other``.
    """

    def __init__(self, metrics: ClientMetrics, gate: str, tenants: Iterable[str] = ()) -> None:
        self._metrics = metrics
        self._gate = gate
        self._tenants: set[str] = set()
        self._classes: dict[tuple[int, str], ClassMetrics] = {}
        self.allow_tenants(tenants)

    # -- per call: priority and tenant ---------------------------------------------------------

    def allow_tenants(self, tenants: Iterable[str]) -> None:
        """Label these tenants by name from now on (added to those allowed before; at most
        :data:`MAX_TENANT_LABELS` in all, the first ones allowed)."""
        for tenant in tenants:
            if len(self._tenants) >= MAX_TENANT_LABELS:
                break
            if tenant and tenant != OTHER_TENANT:
                self._tenants.add(tenant)

    @property
    def tenants(self) -> frozenset[str]:
        """The tenants labelled by name."""
        return frozenset(self._tenants)

    def tenant_label(self, tenant: str | None) -> str:
        """The ``tenant`` label of ``tenant``: its name if allowed, ``""`` for the default
        tenant, else ``other``."""
        if not tenant:
            return ""
        return tenant if tenant in self._tenants else OTHER_TENANT

    def for_ask(self, priority: int = 0, tenant: str | None = None) -> ClassMetrics:
        """The series of a call of ``priority`` and ``tenant`` (cached per label pair)."""
        key = (priority, self.tenant_label(tenant))
        found = self._classes.get(key)
        if found is None:
            found = ClassMetrics(self._metrics, self._gate, str(priority), key[1])
            self._classes[key] = found
        return found

    def of(self, call: _Class) -> ClassMetrics:
        """:meth:`for_ask` of anything with ``priority`` and ``tenant`` (an ask, a lease)."""
        return self.for_ask(call.priority, call.tenant)

    @cached_property
    def default_class(self) -> ClassMetrics:
        """The series of priority 0 and the default tenant."""
        return self.for_ask(0, None)

    # -- gate-wide -----------------------------------------------------------------------------

    @cached_property
    def queue_depth(self) -> Gauge:
        return self._metrics.queue_depth.labels(self._gate)

    @cached_property
    def deadline_exceeded(self) -> Counter:
        return self._metrics.deadline_exceeded.labels(self._gate)

    @cached_property
    def deadline_unreachable(self) -> Counter:
        return self._metrics.deadline_unreachable.labels(self._gate)

    @cached_property
    def lease_lost(self) -> Counter:
        return self._metrics.lease_lost.labels(self._gate)

    # -- the default class's series, as attributes of the gate's -------------------------------
    # (a caller that does not say which class counts as priority 0 of the default tenant)

    @property
    def in_flight(self) -> Gauge:
        return self.default_class.in_flight

    @property
    def wait_seconds(self) -> Histogram:
        return self.default_class.wait_seconds

    @property
    def granted(self) -> Counter:
        return self.default_class.granted

    @property
    def rejected(self) -> Counter:
        return self.default_class.rejected


_lock = threading.Lock()
# Keyed by the registry itself, held weakly: keyed by id(), a registry collected after one test
# gave its id to the next test's registry, which then got metrics registered in the dead one
# (tests/tools/test_fake_fleet.py::test_overloaded_when_queue_full read no rejected count).
_by_registry: weakref.WeakKeyDictionary[CollectorRegistry, ClientMetrics] = (
    weakref.WeakKeyDictionary()
)


_G = ("gate",)

# ClientMetrics field (the metric is fleetgate_client_<field>) -> (kind, help, labels, buckets)
_SPECS: dict[str, tuple[type[Gauge | Counter | Histogram], str, tuple[str, ...], Any]] = {
    "in_flight": (Gauge, "Permits this process holds", CLASS_LABELS, None),
    "in_flight_units": (
        Gauge,
        "Units (the permits' weights) this process holds",
        CLASS_LABELS,
        None,
    ),
    "queue_depth": (
        Gauge,
        "Acquires of this process parked in the fleet-wide wait list",
        _G,
        None,
    ),
    "wait_seconds": (
        Histogram,
        "Time parked before a grant (parked grants only)",
        CLASS_LABELS,
        WAIT_BUCKETS,
    ),
    "expected_wait_seconds": (
        Histogram,
        "The wait the gate expected by its measured drain when a call parked (deadline-aware "
        "admission; parked calls with an estimate only): compare with wait_seconds",
        CLASS_LABELS,
        WAIT_BUCKETS,
    ),
    "granted": (Counter, "Permits granted", CLASS_LABELS, None),
    "revoked": (
        Counter,
        "Leases the gate asked back while held (a higher band waited past revoke_after)",
        CLASS_LABELS,
        None,
    ),
    "rejected": (
        Counter,
        "Acquires refused with Overloaded: wait list full, tenant bound, shed band, "
        "evicted by a higher band, heavier than the local share",
        CLASS_LABELS,
        None,
    ),
    "deadline_exceeded": (Counter, "Total deadlines that fired", _G, None),
    "deadline_unreachable": (
        Counter,
        "Acquires refused at once: by the gate's measured drain they would start after their "
        "deadline (DeadlineUnreachable, also counted in rejected)",
        _G,
        None,
    ),
    "lease_lost": (Counter, "Leases that could not be renewed", _G, None),
    "fallback": (
        Gauge,
        "1 while Redis is unreachable and the local fair-share bound applies",
        _G,
        None,
    ),
    "retries": (Counter, "Retries of calls made inside a permit", _G, None),
    "calls_per_request": (
        Histogram,
        "Calls one gate.map() request made",
        _G,
        (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000),
    ),
    "background_errors": (
        Counter,
        "Unexpected errors in background tasks (heartbeat, probe, wake listener, ...); "
        "each task logs, counts and carries on",
        ("task",),
        None,
    ),
}


def client_metrics(registry: CollectorRegistry | None = None) -> ClientMetrics:
    """The client metrics registered in ``registry`` (the default registry if None)."""
    reg = REGISTRY if registry is None else registry
    with _lock:
        found = _by_registry.get(reg)
        if found is not None:
            return found
        made: dict[str, Any] = {}
        for field, (kind, doc, labels, buckets) in _SPECS.items():
            extra = {} if buckets is None else {"buckets": buckets}
            made[field] = kind(f"fleetgate_client_{field}", doc, labels, registry=reg, **extra)
        m = _by_registry[reg] = ClientMetrics(**made)
        return m
