"""The ``/metrics`` exposition of each model-server flavour the simulator can pretend to be.

Same engine underneath (:class:`~fleetgate.tools.sim.vllm.VllmSim`: a FIFO of ``capacity`` slots);
what differs is the text a scraper sees and where: family names, HELP/TYPE lines, labels,
counter suffixes, blank lines and number formatting as each server's exporter writes them, at
its path. ``docs/servers.md`` cites the source files these follow. vLLM's own exposition lives in
:mod:`fleetgate.tools.sim.vllm`.

* ``sglang``, ``trtllm``: prometheus_client in multiprocess mode -- labels sorted, counters
  without ``_created``; TensorRT-LLM's gauges carry a ``pid`` label and ``"undefined"``
  model/engine labels, and its ``/metrics`` is JSON iteration stats (Prometheus text is at
  ``/prometheus/metrics``).
* ``nim``: vLLM-style names without a prefix, at ``/v1/metrics``.
* ``tgi``, ``tei``: Rust ``metrics-exporter-prometheus`` -- no ``_total`` suffix, a blank line
  after each family, TEI without HELP lines; a gauge appears once the server first sets it.
* ``llamacpp``: hand-written HELP/TYPE/value triples, no labels, counters then gauges.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from fleetgate.tools.sim._server import FifoLimiter

__all__ = ["FLAVORS", "METRICS_PATHS", "Exposition", "make_exposition", "split"]

FLAVORS = ("vllm", "sglang", "tgi", "tei", "llamacpp", "trtllm", "nim")
METRICS_PATHS = {
    "vllm": "/metrics",
    "sglang": "/metrics",
    "tgi": "/metrics",
    "tei": "/metrics",
    "llamacpp": "/metrics",
    "trtllm": "/prometheus/metrics",
    "nim": "/v1/metrics",
}
TEXT_PLAIN = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 20.0, 60.0)


def split(total: int, parts: int) -> list[int]:
    """Spread ``total`` over ``parts`` deterministically, lower indexes first."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


class Exposition(Protocol):
    """What a flavour's metrics need from the engine, and the text they produce."""

    content_type: str

    def finished(
        self, engine: int, prompt: int, generated: int, reason: str, e2e_s: float, queue_s: float
    ) -> None:
        """Record one finished request."""

    def aborted(self, engine: int) -> None:
        """Record one request the client abandoned."""

    def rejected(self) -> None:
        """Record one request refused as overloaded."""

    def render(self, limiter: FifoLimiter) -> bytes:
        """The exposition for the engine's current state."""


@dataclass
class _Histogram:
    buckets: tuple[float, ...] = _LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def observe(self, value: float) -> None:
        if not self.counts:
            self.counts = [0] * len(self.buckets)
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.n += 1

    def cumulative(self, fmt: Callable[[float], str] = repr) -> list[tuple[str, int]]:
        """``(le, count)`` pairs, ``+Inf`` last; ``fmt`` writes a bound as the exporter does."""
        counts = self.counts or [0] * len(self.buckets)
        return [(fmt(float(b)), c) for b, c in zip(self.buckets, counts, strict=True)] + [
            ("+Inf", self.n)
        ]


@dataclass
class _Counts:
    """Counters every flavour keeps (per engine where the server labels them)."""

    engines: int
    prompt: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    ok: list[int] = field(default_factory=list)
    aborted: int = 0
    rejected: int = 0
    e2e: _Histogram = field(default_factory=_Histogram)
    queue: _Histogram = field(default_factory=_Histogram)

    def __post_init__(self) -> None:
        self.prompt = [0] * self.engines
        self.generated = [0] * self.engines
        self.ok = [0] * self.engines


class _Base:
    """Counting shared by the flavours; subclasses only render."""

    content_type = TEXT_PLAIN

    def __init__(self, model: str, engines: int, capacity_hint: int) -> None:
        self.model = model
        self.engines = engines
        self.c = _Counts(engines)
        self.touched = False  # metrics-exporter-prometheus shows a gauge once it was set

    def finished(
        self, engine: int, prompt: int, generated: int, reason: str, e2e_s: float, queue_s: float
    ) -> None:
        self.c.prompt[engine] += prompt
        self.c.generated[engine] += generated
        self.c.ok[engine] += 1
        self.c.e2e.observe(e2e_s)
        self.c.queue.observe(queue_s)

    def aborted(self, engine: int) -> None:
        self.c.aborted += 1

    def rejected(self) -> None:
        self.c.rejected += 1

    def arrived(self) -> None:
        self.touched = True

    def render(self, limiter: FifoLimiter) -> bytes:
        raise NotImplementedError


# ------------------------------------------------------------ prometheus_client-based servers


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
    name: str, doc: str, labels: Sequence[str], values: list[str], h: _Histogram
) -> HistogramMetricFamily:
    fam = HistogramMetricFamily(name, doc, labels=list(labels))
    fam.add_metric(values, [(b, float(c)) for b, c in h.cumulative()], sum_value=h.total)
    return fam


class _FamiliesBase(_Base):
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


# ----------------------------------------------------------------- hand-formatted expositions


def _num(value: float) -> str:
    """A value as Rust's ``f64`` Display / C++'s stream write it: ``3``, ``0.5``."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _rust_family(
    lines: list[str],
    name: str,
    kind: str,
    help_text: str | None,
    samples: Sequence[tuple[str, float]],
) -> None:
    if help_text is not None:
        lines.append(f"# HELP {name} {help_text}")
    lines.append(f"# TYPE {name} {kind}")
    lines.extend(f"{name}{labels} {_num(v)}" for labels, v in samples)
    lines.append("")


def _rust_histogram(lines: list[str], name: str, help_text: str | None, h: _Histogram) -> None:
    if help_text is not None:
        lines.append(f"# HELP {name} {help_text}")
    lines.append(f"# TYPE {name} histogram")
    lines.extend(f'{name}_bucket{{le="{b}"}} {c}' for b, c in h.cumulative(_num))
    lines.append(f"{name}_sum {_num(h.total)}")
    lines.append(f"{name}_count {h.n}")
    lines.append("")


class TgiExposition(_Base):
    """Text Generation Inference: batch size and queue gauges, described (HELP) families."""

    content_type = "text/plain; charset=utf-8"  # axum's type for a String body

    def render(self, limiter: FifoLimiter) -> bytes:
        c, out = self.c, list[str]()
        _rust_family(
            out,
            "tgi_request_count",
            "counter",
            "Total number of requests",
            [("", sum(c.ok) + c.aborted + c.rejected)],
        )
        _rust_family(
            out,
            "tgi_request_success",
            "counter",
            "Number of successful requests",
            [("", sum(c.ok))],
        )
        if c.rejected:
            _rust_family(
                out, "tgi_request_failure", "counter", None, [('{err="overloaded"}', c.rejected)]
            )
        if self.touched:
            _rust_family(
                out, "tgi_queue_size", "gauge", "Current queue size", [("", limiter.waiting)]
            )
            _rust_family(
                out,
                "tgi_batch_current_size",
                "gauge",
                "Current batch size",
                [("", limiter.running)],
            )
            _rust_family(
                out,
                "tgi_batch_current_max_tokens",
                "gauge",
                "Maximum tokens for the current batch",
                [("", 64 * limiter.running)],
            )
        if c.e2e.n:
            _rust_histogram(out, "tgi_request_duration", "Request duration", c.e2e)
        return "\n".join(out).encode() + (b"\n" if out else b"")


class TeiExposition(_Base):
    """Text Embeddings Inference: a queue gauge and counters, no HELP lines, no in-flight gauge."""

    content_type = "text/plain; charset=utf-8"

    def render(self, limiter: FifoLimiter) -> bytes:
        c, out = self.c, list[str]()
        if self.touched:
            total = sum(c.ok) + c.aborted + c.rejected
            _rust_family(out, "te_request_count", "counter", None, [('{method="single"}', total)])
        if sum(c.ok):
            _rust_family(
                out, "te_request_success", "counter", None, [('{method="single"}', sum(c.ok))]
            )
            _rust_family(out, "te_embed_count", "counter", None, [("", sum(c.ok))])
            _rust_family(out, "te_embed_success", "counter", None, [("", sum(c.ok))])
        if c.rejected:
            _rust_family(
                out, "te_request_failure", "counter", None, [('{err="overloaded"}', c.rejected)]
            )
        if self.touched:
            _rust_family(out, "te_queue_size", "gauge", None, [("", limiter.waiting)])
        if c.e2e.n:
            sizes = _Histogram(buckets=tuple(float(2**i) for i in range(13)))
            for _ in range(c.e2e.n):
                sizes.observe(1.0)
            _rust_histogram(out, "te_batch_next_size", None, sizes)
        return "\n".join(out).encode() + (b"\n" if out else b"")


class LlamacppExposition(_Base):
    """llama.cpp ``llama-server --metrics``: unlabelled counters, then gauges."""

    content_type = "text/plain; version=0.0.4"

    def __init__(self, model: str, engines: int, capacity_hint: int) -> None:
        super().__init__(model, engines, capacity_hint)
        self.decodes = 0
        self.busy_slots = 0

    def render(self, limiter: FifoLimiter) -> bytes:
        c = self.c
        # Each scrape stands in for one decode step: slots busy now.
        self.decodes += 1
        self.busy_slots += limiter.running
        counters = [
            ("prompt_tokens_total", "Number of prompt tokens processed.", sum(c.prompt)),
            ("prompt_seconds_total", "Prompt process time", 0),
            ("tokens_predicted_total", "Number of generation tokens processed.", sum(c.generated)),
            ("tokens_predicted_seconds_total", "Predict process time", 0),
            ("n_decode_total", "Total number of llama_decode() calls", self.decodes),
            ("n_tokens_max", "Largest observed n_tokens.", 0),
        ]
        gauges = [
            ("prompt_tokens_seconds", "Average prompt throughput in tokens/s.", 0),
            ("predicted_tokens_seconds", "Average generation throughput in tokens/s.", 0),
            ("requests_processing", "Number of requests processing.", limiter.running),
            ("requests_deferred", "Number of requests deferred.", limiter.waiting),
            (
                "n_busy_slots_per_decode",
                "Average number of busy slots per llama_decode() call",
                self.busy_slots / max(self.decodes, 1),
            ),
        ]
        out: list[str] = []
        for kind, items in (("counter", counters), ("gauge", gauges)):
            for name, help_text, value in items:
                out.append(f"# HELP llamacpp:{name} {help_text}")
                out.append(f"# TYPE llamacpp:{name} {kind}")
                out.append(f"llamacpp:{name} {_num(value)}")
        return ("\n".join(out) + "\n").encode()


_MAKERS: dict[str, Callable[[str, int, int], _Base]] = {
    "sglang": SglangExposition,
    "trtllm": TrtllmExposition,
    "nim": NimExposition,
    "tgi": TgiExposition,
    "tei": TeiExposition,
    "llamacpp": LlamacppExposition,
}


def make_exposition(flavor: str, model: str, engines: int, capacity: int) -> _Base:
    """The exposition of a non-vLLM ``flavor`` (vLLM's lives in :mod:`fleetgate.tools.sim.vllm`)."""
    return _MAKERS[flavor](model, engines, capacity)
