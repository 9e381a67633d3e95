"""What every flavour's exposition shares: the protocol the engine talks to, and the counting
(requests, tokens, latency histograms) behind each server's own text."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from fleetgate.tools.sim._server import FifoLimiter

__all__ = ["TEXT_PLAIN", "BaseExposition", "Exposition", "Histogram", "split"]

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
class Histogram:
    """Observations per cumulative bucket, their sum and count, as an exporter keeps them."""

    buckets: tuple[float, ...] = _LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def observe(self, value: float) -> None:
        """Count ``value`` in every bucket whose bound it does not exceed."""
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
    e2e: Histogram = field(default_factory=Histogram)
    queue: Histogram = field(default_factory=Histogram)

    def __post_init__(self) -> None:
        self.prompt = [0] * self.engines
        self.generated = [0] * self.engines
        self.ok = [0] * self.engines


class BaseExposition:
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
        """Count one finished request on ``engine``: its tokens and latencies."""
        self.c.prompt[engine] += prompt
        self.c.generated[engine] += generated
        self.c.ok[engine] += 1
        self.c.e2e.observe(e2e_s)
        self.c.queue.observe(queue_s)

    def aborted(self, engine: int) -> None:
        """Count one request the client abandoned."""
        self.c.aborted += 1

    def rejected(self) -> None:
        """Count one request refused as overloaded."""
        self.c.rejected += 1

    def arrived(self) -> None:
        """Note that a request arrived (a Rust exporter shows its gauges from then on)."""
        self.touched = True

    def render(self, limiter: FifoLimiter) -> bytes:
        """The exposition for the engine's current state (each flavour's own)."""
        raise NotImplementedError
