"""The coordinator daemon: election, polling (scrape → decide → publish), reaper, /metrics.

Every coordinator process campaigns; the one holding the lease polls, the others stand by and
take over when the lease lapses (or at once when the leader shuts down cleanly). The leader:

* every ``poll_interval`` (± jitter) scrapes all adaptive gates concurrently, reads the fleet
  in-flight of every gate, steps each gate's pure AIMD controller with Redis server time, and
  publishes everything in one pipeline under its epoch;
* every second sweeps the expired leases and waiters of every registered gate (the reaper), so a
  crashed holder is reclaimed even when no client calls.

A publish refused for a stale epoch means a newer leader exists: this one steps down at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import socket
import time
import uuid
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, start_http_server

from fleetgate._redis import REDIS_ERRORS, connect, prepare, redact

from .config import Config, GateConfig, load_config
from .controller import ControllerParams, ControllerState, Observation, step
from .election import Election, Leadership
from .metrics import CoordinatorMetrics
from .publisher import Publication, Publisher
from .signals import Signals, fetch_signals

__all__ = ["Coordinator", "run_coordinator"]

log = logging.getLogger("fleetgate.coordinator")

REAP_INTERVAL = 1.0


def default_coordinator_id() -> str:
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
    ) -> None:
        self.config = config
        self.id = coordinator_id or default_coordinator_id()
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = CoordinatorMetrics.create(self.registry)
        self.reap_interval = reap_interval
        self.params = {
            g.name: ControllerParams.for_gate(g, config.coordinator) for g in config.gates
        }
        self.states: dict[str, ControllerState] = {}
        self.published: dict[str, int] = {}
        self.metrics_port: int | None = None
        self._wake_poll = asyncio.Event()
        self._stopping = False
        self._client: Any = None
        self._election: Election | None = None
        self._publisher: Publisher | None = None
        self._http: httpx.AsyncClient | None = None

    @property
    def election(self) -> Election:
        assert self._election is not None, "coordinator not running"
        return self._election

    @property
    def publisher(self) -> Publisher:
        assert self._publisher is not None, "coordinator not running"
        return self._publisher

    # -- lifecycle ---------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Run until ``stop`` is set; then resign leadership at once and close everything."""
        cfg = self.config
        self._client = connect(cfg.redis.url)
        await prepare(self._client)
        self._publisher = Publisher(self._client, cfg.redis.prefix)
        self._election = Election(
            self._client, cfg.redis.prefix, self.id, cfg.coordinator.leader_ttl
        )
        self._http = httpx.AsyncClient(follow_redirects=False)
        host, port = cfg.coordinator.metrics_address
        server, thread = start_http_server(port, addr=host, registry=self.registry)
        self.metrics_port = int(server.server_port)
        log.info(
            "coordinator %s: redis %s prefix %r, %d gates (%d adaptive), metrics on %s:%d",
            self.id,
            redact(cfg.redis.url),
            cfg.redis.prefix,
            len(cfg.gates),
            sum(1 for p in self.params.values() if p.adaptive),
            host,
            self.metrics_port,
        )
        tasks = [
            asyncio.create_task(self._election_loop(), name="election"),
            asyncio.create_task(self._poll_loop(), name="poll"),
            asyncio.create_task(self._reaper_loop(), name="reaper"),
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
            await self._http.aclose()
            await self._client.aclose()
            server.shutdown()
            server.server_close()
            thread.join(5)
            log.info("coordinator %s stopped", self.id)

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
            except REDIS_ERRORS as exc:
                log.warning("election: Redis unreachable (%s)", exc)
            leading = election.is_leader
            self.metrics.leader.set(1 if leading else 0)
            await asyncio.sleep(ttl / 3 if leading else min(1.0, ttl / 3))

    async def _on_new_term(self, term: Leadership) -> None:
        """Warm failover: continue from the controller states the last leader stored."""
        self.metrics.epoch.set(term.epoch)
        self.states = await self.publisher.load_states(self.config.gates, self.params)
        self.published = {}
        resumed = {n: s.target for n, s in self.states.items() if self.params[n].adaptive}
        log.info("leader with epoch %d; resuming targets %s", term.epoch, resumed)
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
            try:
                await self.poll_once()
            except REDIS_ERRORS as exc:
                log.warning("poll: Redis unreachable (%s); targets decay if this persists", exc)
            except Exception:
                log.exception("poll failed")

    async def _scrape(self, gate: GateConfig) -> Signals | None:
        if not self.params[gate.name].adaptive:
            return None
        assert self._http is not None
        c = self.config.coordinator
        t0 = time.perf_counter()
        signals = await fetch_signals(
            self._http,
            gate.metrics_urls,
            server=gate.server,
            model_name=gate.model_name,
            timeout=c.scrape_timeout,
            max_bytes=c.max_body_bytes,
        )
        self.metrics.scrape_seconds.labels(gate.name).observe(time.perf_counter() - t0)
        if not signals.ok:
            self.metrics.scrape_errors.labels(gate.name).inc()
            log.warning("gate %s: metrics unusable: %s", gate.name, signals.error)
        return signals

    async def poll_once(self) -> list[Publication]:
        """Scrape, decide and publish once (the leader's poll). Returns what was decided."""
        t0 = time.perf_counter()
        gates = self.config.gates
        now = await self.publisher.server_time()
        signals = await asyncio.gather(*(self._scrape(g) for g in gates))
        in_flight = await self.publisher.in_flight(gates)
        pubs = [
            self._decide(g, s, in_flight.get(g.name), now)
            for g, s in zip(gates, signals, strict=True)
        ]
        term = self.election.term
        if term is None or not term.valid():
            log.warning("poll: no longer leader; nothing published")
            return pubs
        ttl_ms = int(self.config.coordinator.target_ttl * 1000)
        accepted = await self.publisher.publish(term.epoch, ttl_ms, pubs)
        if not all(accepted):
            self.metrics.refused.inc()
            log.error(
                "targets refused for epoch %d: a newer leader exists; stepping down", term.epoch
            )
            self.election.term = None
            self.metrics.leader.set(0)
        self.metrics.poll_seconds.observe(time.perf_counter() - t0)
        return pubs

    def _decide(
        self, gate: GateConfig, signals: Signals | None, in_flight: int | None, now: float
    ) -> Publication:
        params = self.params[gate.name]
        state = self.states.get(gate.name) or ControllerState.initial(params)
        obs = Observation.from_signals(signals, in_flight) if signals is not None else None
        decision = step(state, obs, params, now)
        self.states[gate.name] = decision.state
        m, name = self.metrics, gate.name
        m.decisions.labels(name, decision.reason.value).inc()
        m.target.labels(name).set(decision.target)
        if in_flight is not None:
            m.in_flight.labels(name).set(in_flight)
        if signals is not None:
            if signals.running is not None:
                m.running.labels(name).set(signals.running)
            if signals.waiting_capacity is not None:
                m.waiting_capacity.labels(name).set(signals.waiting_capacity)
            m.saturated.labels(name).set(1 if decision.saturated else 0)
        previous = self.published.get(name)
        if decision.publish and previous != decision.target:
            log.info(
                "gate=%s target %s -> %d reason=%s running=%s waiting_capacity=%s in_flight=%s",
                name,
                previous if previous is not None else "-",
                decision.target,
                decision.reason.value,
                signals.running if signals else None,
                signals.waiting_capacity if signals else None,
                in_flight,
            )
        if decision.publish:
            self.published[name] = decision.target
        return Publication(gate, decision, signals, in_flight, now)

    # -- reaper ------------------------------------------------------------------------------

    async def _reaper_loop(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.reap_interval)
            if not self.election.is_leader:
                continue
            try:
                names = await self.publisher.registered_gates()
                await self.publisher.sweep(names)
                self.metrics.reaped_gates.inc(len(names))
            except REDIS_ERRORS as exc:
                log.warning("reaper: Redis unreachable (%s)", exc)
            except Exception:
                log.exception("reaper sweep failed")


def run_coordinator(config_path: str, *, coordinator_id: str | None = None) -> int:
    """Entry point of ``fleetgate coordinator``: run until SIGTERM/SIGINT, exit 0."""
    config = load_config(config_path)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await Coordinator(config, coordinator_id=coordinator_id).run(stop)

    asyncio.run(main())
    return 0
