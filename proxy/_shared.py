"""What one worker of ``fleetgate proxy --workers N`` shares with the others.

A worker is a whole proxy (its own Fleet, app and uvicorn) told by :class:`WorkerContext` that it
is one of N: the Via name they all use (a request that comes back is a loop whichever worker
takes it), the signals it obeys (SIGTERM only: the parent turns a Ctrl-C into one SIGTERM per
worker) and :class:`SharedMetrics`, prometheus-client's multiprocess mode over the directory the
parent made: every worker writes its metric values there, and ``/metrics`` and ``/healthz``,
answered by whichever worker the kernel gave the connection, read all of them.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.exposition import generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

__all__ = ["MULTIPROC_ENV", "SharedMetrics", "WorkerContext", "WorkerGauges"]

#: prometheus-client reads it when it is imported: the parent sets it for its workers
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


class SharedMetrics:
    """The metrics of all workers, merged by prometheus-client's
    :class:`~prometheus_client.multiprocess.MultiProcessCollector` from the files in ``path``:
    counters and histograms summed, the proxy's gauges by their ``multiprocess_mode`` (live
    workers only), the client's gauges one series per worker (``pid`` label)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.registry = CollectorRegistry()
        MultiProcessCollector(self.registry, path=path)  # type: ignore[no-untyped-call]

    def exposition(self) -> bytes:
        """``/metrics``: every worker's metrics in the text format."""
        return generate_latest(self.registry)

    def status(self) -> tuple[int, int]:
        """(live workers, live workers in fallback), from the gauges of :class:`WorkerGauges`."""
        found = {"fleetgate_proxy_workers": 0.0, "fleetgate_proxy_workers_in_fallback": 0.0}
        for family in self.registry.collect():
            if family.name in found:
                found[family.name] = sum(s.value for s in family.samples)
        return int(found["fleetgate_proxy_workers"]), int(
            found["fleetgate_proxy_workers_in_fallback"]
        )


@dataclass(frozen=True)
class WorkerGauges:
    """Two gauges each worker sets for ``/healthz`` (and for dashboards): 1 while it lives, and
    1 while its fleet is in fallback; summed over live workers (``livesum``: the parent marks a
    dead worker's files dead)."""

    workers: Gauge
    in_fallback: Gauge

    @classmethod
    def create(cls, registry: CollectorRegistry) -> WorkerGauges:
        """The gauges, registered in ``registry`` (the worker's own)."""
        return cls(
            workers=Gauge(
                "fleetgate_proxy_workers",
                "Worker processes of this proxy that are serving (--workers)",
                registry=registry,
                multiprocess_mode="livesum",
            ),
            in_fallback=Gauge(
                "fleetgate_proxy_workers_in_fallback",
                "Worker processes whose fleet is in fallback (Redis unreachable: the local "
                "fair-share bound applies)",
                registry=registry,
                multiprocess_mode="livesum",
            ),
        )


@dataclass(frozen=True)
class WorkerContext:
    """One worker's part of ``fleetgate proxy --workers N``."""

    #: the workers' one name in Via (``fleetgate-<8 hex>``), chosen by the parent
    via_name: str
    #: N, as configured
    workers: int
    #: the directory of the workers' metric files (``PROMETHEUS_MULTIPROC_DIR``)
    metrics_dir: str
    #: the signals that start the drain (a second one stops at once)
    signals: tuple[signal.Signals, ...] = (signal.SIGTERM,)
    #: the parent's pid (the parent sends it: a worker's own ``os.getppid()`` reads 1 when
    #: the parent died first): a worker whose parent is gone drains and exits
    parent: int = field(default_factory=os.getppid)

    def shared(self) -> SharedMetrics:
        """The metrics of all workers (see :class:`SharedMetrics`)."""
        return SharedMetrics(self.metrics_dir)
