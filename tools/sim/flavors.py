"""The ``/metrics`` exposition of each model-server flavour the simulator can pretend to be.

Same engine underneath (:class:`~fleetgate.tools.sim.vllm.VllmSim`: a FIFO of ``capacity`` slots);
what differs is the text a scraper sees and where: family names, HELP/TYPE lines, labels,
counter suffixes, blank lines and number formatting as each server's exporter writes them, at
its path. ``docs/servers.md`` cites the source files these follow. vLLM's own exposition lives in
``_vllm_metrics.py``.

* ``sglang``, ``trtllm``: prometheus_client in multiprocess mode -- labels sorted, counters
  without ``_created``; TensorRT-LLM's gauges carry a ``pid`` label and ``"undefined"``
  model/engine labels, and its ``/metrics`` is JSON iteration stats (Prometheus text is at
  ``/prometheus/metrics``).
* ``nim``: vLLM-style names without a prefix, at ``/v1/metrics``.
* ``tgi``, ``tei``: Rust ``metrics-exporter-prometheus`` -- no ``_total`` suffix, a blank line
  after each family, TEI without HELP lines; a gauge appears once the server first sets it.
* ``llamacpp``: hand-written HELP/TYPE/value triples, no labels, counters then gauges.

The counting they share is in ``_flavor_base.py``; the prometheus_client-based flavours (SGLang,
TensorRT-LLM, NIM) are in ``_flavors_prom.py``, the hand-formatted ones (TGI, TEI, llama.cpp) in
``_flavors_text.py``.
"""

from __future__ import annotations

from collections.abc import Callable

from fleetgate.tools.sim._flavor_base import BaseExposition, Exposition, split
from fleetgate.tools.sim._flavors_prom import NimExposition, SglangExposition, TrtllmExposition
from fleetgate.tools.sim._flavors_text import LlamacppExposition, TeiExposition, TgiExposition

__all__ = [
    "FLAVORS",
    "METRICS_PATHS",
    "Exposition",
    "LlamacppExposition",
    "NimExposition",
    "SglangExposition",
    "TeiExposition",
    "TgiExposition",
    "TrtllmExposition",
    "make_exposition",
    "split",
]

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


_MAKERS: dict[str, Callable[[str, int, int], BaseExposition]] = {
    "sglang": SglangExposition,
    "trtllm": TrtllmExposition,
    "nim": NimExposition,
    "tgi": TgiExposition,
    "tei": TeiExposition,
    "llamacpp": LlamacppExposition,
}


def make_exposition(flavor: str, model: str, engines: int, capacity: int) -> BaseExposition:
    """The exposition of a non-vLLM ``flavor`` (vLLM's is in ``_vllm_metrics.py``)."""
    return _MAKERS[flavor](model, engines, capacity)
