"""Load signals of model servers: metrics URLs, a bounded scrape, parsing and combining replicas.

The coordinator polls each adaptive gate's Prometheus endpoint(s) and turns the text into
:class:`Signals` -- running requests, requests waiting for capacity, all waiting requests and
KV-cache usage -- for one ``model_name``, summed over engines and replicas. The per-kind gauge
names live in :mod:`.adapters` (vLLM, SGLang, TGI, TEI, llama.cpp, TensorRT-LLM, NIM); which
kind a gate's server is, and at which path, is resolved by :mod:`.sources`.

Rules every part relies on:

* A metric that is absent, or a model that is not in the text, is **unknown** (``None``), never 0:
  a 0 would read as "idle" and invite the controller to keep a high target on blind data.
* Nothing here raises for bad input. Network errors, HTTP errors, oversized or slow bodies and
  unparseable text all come back as a failed :class:`ScrapeResult` / :class:`Signals` with a reason.
* Metrics are matched by exact **sample** name, not by family name: prometheus_client strips
  ``_total``/``_created`` from counter families and groups histogram series, and names such as
  ``vllm:num_requests_waiting`` are prefixes of others (``..._by_reason``).

Adapters are data: :class:`GaugeAdapter` names the gauges of one server kind.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterable, Sequence
from urllib.parse import urlsplit

import httpx
import msgspec

from fleetgate._aio import within
from fleetgate.errors import ConfigError

from .adapters import ADAPTERS, VLLM, GaugeAdapter, get_adapter
from .signal_struct import Signals

__all__ = [
    "ADAPTERS",
    "VLLM",
    "GaugeAdapter",
    "ScrapeResult",
    "Signals",
    "combine",
    "derive_metrics_url",
    "fetch_signals",
    "get_adapter",
    "parse_signals",
    "read_result",
    "redact",
    "scrape",
    "validate_metrics_url",
]

# ----------------------------------------------------------------------------------------- URLs


def redact(url: str) -> str:
    """``url`` without secrets, for error messages: ``user:password@`` (up to the last ``@``)
    and the query string (``?token=...``) are replaced by ``***``."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    if "@" in rest:
        rest = "***@" + rest.rpartition("@")[2]
    for mark in ("?", "#"):
        head, found, _ = rest.partition(mark)
        if found:
            rest = f"{head}{mark}***"
    return f"{scheme}{sep}{rest}"


def validate_metrics_url(url: str) -> str:
    """Return ``url`` if it is a plain ``http(s)://host[:port]/path`` URL, else raise ConfigError.

    Refused: credentials (``user:pass@``; put auth in a proxy, not in a file the daemon logs),
    query strings and fragments (a metrics path takes none), other schemes, no host, whitespace.
    """
    if not isinstance(url, str) or not url.strip():
        raise ConfigError("metrics URL must be a non-empty string")
    shown = redact(url)
    if any(ch.isspace() or ord(ch) < 0x20 or ord(ch) == 0x7F for ch in url):
        raise ConfigError(f"URL {shown!r} contains whitespace or control characters")
    try:
        parts = urlsplit(url)
        port = parts.port  # raises ValueError for a malformed port
    except ValueError as exc:
        raise ConfigError(f"URL {shown!r} is malformed: {exc}") from exc
    if parts.scheme not in ("http", "https"):
        raise ConfigError(f"URL {shown!r} must use http:// or https://, not {parts.scheme or '?'}:")
    if "@" in parts.netloc:
        raise ConfigError(f"URL {shown!r} carries credentials; they are not allowed in URLs")
    if not parts.hostname:
        raise ConfigError(f"URL {shown!r} has no host")
    if "?" in url:
        raise ConfigError(f"URL {shown!r} has a query string; metrics URLs take none")
    if "#" in url:
        raise ConfigError(f"URL {shown!r} has a fragment; metrics URLs take none")
    if port == 0:
        raise ConfigError(f"URL {shown!r} has port 0")
    return url


def derive_metrics_url(base_url: str, path: str = "/metrics") -> str:
    """The metrics URL of an OpenAI-compatible ``base_url``, at ``path`` of the server's root.

    ``http://host/v1`` -> ``http://host/metrics``: trailing slashes and one trailing ``/v1`` are
    dropped, ``path`` is appended (``/v1/metrics`` for NIM, ``/prometheus/metrics`` for
    ``trtllm-serve``). The base URL gets the checks of :func:`validate_metrics_url`.
    """
    validate_metrics_url(base_url)
    root = base_url.rstrip("/")
    if root.endswith("/v1") and "://" in root[: -len("/v1")]:
        root = root[: -len("/v1")].rstrip("/")
    return validate_metrics_url(root + path)


# -------------------------------------------------------------------------------------- scrape


class ScrapeResult(msgspec.Struct, frozen=True):
    """One scrape of one URL: ``text`` when ``ok``, else ``error`` says why (never both)."""

    url: str
    ok: bool
    text: str | None = None
    error: str | None = None
    status: int | None = None
    elapsed: float = 0.0


_SCRAPE_HEADERS = {
    # Classic text format: the parser below speaks it; OpenMetrics would change counter naming.
    "Accept": "text/plain;version=0.0.4",
    # No compression, so the size cap bounds what we hold in memory, not what arrives compressed.
    "Accept-Encoding": "identity",
}


async def _fetch(
    client: httpx.AsyncClient, url: str, timeout: float, max_bytes: int
) -> ScrapeResult:
    async with client.stream(
        "GET",
        url,
        headers=_SCRAPE_HEADERS,
        follow_redirects=False,
        timeout=httpx.Timeout(timeout),
    ) as response:
        status = response.status_code

        def fail(error: str) -> ScrapeResult:
            return ScrapeResult(url, False, error=error, status=status)

        if response.is_redirect:
            where = redact(response.headers.get("location", "?"))
            return fail(f"HTTP {status} redirect to {where!r} refused")
        if status != 200:
            return fail(f"HTTP {status}")
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_bytes:
            return fail(f"body of {declared} bytes exceeds the {max_bytes}-byte cap")
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            # We asked for identity. A compressed body would be inflated chunk by chunk before
            # the cap could see it (a 64 KiB gzip chunk of zeros inflates to ~64 MiB).
            return fail(f"compressed body (Content-Encoding: {encoding[:20]}) refused")
        body = bytearray()
        # Raw bytes: never decoded, so the cap bounds what is held in memory.
        async for chunk in response.aiter_raw():
            body += chunk
            if len(body) > max_bytes:
                return fail(f"body exceeds the {max_bytes}-byte cap; aborted")
    try:
        return ScrapeResult(url, True, text=body.decode("utf-8"), status=status)
    except UnicodeDecodeError as exc:
        return fail(f"body is not UTF-8: {exc}")


async def scrape(
    client: httpx.AsyncClient, url: str, *, timeout: float, max_bytes: int
) -> ScrapeResult:
    """GET ``url`` within ``timeout`` seconds in total, reading at most ``max_bytes`` of body.

    Redirects are refused (a 3xx is a failure), so is any status but 200 and any compressed
    body. httpx's own timeouts are per operation, so the whole exchange also runs under a total
    timeout: a server that trickles its headers or body byte by byte cannot hold the poll past
    ``timeout``. The body is read raw and dropped as soon as it passes ``max_bytes``, so memory
    stays bounded whatever the server sends. Network and HTTP errors come back as a failed
    result; only cancellation propagates.
    """
    start = time.monotonic()
    try:
        result = await within(_fetch(client, url, timeout, max_bytes), timeout)
    except TimeoutError:
        result = ScrapeResult(url, False, error=f"timed out after {timeout:g} s")
    except (httpx.HTTPError, httpx.InvalidURL, httpx.StreamError, OSError) as exc:
        result = ScrapeResult(url, False, error=f"{type(exc).__name__}: {exc}".rstrip(": "))
    return msgspec.structs.replace(result, elapsed=time.monotonic() - start)


# ------------------------------------------------------------------------------------- signals


def parse_signals(text: str, *, server: str = "vllm", model_name: str | None = None) -> Signals:
    """Parse one endpoint's exposition ``text`` with the adapter of ``server``."""
    return get_adapter(server).parse(text, model_name)


def _sum(values: Iterable[float | None]) -> float | None:
    """Sum, or None when any part is unknown or the sum is not finite."""
    total = 0.0
    for value in values:
        if value is None:
            return None
        total += value
    return total if math.isfinite(total) else None


def combine(parts: Sequence[Signals]) -> Signals:
    """Signals of one gate served by several replicas (one endpoint each).

    Counts are summed and KV usage is the maximum. The combination is deliberately pessimistic:
    if any replica failed, the result is not ``ok`` and its running/waiting/KV are unknown -- a
    partial sum would understate load and invite an increase. One exception: known capacity-waiting
    > 0 on the replicas that answered is kept, because it proves saturation whatever the others
    say, and a decrease is always the safe direction.
    """
    if not parts:
        return Signals.failure("no metrics endpoints")
    if len(parts) == 1:
        return parts[0]
    caps = [p.waiting_capacity for p in parts]
    known_cap = _sum(c for c in caps if c is not None)
    proven_cap = known_cap if known_cap else None  # > 0 (parts are never negative)
    preempted = [p.preempted for p in parts if p.preempted is not None]
    # Like capacity-waiting, preemptions on the replicas that answered prove saturation.
    known_preempted = math.fsum(preempted) if preempted else None
    failed = [p for p in parts if not p.ok]
    if failed:
        reasons = "; ".join(p.error or "failed" for p in failed)
        return Signals(
            waiting_capacity=proven_cap,
            ok=False,
            error=f"{len(failed)}/{len(parts)} endpoints failed: {reasons}",
            preempted=known_preempted or None,
            hidden_queue=any(p.hidden_queue for p in parts),
        )
    kvs = [p.kv_cache_usage for p in parts]
    return Signals(
        running=_sum(p.running for p in parts),
        waiting_capacity=known_cap if None not in caps else proven_cap,
        waiting=_sum(p.waiting for p in parts),
        kv_cache_usage=None if None in kvs else max(k for k in kvs if k is not None),
        preemptions=_sum(p.preemptions for p in parts),
        admission_rejections=_sum(p.admission_rejections for p in parts),
        error="; ".join(p.error for p in parts if p.error) or None,
        max_requests=_sum(p.max_requests for p in parts),
        kv_tokens=_sum(p.kv_tokens for p in parts),
        preempted=known_preempted,
        hidden_queue=any(p.hidden_queue for p in parts),
    )


async def fetch_signals(
    client: httpx.AsyncClient,
    urls: Sequence[str],
    *,
    server: str = "vllm",
    model_name: str | None = None,
    timeout: float,
    max_bytes: int,
) -> Signals:
    """Scrape every replica of one gate concurrently, parse each and :func:`combine` them."""
    adapter = get_adapter(server)
    results = await asyncio.gather(
        *(scrape(client, url, timeout=timeout, max_bytes=max_bytes) for url in urls)
    )
    return combine([read_result(r, adapter, model_name)[0] for r in results])


def read_result(
    result: ScrapeResult, adapter: GaugeAdapter, model_name: str | None, prefer: str | None = None
) -> tuple[Signals, str | None]:
    """One replica's signals from its scrape (failed scrape: a failure naming the URL), and the
    model label value they were filtered by (see :meth:`GaugeAdapter.read`)."""
    if not result.ok or result.text is None:
        return Signals.failure(f"{result.url}: {result.error}"), None
    signals, model = adapter.read(result.text, model_name, prefer)
    if signals.error:
        signals = msgspec.structs.replace(signals, error=f"{result.url}: {signals.error}")
    return signals, model
