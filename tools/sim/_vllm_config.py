"""The settings of one simulated vLLM server, checked when made."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fleetgate.tools.sim.flavors import FLAVORS, METRICS_PATHS

__all__ = ["LOGNORMAL_SIGMA", "ServiceDist", "VllmSimConfig"]

ServiceDist = Literal["fixed", "exp", "lognormal"]
#: sigma of the lognormal service time (its mean is kept at ``service_ms``)
LOGNORMAL_SIGMA = 0.5


@dataclass(frozen=True)
class VllmSimConfig:
    """Settings of one simulated vLLM server (see ``--help`` for each field's meaning)."""

    model: str = "sim-model"
    capacity: int = 8
    engines: int = 1
    service_ms: float = 50.0
    #: time from admission to the first token, before the service time (the decode)
    prefill_ms: float = 0.0
    service_dist: ServiceDist = "fixed"
    occupancy_slowdown: float = 0.0
    max_waiting: int | None = None
    legacy_metrics: bool = False
    seed: int | None = None
    embedding_dim: int = 16
    max_model_len: int = 8192
    flavor: str = "vllm"
    metrics: bool = True
    #: TGI/TEI's ``--max-concurrent-requests`` (None: the server's default, 128 / 512)
    max_concurrent_requests: int | None = None
    #: the status of a request refused past ``max_waiting`` (503, or 429 as API gateways do)
    overload_status: int = 503
    #: KV-cache tokens (vLLM's GPU blocks x block size; None: no KV limit, slots alone):
    #: sequences are admitted while their blocks fit, and preempted when decoding runs out
    kv_tokens: int | None = None
    block_size: int = 16
    #: decode time per output token in ms (None: the service time does not depend on the
    #: output length)
    ms_per_token: float | None = None
    #: with ``kv_tokens``: prefill time per token a sequence holds when it is admitted (its
    #: prompt; after a preemption its prompt and what it had generated: the recompute)
    prefill_ms_per_token: float = 0.0

    @property
    def concurrency_limit(self) -> int | None:
        """Requests admitted at once (running + queued) before a 429, or None (no such limit)."""
        if self.max_concurrent_requests is not None:
            return self.max_concurrent_requests
        return {"tgi": 128, "tei": 512}.get(self.flavor)

    @property
    def metrics_path(self) -> str | None:
        """Where this flavour serves its Prometheus text (None with ``--no-metrics``)."""
        return METRICS_PATHS[self.flavor] if self.metrics else None

    def __post_init__(self) -> None:
        """Reject settings no server could have."""
        if self.flavor not in FLAVORS:
            raise ValueError(f"unknown flavor {self.flavor!r} (known: {', '.join(FLAVORS)})")
        if self.max_concurrent_requests is not None and (
            self.flavor not in ("tgi", "tei") or self.max_concurrent_requests < 1
        ):
            raise ValueError("max_concurrent_requests is TGI's and TEI's, and must be >= 1")
        if self.capacity < 0 or self.engines < 1 or min(self.service_ms, self.prefill_ms) < 0:
            raise ValueError("need capacity >= 0, engines >= 1, service_ms and prefill_ms >= 0")
        if self.service_dist not in ("fixed", "exp", "lognormal"):
            raise ValueError(f"unknown service_dist {self.service_dist!r}")
        if self.occupancy_slowdown < 0 or (self.max_waiting is not None and self.max_waiting < 0):
            raise ValueError("occupancy_slowdown and max_waiting must be >= 0")
        if self.embedding_dim < 1:
            raise ValueError("embedding_dim must be >= 1")
        if self.overload_status not in (429, 503):
            raise ValueError("overload_status must be 429 or 503")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.kv_tokens is not None and (
            self.flavor != "vllm" or self.kv_tokens < self.block_size
        ):
            raise ValueError("kv_tokens is vLLM's (flavor vllm) and must be >= block_size")
        if (self.ms_per_token is not None and self.ms_per_token < 0) or (
            self.prefill_ms_per_token < 0
        ):
            raise ValueError("ms_per_token and prefill_ms_per_token must be >= 0")
