"""The :class:`Signals` struct: what one gate's model server(s) report in one poll."""

from __future__ import annotations

import msgspec

__all__ = ["Signals"]


class Signals(msgspec.Struct, frozen=True):
    """What one gate's model server(s) report. ``None`` = unknown, never "zero".

    ``waiting_capacity`` is the saturation signal: requests the engine could not schedule for lack
    of capacity (vLLM's ``num_requests_waiting_by_reason{reason="capacity"}``, or all waiting
    requests on servers without that gauge). ``kv_cache_usage`` is a fraction (1 = full), the
    maximum over engines and replicas. ``ok`` is False when a scrape failed or ``running`` /
    ``waiting_capacity`` had an invalid value (NaN, infinite, negative); ``error`` names every
    failure and invalid value, also of the other two fields (which are then None).

    ``server`` is the server kind whose adapter read the text (``"vllm"``, ``"tei"``, ...), set
    by the coordinator's metrics source (None when unknown, e.g. nothing was recognised yet).
    A kind without an in-flight gauge (TEI) always reports ``running`` None.

    ``preemptions`` and ``admission_rejections`` are the raw readings: requests the engine
    preempted, retracted or paused (vLLM's cumulative counter ``num_preemptions_total``;
    SGLang's ``num_retracted_reqs`` and TensorRT-LLM's ``num_paused_requests`` gauges) and
    requests it refused admission (vLLM's counter ``admission_rejections_total``), summed over
    engines and replicas. None when the server exports no such metric (most kinds), never 0.
    ``preempted`` is what the controller acts on (any is saturation): the gauges' value plus the
    counters' increase since the last poll (the metrics source keeps the last reading).
    ``max_requests`` is the request capacity the server states (NIM, TensorRT-LLM, llama.cpp's
    ``/props``), ``kv_tokens`` its KV cache in tokens (vLLM, SGLang; reported only).
    """

    running: float | None = None
    waiting_capacity: float | None = None
    waiting: float | None = None
    kv_cache_usage: float | None = None
    ok: bool = True
    error: str | None = None
    server: str | None = None
    preemptions: float | None = None
    admission_rejections: float | None = None
    #: the requests the server admits at once, as it states them (None: it does not)
    max_requests: float | None = None
    #: the KV cache's size in tokens, as the server states it (reported; None: it does not)
    kv_tokens: float | None = None
    #: preemptions and rejections since the last poll (counters' increase, gauges' value)
    preempted: float | None = None
    #: the kind does not count requests it has not dispatched yet (llama.cpp)
    hidden_queue: bool = False

    @classmethod
    def failure(cls, error: str) -> Signals:
        """A failed observation: everything unknown."""
        return cls(ok=False, error=error)

    @property
    def saturated(self) -> bool | None:
        """True when requests wait for capacity, False when none do, None when unknown."""
        if self.waiting_capacity is None:
            return None
        return self.waiting_capacity > 0
