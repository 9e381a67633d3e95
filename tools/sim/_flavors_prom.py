"""The flavours whose servers write their metrics with prometheus_client in multiprocess mode
(SGLang, TensorRT-LLM) or in vLLM's style without a prefix (NIM): families rebuilt on every
scrape from the engine's state."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from fleetgate.tools.sim._flavor_base import BaseExposition, Histogram, split
from fleetgate.tools.sim._server import FifoLimiter

__all__ = ["NimExposition", "SglangExposition", "TrtllmExposition"]


class _Families:
    """A registry whose single collector yields freshly built families on every scrape."""

    def __init__(self, build: Callable[[], Iterable[Metric]]) -> None:
        self.registry = CollectorRegistry()
        self._build = build
        self.registry.register(self)

    def collect(self) -> Iterable[Metric]:
        return self._build()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _gauge(
    name: str, doc: str, labels: Sequence[str], rows: Iterable[tuple[list[str], float]]
) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=list(labels))
    for values, v in rows:
        g.add_metric(values, float(v))
    return g


def _counter(
    name: str, doc: str, labels: Sequence[str], rows: Iterable[tuple[list[str], float]]
) -> CounterMetricFamily:
    c = CounterMetricFamily(name, doc, labels=list(labels))
    for values, v in rows:
        c.add_metric(values, float(v))
    return c


def _histogram(
    name: str, doc: str, labels: Sequence[str], values: list[str], h: Histogram
) -> HistogramMetricFamily:
    fam = HistogramMetricFamily(name, doc, labels=list(labels))
    fam.add_metric(values, [(b, float(c)) for b, c in h.cumulative()], sum_value=h.total)
    return fam


class _FamiliesBase(BaseExposition):
    """A flavour rendered by prometheus_client: subclasses build the families from the limiter
    of the scrape in progress."""

    def __init__(self, model: str, engines: int, capacity_hint: int) -> None:
        super().__init__(model, engines, capacity_hint)
        self._limiter: FifoLimiter | None = None
        self._families = _Families(lambda: self._build(self._current()))

    def _current(self) -> FifoLimiter:
        assert self._limiter is not None, "families are built only while rendering"
        return self._limiter

    def _build(self, lim: FifoLimiter) -> Iterable[Metric]:
        raise NotImplementedError

    def render(self, limiter: FifoLimiter) -> bytes:
        self._limiter = limiter
        return self._families.render()


class SglangExposition(_FamiliesBase):
    """SGLang (``--enable-metrics``): scheduler gauges per DP rank, tokenizer counters."""

    def _build(self, lim: FifoLimiter) -> Iterable[Metric]:
        k = self.engines
        runs, waits, caps = split(lim.running, k), split(lim.waiting, k), split(lim.capacity, k)
        # Sorted label names, as the multiprocess collector writes them; dp_rank only with DP.
        names = ["engine_type", "model_name", "pp_rank", "tp_rank"]
        if k > 1:
            names = ["dp_rank", *names]

        def lv(i: int) -> list[str]:
            base = ["unified", self.model, "0", "0"]
            return [str(i), *base] if k > 1 else base

        def rows(values: list[int] | list[float]) -> list[tuple[list[str], float]]:
            return [(lv(i), float(values[i])) for i in range(k)]

        usage = [min(1.0, runs[i] / caps[i]) if caps[i] else 0.0 for i in range(k)]
        tok = ["model_name"]
        return [
            _gauge("sglang:num_running_reqs", "The number of running requests.", names, rows(runs)),
            _gauge("sglang:num_used_tokens", "The number of used tokens.", names, rows(runs)),
            _gauge("sglang:token_usage", "The token usage.", names, rows(usage)),
            _gauge(
                "sglang:gen_throughput",
                "The generation throughput (token/s).",
                names,
                rows([0.0] * k),
            ),
            _gauge(
                "sglang:num_queue_reqs",
                "The number of requests in the waiting queue.",
                names,
                rows(waits),
            ),
            _gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", names, rows([0.0] * k)),
            _counter(
                "sglang:prompt_tokens",
                "Number of prefill tokens processed.",
                tok,
                [([self.model], sum(self.c.prompt))],
            ),
            _counter(
                "sglang:generation_tokens",
                "Number of generation tokens processed.",
                tok,
                [([self.model], sum(self.c.generated))],
            ),
            _histogram(
                "sglang:e2e_request_latency_seconds",
                "Histogram of End-to-end request latency in seconds",
                tok,
                [self.model],
                self.c.e2e,
            ),
        ]


class TrtllmExposition(_FamiliesBase):
    """``trtllm-serve`` with ``return_perf_metrics``: multiprocess gauges with a ``pid`` label."""

    def __init__(self, model: str, engines: int, capacity_hint: int) -> None:
        super().__init__(model, engines, capacity_hint)
        self.pid = str(os.getpid())
        self.iteration = 0

    def _build(self, lim: FifoLimiter) -> Iterable[Metric]:
        names = ["engine_type", "model_name", "pid"]  # sorted, pid appended by the collector
        lv = ["undefined", "undefined", self.pid]
        usage = min(1.0, lim.running / lim.capacity) if lim.capacity else 0.0
        plain = ["engine_type", "model_name"]
        pv = ["undefined", "undefined"]
        return [
            _counter(
                "trtllm_request_success",
                "Count of successfully processed requests.",
                [*plain, "finished_reason"],
                [([*pv, "stop"], sum(self.c.ok))],
            ),
            _histogram(
                "trtllm_e2e_request_latency_seconds",
                "Histogram of end to end request latency in seconds.",
                plain,
                pv,
                self.c.e2e,
            ),
            _counter(
                "trtllm_prompt_tokens",
                "Cumulative number of prompt (input) tokens processed.",
                plain,
                [(pv, sum(self.c.prompt))],
            ),
            _counter(
                "trtllm_generation_tokens",
                "Cumulative number of generation (output) tokens produced.",
                plain,
                [(pv, sum(self.c.generated))],
            ),
            _gauge("trtllm_kv_cache_hit_rate", "KV cache hit rate", names, [(lv, 0.0)]),
            _gauge("trtllm_kv_cache_utilization", "KV cache utilization", names, [(lv, usage)]),
            _gauge(
                "trtllm_num_requests_running",
                "Number of active requests",
                names,
                [(lv, lim.running)],
            ),
            _gauge(
                "trtllm_num_requests_waiting",
                "Number of queued requests",
                names,
                [(lv, lim.waiting)],
            ),
        ]

    def render(self, limiter: FifoLimiter) -> bytes:
        """The Prometheus text at ``/prometheus/metrics``; each scrape counts as an iteration."""
        self.iteration += 1
        return super().render(limiter)

    def iteration_stats(self, limiter: FifoLimiter) -> bytes:
        """The JSON ``/metrics`` of ``trtllm-serve``: a list of iteration-stats objects."""
        stats: dict[str, Any] = {
            "iter": self.iteration,
            "iterLatencyMS": 0.0,
            "timestamp": time.strftime("%m-%d-%Y %H:%M:%S"),
            "numActiveRequests": limiter.running,
            "numQueuedRequests": limiter.waiting,
            "maxNumActiveRequests": limiter.capacity,
            "numCompletedRequests": sum(self.c.ok),
            "gpuMemUsage": 0,
            "cpuMemUsage": 0,
            "pinnedMemUsage": 0,
        }
        return msgspec.json.encode([stats])


class NimExposition(_FamiliesBase):
    """NIM for LLMs at ``/v1/metrics``: vLLM-style names without the ``vllm:`` prefix."""

    def _build(self, lim: FifoLimiter) -> Iterable[Metric]:
        lb, lv = ["model_name"], [self.model]
        usage = min(1.0, lim.running / lim.capacity) if lim.capacity else 0.0
        return [
            _gauge(
                "num_requests_running",
                "Number of requests currently running on GPU.",
                lb,
                [(lv, lim.running)],
            ),
            _gauge(
                "num_requests_waiting",
                "Number of requests waiting to be processed.",
                lb,
                [(lv, lim.waiting)],
            ),
            _gauge(
                "num_request_max",
                "Max number of concurrently running requests.",
                lb,
                [(lv, lim.capacity)],
            ),
            _gauge(
                "gpu_cache_usage_perc",
                "GPU KV-cache usage. 1 means 100 percent usage.",
                lb,
                [(lv, usage)],
            ),
            _counter(
                "prompt_tokens",
                "Number of prefill tokens processed.",
                lb,
                [(lv, sum(self.c.prompt))],
            ),
            _counter(
                "generation_tokens",
                "Number of generation tokens processed.",
                lb,
                [(lv, sum(self.c.generated))],
            ),
            _histogram(
                "e2e_request_latency_seconds",
                "Histogram of end to end request latency in seconds.",
                lb,
                lv,
                self.c.e2e,
            ),
        ]
