"""The coordinator daemon: election, polling (scrape -> decide -> publish), reaper, /metrics.

Every coordinator process campaigns; the one holding the lease polls, the others stand by and
take over when the lease lapses (or at once when the leader shuts down cleanly). The leader:

* every ``poll_interval`` (± jitter) runs one poll (:mod:`.poll`): scrapes all scraped gates
  concurrently, reads the fleet in-flight of every gate and the client-observed counters
  (``fg:{G}:obs``), steps each gate's controller with Redis server time (:mod:`.gates`; the
  AIMD controller on the server's gauges, cut further when callers saw overloads, or the
  latency-gradient controller for gates driven by what callers report: one protocol,
  :mod:`.control`) and publishes everything in one pipeline under its epoch (:mod:`.publisher`);
* every second sweeps the expired leases and waiters of every registered gate (:mod:`.reaper`),
  so a crashed holder is reclaimed even when no client calls.

On winning a term it resumes every gate's controller from the state the last leader stored
(warm failover). Bad state in Redis never stops the daemon: every loop catches and logs (repeats
of one error at most once a minute, :mod:`.errorlog`), a key of the wrong type is named in the
log (:mod:`fleetgate.safety`), a broken gate does not stop the others from being published, and
the loops recover by themselves once the key is fixed. Redis unreachable (a wrong URL, an
outage) is told for as long as it lasts, at growing intervals, and exported
(:mod:`.reach`). At start-up the server settings are checked (``maxmemory-policy``, replicas)
and problems are logged as WARNING.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import socket
import threading
import uuid
from typing import Any, Literal

import httpx
from prometheus_client import CollectorRegistry, start_http_server

from fleetgate._redis import REDIS_ERRORS, connect, prepare, redact
from fleetgate.errors import ConfigError
from fleetgate.observed import Reading
from fleetgate.safety import server_findings

from .config import Config, GateConfig, load_config
from .control import State
from .election import Election, Leadership
from .errorlog import Faults
from .gates import Gates
from .metrics import CoordinatorMetrics
from .poll import Poll
from .publisher import Publication, Publisher
from .reaper import REAP_INTERVAL, Reaper
from .scrape import MetricsSource, Signals

__all__ = ["Coordinator", "run_coordinator"]

log = logging.getLogger("fleetgate.coordinator")

# Retry of the start-up safety check while Redis is unreachable.
SAFETY_RETRY = 5.0


def _quiet_httpx() -> None:
    """httpx logs every request at INFO ("HTTP Request: GET ..."): one line per gate per poll.
    Raise its logger to WARNING unless someone configured that logger's level explicitly."""
    httpx_log = logging.getLogger("httpx")
    if httpx_log.level == logging.NOTSET:
        httpx_log.setLevel(logging.WARNING)


def default_coordinator_id() -> str:
    """``host-pid-random``: unique per process, readable in ``fleetgate status``."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Coordinator:
    """One coordinator process (leader or standby) for one configuration."""

    def __init__(
        self,
        config: Config,
        *,
        coordinator_id: str | None = None,
        registry: CollectorRegistry | None = None,
        reap_interval: float = REAP_INTERVAL,
        http: Literal["lean", "httpx"] = "lean",
    ) -> None:
        """``http`` picks the scrape client: the lean GET of :mod:`.scrape.httpget` (default,
        ~10x cheaper per scrape) or httpx, kept selectable for comparison (``docs/servers.md``)."""
        self.config = config
        self.id = coordinator_id or default_coordinator_id()
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = CoordinatorMetrics.create(self.registry)
        self.http = http
        self.faults = Faults(config, self.metrics)
        self.gates = Gates(config, self.metrics, self.faults)
        self._poll = Poll(config, self.metrics, self.faults, self.gates)
        self.reaper = Reaper(config, self.metrics, self.faults, reap_interval)
        self.metrics_port: int | None = None
        self._wake_poll = asyncio.Event()
        self._stopping = False
        self._client: Any = None
        self._election: Election | None = None
        self._publisher: Publisher | None = None
        self.safety_findings: list[str] | None = None  # None until the start-up check ran

    @property
    def election(self) -> Election:
        assert self._election is not None, "coordinator not running"
        return self._election

    @property
    def publisher(self) -> Publisher:
        assert self._publisher is not None, "coordinator not running"
        return self._publisher

    @property
    def states(self) -> dict[str, State]:
        """Each gate's controller state (resumed at the term's start, then stepped)."""
        return self.gates.states

    @property
    def sources(self) -> dict[str, MetricsSource]:
        """The metrics source of every scraped gate (while running)."""
        return self._poll.sources

    # -- lifecycle ---------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Run until ``stop`` is set; then resign leadership at once and close everything."""
        await self._connect()
        server, thread = self._serve_metrics()
        cfg = self.config
        scraped = sum(1 for c in self.gates.controllers.values() if c.scraped)
        adapted = sum(1 for c in self.gates.controllers.values() if c.adaptive)
        log.info(
            "coordinator %s: redis %s prefix %r, %d gates (%d on metrics, %d on latency), "
            "metrics on %s:%d",
            self.id,
            redact(cfg.redis.url),
            cfg.redis.prefix,
            len(cfg.gates),
            scraped,
            adapted - scraped,
            cfg.coordinator.metrics_address[0],
            self.metrics_port,
        )
        tasks = [
            asyncio.create_task(self._election_loop(), name="election"),
            asyncio.create_task(self._poll_loop(), name="poll"),
            asyncio.create_task(
                self.reaper.run(self.election, self.publisher, lambda: self._stopping),
                name="reaper",
            ),
            asyncio.create_task(self._safety_check(), name="safety-check"),
        ]
        try:
            await stop.wait()
        finally:
            self._stopping = True
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.election.resign()
            self.metrics.leader.set(0)
            await self._poll.aclose()
            await self._client.aclose()
            server.shutdown()
            server.server_close()
            thread.join(5)
            log.info("coordinator %s stopped", self.id)

    async def _connect(self) -> None:
        """The Redis client, the publisher, the election and the gates' metrics sources."""
        cfg = self.config
        self._client = self.faults.client = connect(cfg.redis.url)
        await prepare(self._client)
        self._publisher = Publisher(self._client, cfg.redis.prefix)
        self._election = Election(
            self._client, cfg.redis.prefix, self.id, cfg.coordinator.leader_ttl
        )
        if self.http == "httpx":
            _quiet_httpx()
        # one SSL context for every gate's connections (building one loads the CA bundle)
        tls = httpx.create_ssl_context()
        self._poll.start(self._client, self._publisher, self._election, self.http, tls)

    def _serve_metrics(self) -> tuple[Any, threading.Thread]:
        """Serve the coordinator's /metrics on ``metrics_listen``; the port in use is
        :attr:`metrics_port` (``:0`` picks a free one)."""
        cfg = self.config.coordinator
        host, port = cfg.metrics_address
        try:
            server, thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:  # taken, not ours, or a host that does not resolve
            raise ConfigError(
                f"metrics_listen: cannot listen on {cfg.metrics_listen}: {exc}"
            ) from None
        self.metrics_port = int(server.server_port)
        return server, thread

    async def _safety_check(self) -> None:
        """Check the server's settings once Redis answers; log every finding as WARNING."""
        while not self._stopping:
            try:
                findings = await server_findings(self._client)
            except REDIS_ERRORS as exc:
                self.faults.unreachable("settings check", exc)
                await asyncio.sleep(SAFETY_RETRY)
                continue
            except Exception as exc:
                log.warning("could not check the Redis settings: %s", self.faults.text(exc))
                return
            self.safety_findings = [f.message for f in findings]
            for finding in findings:
                log.warning("Redis settings: %s", finding.message)
            return

    # -- election ----------------------------------------------------------------------------

    async def _election_loop(self) -> None:
        election = self.election
        ttl = self.config.coordinator.leader_ttl
        while not self._stopping:
            try:
                if election.term is None:
                    term = await election.campaign()
                    if term is not None:
                        await self._on_new_term(term)
                else:
                    await election.renew()
                if election.renew_error is not None:  # kept the lead through it, for now
                    self.faults.unreachable("election", election.renew_error)
                else:
                    self.faults.redis.reached()
                if election.is_leader:
                    self.faults["election"].ok()
            except REDIS_ERRORS as exc:
                self.faults.unreachable("election", exc)
            except Exception as exc:
                # Bad state in Redis (fg:epoch of the wrong type, ...): log, keep campaigning.
                if self.faults["election"].error(f"failed: {self.faults.text(exc)}", trace=True):
                    await self.faults.diagnose(exc)
            leading = election.is_leader
            self.metrics.leader.set(1 if leading else 0)
            # a standby's period is part of a target's lifetime (CoordinatorSettings.takeover)
            await asyncio.sleep(ttl / 3 if leading else self.config.coordinator.campaign_interval)

    async def _on_new_term(self, term: Leadership) -> None:
        """Warm failover: continue from the controller states the last leader stored."""
        self.metrics.epoch.set(term.epoch)
        try:
            # one read for every gate: its stored state, and whether its target has run out
            stored = await self.publisher.stored_states([g.name for g in self.config.gates])
            resumed = self.gates.resume(stored)
        except Exception as exc:
            # Unreachable or a util key of the wrong type: lead anyway, from a cold start.
            log.warning(
                "could not load the previous controller states (%s); cold start",
                self.faults.text(exc),
            )
            resumed = self.gates.resume(None)
            await self.faults.diagnose(exc)
        shown = dict(list(resumed.items())[:10])
        more = f" (+{len(resumed) - len(shown)} more)" if len(resumed) > len(shown) else ""
        log.info("leader with epoch %d; resuming targets %s%s", term.epoch, shown, more)
        self._wake_poll.set()

    # -- polling -----------------------------------------------------------------------------

    async def _poll_loop(self) -> None:
        c = self.config.coordinator
        while not self._stopping:
            delay = c.poll_interval * (1 + random.uniform(-c.poll_jitter, c.poll_jitter))
            # asyncio.wait, not wait_for: on Python 3.11 wait_for can swallow a cancellation
            # that races its timeout, which would keep this loop alive after shutdown.
            woken = asyncio.ensure_future(self._wake_poll.wait())
            try:
                await asyncio.wait({woken}, timeout=delay)
            finally:
                woken.cancel()
            self._wake_poll.clear()
            if not self.election.is_leader:
                continue
            errors = self.faults["poll"]
            self._poll.failures = 0
            try:
                await self.poll_once()
                self.faults.redis.reached()
                if not self._poll.failures:
                    errors.ok()
            except REDIS_ERRORS as exc:
                self.faults.unreachable("poll", exc)
            except Exception as exc:
                if errors.error(f"failed: {self.faults.text(exc)}", trace=True):
                    await self.faults.diagnose(exc)

    async def poll_once(self) -> list[Publication]:
        """Scrape, decide and publish once (the leader's poll). Returns what was decided."""
        return await self._poll.once()

    async def _scrape(self, gate: GateConfig) -> Signals | None:
        """One gate's scrape of a poll (:meth:`.poll.Poll.scrape`)."""
        return await self._poll.scrape(gate)

    def _decide(
        self,
        gate: GateConfig,
        signals: Signals | None,
        in_flight: int | None,
        now: float,
        reading: Reading | None = None,
    ) -> Publication:
        """One gate's decision of a poll (:meth:`.gates.Gates.decide`)."""
        return self.gates.decide(gate, signals, in_flight, now, reading, self._poll.urls_of(gate))


def run_coordinator(
    config_path: str,
    *,
    coordinator_id: str | None = None,
    redis: str | None = None,
    prefix: str | None = None,
) -> int:
    """Entry point of ``fleetgate coordinator``: run until SIGTERM/SIGINT, exit 0. ``redis``
    and ``prefix`` override the config file's and the environment's."""
    config = load_config(config_path, redis=redis, prefix=prefix)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await Coordinator(config, coordinator_id=coordinator_id).run(stop)

    asyncio.run(main())
    return 0
