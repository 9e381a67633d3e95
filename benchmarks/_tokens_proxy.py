"""The token budget through ``fleetgate proxy``, for :mod:`benchmarks.tokens`: callers that
count no tokens send the OpenAI bodies to the proxy, which estimates each call's tokens from the
body (``tokens = "openai"``), holds the permit and settles it from the answer's ``usage``. One
route per kind of call (``/chat`` and ``/long``, both to the simulator's ``/v1/completions``),
so its estimate error is reported per route, read from the proxy's own ``/metrics``."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from fleetgate.tools.proxyproc import start_proxy_process, stop_process

__all__ = ["TENANT_HEADER", "estimate_errors", "proxy_for"]

TENANT_HEADER = "X-Fleetgate-Tenant"


def _config(redis_url: str, prefix: str, upstream: str, gate: str, routes: Sequence[str]) -> str:
    text = f"""
[redis]
url = "{redis_url}"
prefix = "{prefix}"

[proxy]
listen = "127.0.0.1:0"
access_log = false
"""
    for route in routes:
        text += f"""
[[routes]]
name = "{route}"
path = "/{route}"
strip_path = true
upstream = "{upstream}"
gate = "{gate}"
tokens = "openai"
deadline_ms = 120000
max_deadline_ms = 120000
tenants = ["*"]
"""
    return text


@contextlib.contextmanager
def proxy_for(
    redis_url: str, prefix: str, upstream: str, gate: str, routes: Sequence[str]
) -> Iterator[str]:
    """``fleetgate proxy`` in front of ``upstream`` for ``gate``, one route per name in
    ``routes`` (``/<name>/...`` forwarded as ``/...``); yields its base URL."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "proxy.toml")
        with open(path, "w") as f:
            f.write(_config(redis_url, prefix, upstream, gate, routes))
        proc, url = start_proxy_process(["--config", path], os.path.join(tmp, "proxy.log"))
        try:
            yield url
        finally:
            stop_process(proc, timeout=30)


async def estimate_errors(proxy_url: str) -> dict[str, dict[str, float]]:
    """Per route, from the proxy's metrics: calls settled, tokens asked and used, and the mean
    and the total error of its estimates (|asked - used| / used per call; asked / used - 1)."""
    async with httpx.AsyncClient(base_url=proxy_url, timeout=10) as http:
        text = (await http.get("/metrics")).text
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            route = s.labels.get("route")
            if route is None:
                continue
            row: dict[str, Any] = out.setdefault(route, {})
            if s.name == "fleetgate_proxy_token_estimate_error_sum":
                row["error_sum"] = s.value
            elif s.name == "fleetgate_proxy_token_estimate_error_count":
                row["calls"] = s.value
            elif s.name == "fleetgate_proxy_tokens_asked_total":
                row["asked"] = s.value
            elif s.name == "fleetgate_proxy_tokens_used_total":
                row["used"] = s.value
    for row in out.values():
        calls, used = row.get("calls", 0.0), row.get("used", 0.0)
        row["mean_error"] = row.get("error_sum", 0.0) / calls if calls else float("nan")
        row["total_error"] = row.get("asked", 0.0) / used - 1 if used else float("nan")
    return {r: row for r, row in out.items() if row.get("calls")}
