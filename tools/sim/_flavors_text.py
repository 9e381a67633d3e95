"""The flavours whose servers write their exposition by hand: TGI and TEI (Rust's
``metrics-exporter-prometheus``: no ``_total`` suffix, a blank line after each family) and
llama.cpp (HELP/TYPE/value triples, no labels)."""

from __future__ import annotations

from collections.abc import Sequence

from fleetgate.tools.sim._flavor_base import BaseExposition, Histogram
from fleetgate.tools.sim._server import FifoLimiter

__all__ = ["LlamacppExposition", "TeiExposition", "TgiExposition"]


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


def _rust_histogram(lines: list[str], name: str, help_text: str | None, h: Histogram) -> None:
    if help_text is not None:
        lines.append(f"# HELP {name} {help_text}")
    lines.append(f"# TYPE {name} histogram")
    lines.extend(f'{name}_bucket{{le="{b}"}} {c}' for b, c in h.cumulative(_num))
    lines.append(f"{name}_sum {_num(h.total)}")
    lines.append(f"{name}_count {h.n}")
    lines.append("")


class TgiExposition(BaseExposition):
    """Text Generation Inference: batch size and queue gauges, described (HELP) families."""

    content_type = "text/plain; charset=utf-8"  # axum's type for a String body

    def render(self, limiter: FifoLimiter) -> bytes:
        """TGI's ``/metrics`` text for the engine's current state."""
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


class TeiExposition(BaseExposition):
    """Text Embeddings Inference: a queue gauge and counters, no HELP lines, no in-flight gauge."""

    content_type = "text/plain; charset=utf-8"

    def render(self, limiter: FifoLimiter) -> bytes:
        """TEI's ``/metrics`` text for the engine's current state."""
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
            sizes = Histogram(buckets=tuple(float(2**i) for i in range(13)))
            for _ in range(c.e2e.n):
                sizes.observe(1.0)
            _rust_histogram(out, "te_batch_next_size", None, sizes)
        return "\n".join(out).encode() + (b"\n" if out else b"")


class LlamacppExposition(BaseExposition):
    """llama.cpp ``llama-server --metrics``: unlabelled counters, then gauges."""

    content_type = "text/plain; version=0.0.4"

    def __init__(self, model: str, engines: int, capacity_hint: int) -> None:
        super().__init__(model, engines, capacity_hint)
        self.decodes = 0
        self.busy_slots = 0

    def render(self, limiter: FifoLimiter) -> bytes:
        """llama.cpp's ``/metrics`` text; each scrape counts as one decode step."""
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
