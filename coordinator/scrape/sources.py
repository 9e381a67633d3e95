"""Where one adaptive gate's signals come from: its server kind, its URL(s) and its HTTP pool.

A :class:`MetricsSource` per gate resolves, once, which kind of model server it reads:

* ``server = "<kind>"``: that kind's adapter; from ``base_url`` the URL is the kind's own path
  (``/metrics``, NIM's ``/v1/metrics``, ``trtllm-serve``'s ``/prometheus/metrics``);
* ``server = "auto"`` (default): the kind is detected from the exposition
  (:func:`~.adapters.detect_kind`). With ``metrics_url`` the given URL(s) are read; with
  ``base_url`` each kind's path is probed in turn until one answers with a known exposition.
  Detection is retried every poll until it succeeds, then kept (and logged once).

``metrics_url`` always wins over any derived path. The gate's own name is the default
``model_name`` filter when the exposition carries that label value; otherwise every model on the
endpoint is counted, and that choice is logged whenever it changes.

Each source owns its connections (one per replica, kept alive between polls) through a
:class:`Fetcher`: the lean GET of :mod:`.httpget` (default) or an ``httpx`` pool of its own
(:class:`HttpxFetcher`). One pool per gate keeps the per-request pool bookkeeping O(1), where a
pool shared by a thousand gates scans every connection for every request (``docs/servers.md``).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from typing import Protocol

import httpx
import msgspec

from .adapters import ADAPTERS, AUTO, DETECTION_ORDER, GaugeAdapter, detect_kind, foreign_answer
from .published import counter_increase, props_url, stated_slots
from .signal_struct import Signals
from .signals import ScrapeResult, combine, derive_metrics_url, read_result, scrape

__all__ = [
    "PROPS_EVERY",
    "Fetcher",
    "HttpxFetcher",
    "MetricsSource",
    "ScrapedGate",
    "candidate_urls",
    "new_client",
]

log = logging.getLogger("fleetgate.coordinator")

#: a server that states its slots only at its ``props_path`` (llama.cpp) is asked once, then
#: every this many polls (a restart with other slots is followed within a minute at 2 s) and
#: after a failed scrape of it: one extra GET per 30 polls, not one per poll
PROPS_EVERY = 30


def candidate_urls(base_url: str) -> tuple[str, ...]:
    """The metrics URLs ``server = "auto"`` probes for ``base_url``, in detection order."""
    paths = dict.fromkeys(ADAPTERS[k].metrics_path for k in DETECTION_ORDER)
    return tuple(derive_metrics_url(base_url, p) for p in paths)


def new_client(replicas: int, verify: ssl.SSLContext) -> httpx.AsyncClient:
    """An HTTP pool for one gate: a kept-alive connection per replica, never a redirect.

    ``verify`` is one SSL context shared by every gate's pool: building one per client costs
    tens of milliseconds (it loads the CA bundle), which a thousand gates cannot afford.
    """
    n = max(1, replicas)
    return httpx.AsyncClient(
        verify=verify,
        follow_redirects=False,
        limits=httpx.Limits(max_connections=n, max_keepalive_connections=n),
    )


class ScrapedGate(Protocol):
    """What a source needs of its gate's configuration (the coordinator's ``GateConfig``)."""

    @property
    def name(self) -> str: ...

    @property
    def server(self) -> str: ...

    @property
    def base_url(self) -> str | None: ...

    @property
    def metrics_url(self) -> str | tuple[str, ...] | None: ...

    @property
    def metrics_urls(self) -> tuple[str, ...]: ...

    @property
    def model_name(self) -> str | None: ...


class Fetcher(Protocol):
    """A bounded GET of one metrics URL (see :func:`~.signals.scrape`) and its connections."""

    async def get(self, url: str, *, timeout: float, max_bytes: int) -> ScrapeResult: ...

    async def aclose(self) -> None: ...


class HttpxFetcher:
    """:func:`~.signals.scrape` over an ``httpx`` client (the pool is closed with it)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def get(self, url: str, *, timeout: float, max_bytes: int) -> ScrapeResult:
        return await scrape(self.client, url, timeout=timeout, max_bytes=max_bytes)

    async def aclose(self) -> None:
        await self.client.aclose()


class MetricsSource:
    """One adaptive gate's metrics: kind, URLs and pool. Not thread-safe; one poll at a time."""

    def __init__(self, gate: ScrapedGate, fetcher: Fetcher | httpx.AsyncClient) -> None:
        self.gate = gate
        self.fetcher = HttpxFetcher(fetcher) if isinstance(fetcher, httpx.AsyncClient) else fetcher
        self.kind: str | None = None if gate.server == AUTO else gate.server
        # Known URLs: given, derived for a named kind, or found by probing (auto + base_url).
        self.urls: tuple[str, ...] | None = None
        if gate.metrics_url is not None or self.kind is not None:
            self.urls = gate.metrics_urls
        self._model_choice: tuple[str | None] | None = None  # last logged filter
        self._polls = 0
        # per URL: (preemptions, rejections) of its last good scrape, for the counters' increase
        self._counters: dict[str, tuple[float | None, float | None]] = {}
        # per URL: (slots its props_path stated, the poll that read them)
        self._slots: dict[str, tuple[float | None, int]] = {}

    @property
    def adapter(self) -> GaugeAdapter | None:
        return ADAPTERS[self.kind] if self.kind is not None else None

    async def read(self, *, timeout: float, max_bytes: int) -> Signals:
        """This poll's signals (never raises but for cancellation)."""
        if self.urls is None:
            results = await self._probe(timeout, max_bytes)
        elif len(self.urls) == 1:  # the common case: no gather, no extra task
            results = [await self.fetcher.get(self.urls[0], timeout=timeout, max_bytes=max_bytes)]
        else:
            results = list(
                await asyncio.gather(
                    *(self.fetcher.get(u, timeout=timeout, max_bytes=max_bytes) for u in self.urls)
                )
            )
        if self.kind is None:
            failure = self._detect(results)
            if failure is not None:
                return failure
        adapter = self.adapter
        assert adapter is not None
        self._polls += 1
        parts: list[Signals] = []
        models: set[str | None] = set()
        for result in results:
            signals, model = read_result(result, adapter, self.gate.model_name, self.gate.name)
            signals = self._since_last(result, signals, adapter)
            if adapter.props_path is not None:
                slots = await self._stated_slots(result, adapter.props_path, timeout, max_bytes)
                signals = msgspec.structs.replace(signals, max_requests=slots)
            parts.append(signals)
            if signals.ok:
                models.add(model)
        combined = combine(parts)
        if combined.ok:
            self._note_model(adapter, models)
        return msgspec.structs.replace(combined, server=adapter.server)

    def _since_last(self, result: ScrapeResult, part: Signals, adapter: GaugeAdapter) -> Signals:
        """``preempted`` of one replica: its gauges' value (set by the adapter) plus its
        counters' increase since its last good scrape (unknown for the first one)."""
        if not result.ok or not (adapter.preemptions_counter or adapter.rejections):
            return part
        now = (part.preemptions, part.admission_rejections)
        before = self._counters.get(result.url, (None, None))
        self._counters[result.url] = now
        increases = [counter_increase(before[1], now[1]), part.preempted]
        if adapter.preemptions_counter:
            increases.append(counter_increase(before[0], now[0]))
        known = [v for v in increases if v is not None]
        return msgspec.structs.replace(part, preempted=sum(known) if known else None)

    async def _stated_slots(
        self, result: ScrapeResult, path: str, timeout: float, max_bytes: int
    ) -> float | None:
        """The slots the server at ``result``'s URL states at ``path``: read with its first good
        scrape, again every :data:`PROPS_EVERY` polls and after a failed scrape (a restart may
        change them). A failed read leaves them unknown until the next one is due."""
        if not result.ok:
            self._slots.pop(result.url, None)
            return None
        known = self._slots.get(result.url)
        if known is not None and self._polls - known[1] < PROPS_EVERY:
            return known[0]
        answer = await self.fetcher.get(
            props_url(result.url, path), timeout=timeout, max_bytes=max_bytes
        )
        slots = stated_slots(answer.text) if answer.ok else None
        self._slots[result.url] = (slots, self._polls)
        return slots

    async def _probe(self, timeout: float, max_bytes: int) -> list[ScrapeResult]:
        """``auto`` with ``base_url``: each kind's path in turn, until one is recognised.

        The probes share the one ``timeout``, and stop at the first that got no HTTP answer
        (unreachable, timed out): the other paths are on the same server.
        """
        assert self.gate.base_url is not None
        tried: list[ScrapeResult] = []
        deadline = time.monotonic() + timeout
        for url in candidate_urls(self.gate.base_url):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            result = await self.fetcher.get(url, timeout=left, max_bytes=max_bytes)
            tried.append(result)
            if result.ok and result.text is not None and detect_kind(result.text) is not None:
                self.urls = (url,)
                return [result]
            if result.status is None:
                break
        return tried

    def _detect(self, results: list[ScrapeResult]) -> Signals | None:
        """Settle ``kind`` from the first recognised text; else a failure saying what was seen."""
        problems: list[str] = []
        for r in results:
            if not r.ok or r.text is None:
                problems.append(f"{r.url}: {r.error}")
                continue
            kind = detect_kind(r.text)
            if kind is not None:
                self.kind = kind
                if self.urls is None:
                    self.urls = (r.url,)
                log.info(
                    "gate %s: server detected as %s at %s",
                    self.gate.name,
                    kind,
                    ", ".join(self.urls),
                )
                return None
            foreign = foreign_answer(r.text, AUTO)
            why = f" ({foreign})" if foreign is not None else ""
            problems.append(f"{r.url}: no metrics of a known server kind{why}")
        return Signals.failure("server kind not detected: " + "; ".join(problems))

    def _note_model(self, adapter: GaugeAdapter, models: set[str | None]) -> None:
        """Log the model filter in use when it changes (gate name, or every model)."""
        if self.gate.model_name is not None or adapter.model_label is None:
            return
        choice = (self.gate.name,) if self.gate.name in models else (None,)
        if choice == self._model_choice:
            return
        self._model_choice = choice
        if choice[0] is not None:
            log.info(
                "gate %s: counting %s=%r (the gate's name)",
                self.gate.name,
                adapter.model_label,
                self.gate.name,
            )
        else:
            log.info(
                "gate %s: no %s=%r on the endpoint; counting every model there "
                "(set model_name to choose one)",
                self.gate.name,
                adapter.model_label,
                self.gate.name,
            )
