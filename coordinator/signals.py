"""Load signals of model servers: metrics URLs, a bounded scrape, and one parser per server kind.

The coordinator polls each adaptive gate's Prometheus ``/metrics`` endpoint(s) and turns the text
into :class:`Signals` -- running requests, requests waiting for capacity, all waiting requests
and KV-cache usage -- for one ``model_name``, summed over vLLM's ``engine`` label.

Rules every part relies on:

* A metric that is absent, or a model that is not in the text, is **unknown** (``None``), never 0:
  a 0 would read as "idle" and invite the controller to keep a high target on blind data.
* Nothing here raises for bad input. Network errors, HTTP errors, oversized or slow bodies and
  unparseable text all come back as a failed :class:`ScrapeResult` / :class:`Signals` with a reason.
* Metrics are matched by exact **sample** name, not by family name: prometheus_client strips
  ``_total``/``_created`` from counter families and groups histogram series, and names such as
  ``vllm:num_requests_waiting`` are prefixes of others (``..._by_reason``).

Adapters are data: :class:`GaugeAdapter` names the gauges of one server kind. vLLM is registered;
SGLang (``sglang:num_running_reqs``, ``sglang:num_queue_reqs``) or TGI fit as one more entry.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol
from urllib.parse import urlsplit

import httpx
import msgspec
from prometheus_client.parser import text_string_to_metric_families

from fleetgate._aio import within
from fleetgate.errors import ConfigError

__all__ = [
    "ADAPTERS",
    "VLLM",
    "GaugeAdapter",
    "MetricsAdapter",
    "ScrapeResult",
    "Signals",
    "combine",
    "derive_metrics_url",
    "fetch_signals",
    "get_adapter",
    "parse_signals",
    "scrape",
    "validate_metrics_url",
]

# ----------------------------------------------------------------------------------------- URLs


def _redact(url: str) -> str:
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
    shown = _redact(url)
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


def derive_metrics_url(base_url: str) -> str:
    """The ``/metrics`` URL of an OpenAI-compatible ``base_url``.

    ``http://host/v1`` -> ``http://host/metrics``: trailing slashes and one trailing ``/v1`` are
    dropped, ``/metrics`` is appended. The base URL gets the checks of :func:`validate_metrics_url`.
    """
    validate_metrics_url(base_url)
    root = base_url.rstrip("/")
    if root.endswith("/v1") and "://" in root[: -len("/v1")]:
        root = root[: -len("/v1")].rstrip("/")
    return validate_metrics_url(root + "/metrics")


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
            where = _redact(response.headers.get("location", "?"))
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


class Signals(msgspec.Struct, frozen=True):
    """What one gate's model server(s) report. ``None`` = unknown, never "zero".

    ``waiting_capacity`` is the saturation signal: requests the engine could not schedule for lack
    of capacity (vLLM's ``num_requests_waiting_by_reason{reason="capacity"}``, or all waiting
    requests on servers without that gauge). ``kv_cache_usage`` is a fraction (1 = full), the
    maximum over engines and replicas. ``ok`` is False when a scrape failed or ``running`` /
    ``waiting_capacity`` had an invalid value (NaN, infinite, negative); ``error`` names every
    failure and invalid value, also of the other two fields (which are then None).
    """

    running: float | None = None
    waiting_capacity: float | None = None
    waiting: float | None = None
    kv_cache_usage: float | None = None
    ok: bool = True
    error: str | None = None

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


class MetricsAdapter(Protocol):
    """Turns one server kind's exposition text into :class:`Signals`. Must never raise."""

    @property
    def server(self) -> str:
        """The ``server`` kind this adapter reads (``"vllm"``)."""
        ...

    def parse(self, text: str, model_name: str | None) -> Signals:
        """Signals for ``model_name`` (None = every model in the text)."""
        ...


@dataclass
class _Acc:
    """Sum (or max) of the finite, non-negative samples of one metric; ``bad`` if any was not."""

    use_max: bool = False
    total: float = 0.0
    seen: bool = False
    bad: str | None = None

    def add(self, name: str, value: float) -> None:
        if not math.isfinite(value) or value < 0:
            self.bad = self.bad or f"{name} has invalid value {value!r}"
            return
        self.total = max(self.total, value) if self.use_max else self.total + value
        self.seen = True
        if not math.isfinite(self.total):
            self.bad = self.bad or f"{name} sums to {self.total!r}"

    def value(self) -> float | None:
        return self.total if self.seen and self.bad is None else None


@dataclass(frozen=True)
class GaugeAdapter:
    """An adapter described by the gauge names of one server kind.

    ``capacity`` is ``(metric, label, value)`` of the saturation gauge; when the text has no such
    sample for the model, ``waiting`` stands in for it (older servers count every waiting request,
    which errs towards "saturated"). ``kv_usage`` lists gauges in order of preference.
    """

    server: str
    running: str
    waiting: str
    capacity: tuple[str, str, str] | None = None
    kv_usage: tuple[str, ...] = ()
    model_label: str | None = "model_name"
    _wanted: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        names = {self.running, self.waiting, *self.kv_usage}
        if self.capacity is not None:
            names.add(self.capacity[0])
        object.__setattr__(self, "_wanted", frozenset(names))

    def parse(self, text: str, model_name: str | None) -> Signals:
        """Sum this server's gauges for ``model_name`` over engines; see :class:`Signals`."""
        accs: dict[str, _Acc] = {}
        cap_acc = _Acc()
        try:
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    name = sample.name
                    if name not in self._wanted:
                        continue
                    labels = sample.labels
                    if (
                        model_name is not None
                        and self.model_label is not None
                        and labels.get(self.model_label) != model_name
                    ):
                        continue
                    value = float(sample.value)
                    if self.capacity is not None and name == self.capacity[0]:
                        if labels.get(self.capacity[1]) == self.capacity[2]:
                            cap_acc.add(f"{name}{{{self.capacity[1]}={self.capacity[2]!r}}}", value)
                        continue
                    acc = accs.setdefault(name, _Acc(use_max=name in self.kv_usage))
                    acc.add(name, value)
        # The parser is third-party code fed untrusted text; whatever it raises, the answer is
        # "unknown" with the reason kept, never a crashed poll loop.
        except Exception as exc:
            return Signals.failure(f"unparseable metrics: {type(exc).__name__}: {exc}")

        waiting_acc = accs.get(self.waiting, _Acc())
        cap = cap_acc if cap_acc.seen or cap_acc.bad else waiting_acc
        kv_acc = next((accs[n] for n in self.kv_usage if n in accs), _Acc())
        running = accs.get(self.running, _Acc())
        errors = [a.bad for a in (running, cap, waiting_acc, kv_acc) if a.bad]
        return Signals(
            running=running.value(),
            waiting=waiting_acc.value(),
            waiting_capacity=cap.value(),
            kv_cache_usage=kv_acc.value(),
            # Only the signals the controller acts on decide ``ok``; a broken KV gauge must not
            # stall adaptation. Every invalid value is still named in ``error``.
            ok=running.bad is None and cap.bad is None,
            error="; ".join(dict.fromkeys(errors)) or None,
        )


VLLM = GaugeAdapter(
    server="vllm",
    running="vllm:num_requests_running",
    waiting="vllm:num_requests_waiting",
    capacity=("vllm:num_requests_waiting_by_reason", "reason", "capacity"),
    kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
)

#: Adapters by ``server`` kind (the gate config's ``server`` key).
ADAPTERS: Mapping[str, MetricsAdapter] = MappingProxyType({VLLM.server: VLLM})


def get_adapter(server: str) -> MetricsAdapter:
    """The adapter for ``server``, or ConfigError listing the known kinds."""
    try:
        return ADAPTERS[server]
    except KeyError:
        known = ", ".join(sorted(ADAPTERS))
        raise ConfigError(f"unknown server kind {server!r} (known: {known})") from None


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
    failed = [p for p in parts if not p.ok]
    if failed:
        reasons = "; ".join(p.error or "failed" for p in failed)
        return Signals(
            waiting_capacity=proven_cap,
            ok=False,
            error=f"{len(failed)}/{len(parts)} endpoints failed: {reasons}",
        )
    kvs = [p.kv_cache_usage for p in parts]
    return Signals(
        running=_sum(p.running for p in parts),
        waiting_capacity=known_cap if None not in caps else proven_cap,
        waiting=_sum(p.waiting for p in parts),
        kv_cache_usage=None if None in kvs else max(k for k in kvs if k is not None),
        error="; ".join(p.error for p in parts if p.error) or None,
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
    parts: list[Signals] = []
    for result in results:
        if not result.ok or result.text is None:
            parts.append(Signals.failure(f"{result.url}: {result.error}"))
            continue
        signals = adapter.parse(result.text, model_name)
        if signals.error:
            signals = msgspec.structs.replace(signals, error=f"{result.url}: {signals.error}")
        parts.append(signals)
    return combine(parts)
