"""The client metrics' series: labelled by priority and by tenant, the tenants capped to an
allow-list (the rest are ``other``), the gate-wide names the default class's series."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from fleetgate.client._metrics import MAX_TENANT_LABELS, GateMetrics, client_metrics


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def test_metric_labels_priority_and_capped_tenants() -> None:
    registry = CollectorRegistry()
    series = GateMetrics(client_metrics(registry), "g", tenants=["search"])
    search = series.for_ask(10, "search")
    assert series.for_ask(10, "search") is search  # cached per (priority, tenant label)
    assert series.for_ask(10, "someone") is series.for_ask(10, "else")  # both 'other'
    assert series.tenant_label(None) == series.tenant_label("") == ""
    assert series.tenant_label("someone") == "other"
    assert search.labels == ("g", "10", "search")

    search.hold(4)
    search.wait_seconds.observe(0.2)
    series.for_ask(-5, "x").rejected.inc()
    assert (
        _value(registry, "fleetgate_client_in_flight", gate="g", priority="10", tenant="search")
        == 1
    )
    units = _value(
        registry, "fleetgate_client_in_flight_units", gate="g", priority="10", tenant="search"
    )
    assert units == 4
    assert (
        _value(registry, "fleetgate_client_granted_total", gate="g", priority="10", tenant="search")
        == 1
    )
    assert (
        _value(
            registry,
            "fleetgate_client_wait_seconds_count",
            gate="g",
            priority="10",
            tenant="search",
        )
        == 1
    )
    assert (
        _value(registry, "fleetgate_client_rejected_total", gate="g", priority="-5", tenant="other")
        == 1
    )
    search.drop(4)
    assert (
        _value(
            registry, "fleetgate_client_in_flight_units", gate="g", priority="10", tenant="search"
        )
        == 0
    )

    # the gate-wide names are the default class's series
    series.rejected.inc()
    assert (
        _value(registry, "fleetgate_client_rejected_total", gate="g", priority="0", tenant="") == 1
    )
    assert series.granted is series.for_ask().granted
    series.queue_depth.inc()
    assert _value(registry, "fleetgate_client_queue_depth", gate="g") == 1

    # the allow-list only grows, up to the cap; 'other' is never a tenant's own label
    series.allow_tenants(["other", *(f"t{i}" for i in range(2 * MAX_TENANT_LABELS))])
    assert len(series.tenants) == MAX_TENANT_LABELS and "search" in series.tenants
    assert series.tenant_label(f"t{2 * MAX_TENANT_LABELS - 1}") == "other"
    assert series.tenant_label("t0") == "t0"
