"""The leader's poll: scrape, read, decide, publish -- every gate, once per ``poll_interval``.

One poll (:meth:`Poll.once`) scrapes every scraped gate concurrently (at most
:data:`SCRAPE_CONCURRENCY` at once, over kept-alive connections), reads the client-observed
counters of every adapted gate meanwhile and the fleet's in-flight of every gate, lets
:class:`~.gates.Gates` decide each gate with Redis server time, and publishes everything in one
pipeline under the leader's epoch.

A broken gate (a key of the wrong type) never stops the others: a pipeline that fails on it is
sent again gate by gate, and that gate alone is unknown or unpublished (counted in
:attr:`Poll.failures`, logged). A publish refused for a stale epoch means a newer leader exists:
this one steps down at once -- unless the epoch counter says no newer epoch was ever issued, in
which case the gate's stored epoch is corrupt and only that gate is skipped (logged), instead of
flapping leadership forever.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from typing import Any, Literal

from fleetgate._redis import REDIS_ERRORS
from fleetgate.keys import fleet_keys
from fleetgate.observed import Reading

from .config import Config, GateConfig
from .election import Election
from .errorlog import Faults
from .gates import Gates
from .metrics import CoordinatorMetrics
from .observations import read_observations
from .publisher import Publication, Publisher
from .scrape import Fetcher, HttpxFetcher, LeanHttp, MetricsSource, Signals, new_client

__all__ = ["SCRAPE_CONCURRENCY", "Poll"]

log = logging.getLogger("fleetgate.coordinator")

SCRAPE_CONCURRENCY = 64


class Poll:
    """The poll of one coordinator: its gates' metrics sources and one poll at a time."""

    def __init__(
        self, config: Config, metrics: CoordinatorMetrics, faults: Faults, gates: Gates
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.faults = faults
        self.gates = gates
        self.sources: dict[str, MetricsSource] = {}
        #: gates that failed in the current poll (a poll without any says the loop recovered)
        self.failures = 0
        # gates whose last scrape failed: a failure is logged when it starts, not every poll
        self._scrape_failing: set[str] = set()
        self._scrape_slots: asyncio.Semaphore | None = None
        self._client: Any = None
        self._publisher: Publisher | None = None
        self._election: Election | None = None

    def start(
        self,
        client: Any,
        publisher: Publisher,
        election: Election,
        http: Literal["lean", "httpx"],
        tls: ssl.SSLContext,
    ) -> None:
        """Open a metrics source per scraped gate; ``tls`` is shared by all of them."""
        self._client, self._publisher, self._election = client, publisher, election
        # Scrapes run at most SCRAPE_CONCURRENCY at once over kept-alive connections: a
        # thousand simultaneous connects cost more (SYN backlog, TLS handshakes) than they save.
        # Each gate has its own small pool (see scrape/sources.py).
        self._scrape_slots = asyncio.Semaphore(SCRAPE_CONCURRENCY)

        def fetcher(gate: GateConfig) -> Fetcher:
            if http == "httpx":
                return HttpxFetcher(new_client(len(gate.metrics_urls), tls))
            return LeanHttp(tls)

        self.sources = {
            g.name: MetricsSource(g, fetcher(g))
            for g in self.config.gates
            if self.gates.controllers[g.name].scraped
        }

    async def aclose(self) -> None:
        """Close every source's connections."""
        await asyncio.gather(*(src.fetcher.aclose() for src in self.sources.values()))

    @property
    def publisher(self) -> Publisher:
        assert self._publisher is not None, "coordinator not running"
        return self._publisher

    def urls_of(self, gate: GateConfig) -> tuple[str, ...]:
        """The URLs the gate's last scrape read (empty: the configured ones, or none)."""
        source = self.sources.get(gate.name)
        return source.urls if source is not None and source.urls else ()

    async def once(self) -> list[Publication]:
        """Scrape, decide and publish once (the leader's poll). Returns what was decided."""
        t0 = time.perf_counter()
        gates = self.config.gates
        now = await self.publisher.server_time()
        # The obs counters are read while the scrapes are in flight: no extra wait.
        observing = asyncio.ensure_future(self._observations(gates, now))
        signals = await asyncio.gather(*(self.scrape(g) for g in gates))
        observed = await observing
        held = await self._held(gates)
        pubs = []
        for g, s, r in zip(gates, signals, observed, strict=True):
            units, tokens = held.get(g.name, (None, None))
            pubs.append(self.gates.decide(g, s, units, now, r, self.urls_of(g), tokens))
        assert self._election is not None
        term = self._election.term
        if term is None or not term.valid():
            log.warning("poll: no longer leader; nothing published")
            return pubs
        ttl_ms = int(self.config.coordinator.target_ttl * 1000)
        accepted = await self._publish(term.epoch, ttl_ms, pubs)
        refused = [p.gate.name for p, ok in zip(pubs, accepted, strict=True) if ok is False]
        if refused and await self._deposed(term.epoch, refused):
            self.metrics.refused.inc()
            log.error(
                "targets refused for epoch %d: a newer leader exists; stepping down", term.epoch
            )
            self._election.term = None
            self.metrics.leader.set(0)
        self.metrics.poll_seconds.observe(time.perf_counter() - t0)
        return pubs

    async def scrape(self, gate: GateConfig) -> Signals | None:
        """The gate's signals of this poll (None: the gate is not scraped)."""
        if not self.gates.controllers[gate.name].scraped:
            return None
        c = self.config.coordinator
        assert self._scrape_slots is not None, "coordinator not running"
        async with self._scrape_slots:
            t0 = time.perf_counter()
            signals = await self.sources[gate.name].read(
                timeout=c.scrape_timeout, max_bytes=c.max_body_bytes
            )
        self.metrics.scrape_seconds.labels(gate.name).observe(time.perf_counter() - t0)
        if not signals.ok:
            self.metrics.scrape_errors.labels(gate.name).inc()
            # Once per transition: 1,000 gates behind one dead host must not write 1,000 lines
            # per poll. Repeats go to DEBUG; the scrape_errors counter counts every one.
            failing = gate.name in self._scrape_failing
            level = logging.DEBUG if failing else logging.WARNING
            log.log(level, "gate %s: metrics unusable: %s", gate.name, signals.error)
            self._scrape_failing.add(gate.name)
        elif gate.name in self._scrape_failing:
            self._scrape_failing.discard(gate.name)
            log.info("gate %s: metrics readable again", gate.name)
        return signals

    async def _observations(
        self, gates: tuple[GateConfig, ...], now: float
    ) -> list[Reading | None]:
        """Every adapted gate's client-observed counters (None: static gates, failed reads)."""
        wanted = [g for g in gates if self.gates.controllers[g.name].adaptive]
        readings = await read_observations(
            self._client, [self.publisher.keys(g.name) for g in wanted], now
        )
        by_name = dict(zip((g.name for g in wanted), readings, strict=True))
        return [by_name.get(g.name) for g in gates]

    async def _held(self, gates: tuple[GateConfig, ...]) -> dict[str, tuple[int, int]]:
        """Units and tokens held fleet-wide per gate (one pipeline); a gate whose key is broken
        is unknown, not fatal."""
        try:
            return await self.publisher.held(gates)
        except REDIS_ERRORS:
            raise
        except Exception:
            pass  # one bad key fails the whole pipeline: ask gate by gate
        counts: dict[str, tuple[int, int]] = {}
        for gate in gates:
            try:
                counts.update(await self.publisher.held((gate,)))
            except REDIS_ERRORS:
                raise
            except Exception as exc:
                self._failed(f"gate {gate.name}: in-flight unknown", exc)
                await self.faults.diagnose(exc)
        return counts

    async def _publish(self, epoch: int, ttl_ms: int, pubs: list[Publication]) -> list[bool | None]:
        """Publish all gates in one pipeline; if one gate's keys are broken, publish the others
        one by one. Per gate: accepted, refused (stale epoch) or None (failed, logged)."""
        try:
            return list(await self.publisher.publish(epoch, ttl_ms, pubs))
        except REDIS_ERRORS:
            raise
        except Exception:
            pass
        results: list[bool | None] = []
        for pub in pubs:
            try:
                results.append((await self.publisher.publish(epoch, ttl_ms, [pub]))[0])
            except REDIS_ERRORS:
                raise
            except Exception as exc:
                results.append(None)
                self._failed(f"gate {pub.gate.name}: not published", exc)
                await self.faults.diagnose(exc)
        return results

    def _failed(self, what: str, exc: Exception) -> None:
        self.failures += 1
        self.faults["poll"].error(f"{what}: {self.faults.text(exc)}")

    async def _deposed(self, epoch: int, refused: list[str]) -> bool:
        """A refused target means a newer leader -- if a newer epoch was ever issued.

        Epochs come only from ``INCR`` of the epoch counter. When the counter is still at our
        epoch, nobody newer exists and the gate's stored epoch is corrupt (planted, or the
        counter was reset): stepping down would only make every coordinator flap forever.
        """
        prefix = self.config.redis.prefix
        try:
            counter = await self._client.get(fleet_keys(prefix).epoch)
            latest = int(counter) if counter is not None else None
        except REDIS_ERRORS:
            raise
        except Exception:
            latest = None
        if latest is None or latest > epoch:
            return True
        self.failures += 1
        self.faults["poll"].error(
            f"gates {', '.join(refused)}: target refused although no epoch above {epoch} was "
            "ever issued (the stored target epoch is corrupt, or the epoch counter was reset); "
            "these gates keep their old target until it expires, and their old config and "
            "snapshot (every gate write is fenced by that epoch). Delete their target keys "
            f"(redis-cli DEL '{prefix}:{{<gate>}}:target') to fix."
        )
        return False
