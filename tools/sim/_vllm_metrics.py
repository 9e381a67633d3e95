"""vLLM's own ``/metrics``: its family names, HELP/TYPE lines and ``model_name``/``engine`` labels,
with the scheduler gauges filled from the engine's limiter at scrape time."""

from __future__ import annotations

from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

from fleetgate.tools.sim._flavor_base import split
from fleetgate.tools.sim._server import TEXT_PLAIN
from fleetgate.tools.sim._vllm_config import VllmSimConfig
from fleetgate.tools.sim._vllm_kv import KvScheduler


class Occupancy(Protocol):
    """What the scheduler gauges are set from: a FifoLimiter, or the KV scheduler."""

    @property
    def capacity(self) -> int: ...

    @property
    def running(self) -> int: ...

    @property
    def waiting(self) -> int: ...


__all__ = ["VllmMetrics"]

# vLLM's request_latency_buckets (v1/metrics/loggers.py), used for e2e and queue time.
_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
_FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
_LEGACY_FINISH_REASONS = ("stop", "length", "abort")
_LABELS = ("model_name", "engine")
_HELP_BY_REASON = (
    "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling "
    "capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked "
    "status). Sum of all reasons equals vllm:num_requests_waiting."
)


class VllmMetrics:
    """vLLM's Prometheus families on a private registry; gauges are filled at scrape time."""

    content_type = TEXT_PLAIN

    def __init__(self, config: VllmSimConfig) -> None:
        """Register every family of ``config``'s metric set, each series at zero."""
        reg = self.registry = CollectorRegistry()
        lbl = list(_LABELS)
        self.engines = [str(i) for i in range(config.engines)]
        self.model = config.model
        legacy = config.legacy_metrics
        kw: dict[str, Any] = {"labelnames": lbl, "registry": reg}
        hist: dict[str, Any] = {**kw, "buckets": _LATENCY_BUCKETS}
        # Registration order is exposition order; names and HELP strings are vLLM's own.
        self.running = Gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", **kw
        )
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", **kw
        )
        self.by_reason = (
            None
            if legacy
            else Gauge(
                "vllm:num_requests_waiting_by_reason",
                _HELP_BY_REASON,
                [*lbl, "reason"],
                registry=reg,
            )
        )
        if legacy:
            self.kv = Gauge(
                "vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.", **kw
            )
        else:
            self.kv = Gauge(
                "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", **kw
            )
        self.preemptions = Counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.", **kw
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", **kw
        )
        self.gen_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", **kw
        )
        self.success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*lbl, "finished_reason"],
            registry=reg,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            **hist,
        )
        self.queue = Histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            **hist,
        )
        if config.kv_tokens is not None:
            # vLLM states its cache as an info gauge (value 1) whose labels are the settings
            info = Gauge(
                "vllm:cache_config_info",
                "Information of the LLMEngine CacheConfig",
                ["block_size", "cache_dtype", "num_gpu_blocks", "enable_prefix_caching"],
                registry=reg,
            )
            blocks = config.kv_tokens // config.block_size
            info.labels(str(config.block_size), "auto", str(blocks), "False").set(1)
        self._create_series(_LEGACY_FINISH_REASONS if legacy else _FINISH_REASONS)

    def _create_series(self, finish_reasons: tuple[str, ...]) -> None:
        """Every series exists from the start, as in vLLM."""
        for eng in self.engines:
            for metric in (
                self.running,
                self.waiting,
                self.kv,
                self.preemptions,
                self.prompt_tokens,
                self.gen_tokens,
                self.e2e,
                self.queue,
            ):
                metric.labels(self.model, eng)
            for reason in finish_reasons:
                self.success.labels(self.model, eng, reason)
            if self.by_reason is not None:
                self.by_reason.labels(self.model, eng, "capacity")
                self.by_reason.labels(self.model, eng, "deferred")

    def finished(
        self, engine: int, prompt: int, generated: int, reason: str, e2e_s: float, queue_s: float
    ) -> None:
        """Record one finished request on ``engine``."""
        eng = self.engines[engine]
        self.prompt_tokens.labels(self.model, eng).inc(prompt)
        self.gen_tokens.labels(self.model, eng).inc(generated)
        self.success.labels(self.model, eng, reason).inc()
        self.e2e.labels(self.model, eng).observe(e2e_s)
        self.queue.labels(self.model, eng).observe(queue_s)

    def preempted(self, engine: int, n: int) -> None:
        """Record ``n`` preemptions on ``engine`` (the KV cache ran out while decoding)."""
        self.preemptions.labels(self.model, self.engines[engine]).inc(n)

    def aborted(self, engine: int) -> None:
        """Record one request the client abandoned."""
        self.success.labels(self.model, self.engines[engine], "abort").inc()

    def rejected(self) -> None:
        """vLLM refuses nothing as overloaded; the simulator's 503s are not counted."""

    def arrived(self) -> None:
        """vLLM's gauges exist from the start."""

    def render(self, limiter: Occupancy, *, kv: KvScheduler | None = None) -> bytes:
        """Set the scheduler gauges from ``limiter`` (the KV cache usage from ``kv`` when the
        engine has one, else running / capacity) and return the text exposition."""
        k = len(self.engines)
        runs, waits = split(limiter.running, k), split(limiter.waiting, k)
        caps = split(limiter.capacity, k)
        for i, eng in enumerate(self.engines):
            self.running.labels(self.model, eng).set(runs[i])
            self.waiting.labels(self.model, eng).set(waits[i])
            usage = min(1.0, runs[i] / caps[i]) if caps[i] else (1.0 if runs[i] else 0.0)
            if kv is not None:
                usage = kv.usage
            self.kv.labels(self.model, eng).set(usage)
            if self.by_reason is not None:
                self.by_reason.labels(self.model, eng, "capacity").set(waits[i])
                self.by_reason.labels(self.model, eng, "deferred").set(0)
        return generate_latest(self.registry)
