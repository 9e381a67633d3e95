"""Simulated model servers that stand in for GPUs in tests, benchmarks, the demo and compose.

- :mod:`fleetgate.tools.sim.vllm`: OpenAI-compatible endpoints with a hard ``max_num_seqs``
  capacity (excess waits in FIFO) and vLLM's exact ``/metrics`` exposition -- or, with
  ``--flavor``, that of SGLang, TGI, TEI, llama.cpp, TensorRT-LLM or NIM at their paths
  (:mod:`fleetgate.tools.sim.flavors`).
- :mod:`fleetgate.tools.sim.rerank`: a NIM-like ``/v1/ranking`` with a bounded queue (503), a
  server-side timeout (504) and a service time that grows with the passages.

Both share ``/health``, ``/metrics``, ``POST /admin/capacity``, ``GET /admin/stats`` and
``POST /admin/reset-peaks``. :func:`serve_in_thread` runs either app on a free loopback port::

    from fleetgate.tools.sim import serve_in_thread, vllm

    with serve_in_thread(vllm.build_app(vllm.VllmSimConfig(capacity=4))) as served:
        ...  # served.url, e.g. "http://127.0.0.1:41234"; served.state.sim is the engine

The simulators need the ``sim`` extra (starlette, uvicorn).
"""

from __future__ import annotations

from fleetgate.tools.sim._server import FifoLimiter, QueueFull, Served, serve_in_thread

__all__ = ["FifoLimiter", "QueueFull", "Served", "serve_in_thread"]
