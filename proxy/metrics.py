"""The proxy's own metrics (prometheus-client), beside the client metrics of its fleet.

Both live in the registry the proxy is given, which ``/metrics`` serves. Labels: ``route`` is the
route's label (its ``name``, else its path; ``""`` for requests no route took), ``status`` the
HTTP status the caller got -- both bounded: routes come from the configuration, statuses are
three digits. ``fleetgate_proxy_buffered_body_bytes`` has no label: it is read from the proxy's
:class:`~._inbound.BodyBudget` when scraped (with ``--workers``: set by each worker 20 times a
second, summed over the live workers, as ``_in_flight`` is).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["ESTIMATE_ERROR_BUCKETS", "LATENCY_BUCKETS", "ProxyMetrics"]

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300,
)  # fmt: skip


#: |estimated - used| / used of a call's tokens (0.2: within 20 %)
ESTIMATE_ERROR_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 1, 2, 5, 10)


@dataclass(frozen=True)
class ProxyMetrics:
    requests: Counter
    seconds: Histogram
    in_flight: Gauge
    disconnects: Counter
    upstream_errors: Counter
    buffered_bytes: Gauge
    tokens_asked: Counter
    tokens_used: Counter
    token_estimate_error: Histogram

    def settled(self, route: str, asked: int, used: int) -> None:
        """A call on ``route`` asked ``asked`` tokens and its answer said it used ``used``."""
        self.tokens_asked.labels(route).inc(asked)
        self.tokens_used.labels(route).inc(used)
        if used > 0:
            self.token_estimate_error.labels(route).observe(abs(asked - used) / used)

    @classmethod
    def create(cls, registry: CollectorRegistry) -> ProxyMetrics:
        """The proxy's metrics, registered in ``registry`` (never the global one by accident:
        the caller names it)."""
        rs = ("route", "status")
        return cls(
            requests=Counter(
                "fleetgate_proxy_requests",
                "Requests answered, by route and the status the caller got",
                rs,
                registry=registry,
            ),
            seconds=Histogram(
                "fleetgate_proxy_request_seconds",
                "Request latency as the caller saw it (queue wait, upstream, body), by route and "
                "status: until the last byte was handed to the caller's connection",
                rs,
                buckets=LATENCY_BUCKETS,
                registry=registry,
            ),
            in_flight=Gauge(
                "fleetgate_proxy_in_flight",
                "Requests being handled (queued for a permit or forwarded), by route",
                ("route",),
                registry=registry,
                multiprocess_mode="livesum",  # --workers: the live workers' sum
            ),
            disconnects=Counter(
                "fleetgate_proxy_client_disconnects",
                "Callers that went away before their response was complete, by route and phase "
                "(queued: left the wait list; upstream: the call was cancelled; response: the "
                "stream was cut), the permit freed each time",
                ("route", "phase"),
                registry=registry,
            ),
            upstream_errors=Counter(
                "fleetgate_proxy_upstream_errors",
                "Calls that got no complete response from the upstream, by route and kind "
                "(connect, timeout, protocol, too_large)",
                ("route", "kind"),
                registry=registry,
            ),
            buffered_bytes=Gauge(
                "fleetgate_proxy_buffered_body_bytes",
                "Request body bytes buffered across all connections (bodies being read, queued "
                "for a permit or not yet sent upstream); at most max_buffered_bytes",
                registry=registry,
                multiprocess_mode="livesum",
            ),
            tokens_asked=Counter(
                "fleetgate_proxy_tokens_asked",
                "Tokens the permits of calls whose answer said its usage asked for (the estimate "
                "or X-Fleetgate-Tokens), by route",
                ("route",),
                registry=registry,
            ),
            tokens_used=Counter(
                "fleetgate_proxy_tokens_used",
                "Tokens those calls used (the answer's usage), by route",
                ("route",),
                registry=registry,
            ),
            token_estimate_error=Histogram(
                "fleetgate_proxy_token_estimate_error",
                "|tokens asked - tokens used| / tokens used of each call whose answer said its "
                "usage, by route",
                ("route",),
                buckets=ESTIMATE_ERROR_BUCKETS,
                registry=registry,
            ),
        )
