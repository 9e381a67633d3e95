"""The proxy benchmark's streaming part: streamed chat completions (server-sent events) from the
vLLM simulator, straight and through ``fleetgate proxy``, one at a time.

Each call's time to first token (the first content chunk) and to its end are taken on the
caller's side; the proxy's added time to first token is the difference of the two ways' p50 and
p99, and the spread of the chunks' arrivals shows that they pass one by one (a proxy that buffered
the answer would deliver every chunk at the end).
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

from ._common import percentiles

__all__ = ["SIM_ARGS", "TOKENS", "streaming"]

#: the simulator's timing: 20 ms to the first token, then TOKENS tokens over 100 ms
SIM_ARGS = ("--capacity", "64", "--prefill-ms", "20", "--service-ms", "100")
TOKENS = 20
_BODY = {
    "model": "sim-model",
    "messages": [{"role": "user", "content": "hello"}],
    "max_tokens": TOKENS,
    "stream": True,
}


def _one(http: httpx.Client, base: str) -> tuple[float, float, list[float]]:
    """One streamed call: (time to first token, time to [DONE], each content chunk's arrival)."""
    arrivals: list[float] = []
    t0 = time.perf_counter()
    with http.stream("POST", base + "/v1/chat/completions", json=_BODY) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[len("data: ") :])["choices"][0]["delta"]
            if delta.get("content"):
                arrivals.append(time.perf_counter() - t0)
    if len(arrivals) != TOKENS:
        raise RuntimeError(f"{len(arrivals)} content chunks, not {TOKENS}")
    return arrivals[0], time.perf_counter() - t0, arrivals


def streaming(direct: str, proxied: str, n: int) -> dict[str, Any]:
    """``n`` streamed calls each way, alternating: time to first token and to the end (ms), the
    proxy's added time to first token, and how spread the chunks arrived (the median call's
    last-minus-first chunk, ms)."""
    got: dict[str, dict[str, list[float]]] = {
        k: {"ttft": [], "total": [], "spread": []} for k in ("direct", "proxy")
    }
    with httpx.Client(timeout=30) as http:
        for base in (direct, proxied):  # warm: connections, the gate's first registration
            for _ in range(5):
                _one(http, base)
        for _ in range(n):
            for label, base in (("direct", direct), ("proxy", proxied)):
                ttft, total, arrivals = _one(http, base)
                got[label]["ttft"].append(ttft)
                got[label]["total"].append(total)
                got[label]["spread"].append(arrivals[-1] - arrivals[0])
    out: dict[str, Any] = {
        label: {
            k: {p: v * 1000 for p, v in percentiles(vs, (50, 99)).items()} for k, vs in m.items()
        }
        for label, m in got.items()
    }
    out["added_ttft_ms"] = {
        p: out["proxy"]["ttft"][p] - out["direct"]["ttft"][p] for p in ("p50", "p99")
    }
    out["tokens"], out["calls"] = TOKENS, n
    return out
