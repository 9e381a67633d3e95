"""The coordinator daemon: election, polling (scrape → decide → publish), reaper, /metrics.

Every coordinator process campaigns; the one holding the lease polls, the others stand by and
take over when the lease lapses (or at once when the leader shuts down cleanly). The leader:

* every ``poll_interval`` (± jitter) scrapes all adaptive gates concurrently, reads the fleet
  in-flight of every gate and the client-observed counters (``fg:{G}:obs``), steps each gate's
  pure controller with Redis server time -- the AIMD controller on the server's gauges (cut
  further when callers saw overloads), or the latency-gradient controller for gates driven by
  what callers report -- and publishes everything in one pipeline under its epoch;
* every second sweeps the expired leases and waiters of every registered gate (the reaper), so a
  crashed holder is reclaimed even when no client calls.

A publish refused for a stale epoch means a newer leader exists: this one steps down at once --
unless the epoch counter says no newer epoch was ever issued, in which case the gate's stored
epoch is corrupt and only that gate is skipped (logged), instead of flapping leadership forever.

Bad state in Redis never stops the daemon: every loop catches and logs (repeats of one error at
most once a minute), a key of the wrong type is named in the log (:mod:`fleetgate.safety`), a
broken gate does not stop the others from being published, and the loops recover by themselves
once the key is fixed. At start-up the server settings are checked (``maxmemory-policy``,
replicas) and problems are logged as WARNING.
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
from typing import Any, Literal

import httpx
from prometheus_client import CollectorRegistry, start_http_server

from fleetgate._redis import REDIS_ERRORS, connect, prepare, redact, scrub
from fleetgate.errors import ConfigError
from fleetgate.keys import fleet_keys
from fleetgate.observed import Reading
from fleetgate.safety import find_bad_keys, is_wrongtype, server_findings
from fleetgate.util_hash import LATENCY_FIELDS, OBSERVED_FIELDS

from .config import Config, GateConfig, load_config
from .control import Observed
from .controller import (
    ControllerParams,
    ControllerState,
    Decision,
    Observation,
    load_state,
    step,
    unknown_poll,
)
from .election import Election, Leadership
from .gradient import (
    GradientDecision,
    GradientParams,
    GradientState,
    LatencyView,
    cut_for_overload,
    load_gradient_state,
    step_latency,
    unknown_latency_poll,
)
from .metrics import CoordinatorMetrics
from .observations import ObsWindows, read_observations
from .publisher import Publication, Publisher
from .scrape import Fetcher, HttpxFetcher, LeanHttp, MetricsSource, Signals, new_client

__all__ = ["Coordinator", "run_coordinator"]

log = logging.getLogger("fleetgate.coordinator")

REAP_INTERVAL = 1.0
SCRAPE_CONCURRENCY = 64
# The same error of one loop is logged at most this often (with a count of the repeats).
ERROR_LOG_INTERVAL = 60.0
# Retry of the start-up safety check while Redis is unreachable.
SAFETY_RETRY = 5.0


class _ErrorLog:
    """Log each distinct error of a loop once, then at most every ``interval`` seconds, and say
    when the loop recovers: a broken key must not turn into a line per second."""

    def __init__(self, where: str, interval: float = ERROR_LOG_INTERVAL) -> None:
        self.where = where
        self.interval = interval
        self._last: dict[str, float] = {}
        self._repeats: dict[str, int] = {}

    def error(self, message: str, *, level: int = logging.ERROR, trace: bool = False) -> bool:
        """Log ``message`` unless it was logged less than ``interval`` ago; True if logged."""
        now = time.monotonic()
        last = self._last.get(message)
        if last is not None and now - last < self.interval:
            self._repeats[message] = self._repeats.get(message, 0) + 1
            return False
        repeats = self._repeats.pop(message, 0)
        more = f" (repeated {repeats} times since last logged)" if repeats else ""
        log.log(level, "%s: %s%s", self.where, message, more, exc_info=trace)
        if len(self._last) >= 256:  # messages that never repeat must not pile up
            self._last.clear()
        self._last[message] = now
        return True

    def ok(self) -> None:
        """The loop succeeded: forget past errors (and say so if there were any)."""
        if self._last:
            log.info("%s: recovered", self.where)
            self._last.clear()
            self._repeats.clear()


def _quiet_httpx() -> None:
    """httpx logs every request at INFO ("HTTP Request: GET ..."): one line per gate per poll.
    Raise its logger to WARNING unless someone configured that logger's level explicitly."""
    httpx_log = logging.getLogger("httpx")
    if httpx_log.level == logging.NOTSET:
        httpx_log.setLevel(logging.WARNING)


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
        http: Literal["lean", "httpx"] = "lean",
    ) -> None:
        """``http`` picks the scrape client: the lean GET of :mod:`.scrape.httpget` (default, ~10x
        cheaper per scrape) or httpx, kept selectable for comparison (``docs/servers.md``)."""
        self.config = config
        self.id = coordinator_id or default_coordinator_id()
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = CoordinatorMetrics.create(self.registry)
        self.reap_interval = reap_interval
        self.http = http
        self.params = {
            g.name: ControllerParams.for_gate(g, config.coordinator) for g in config.gates
        }
        self.states: dict[str, ControllerState] = {}
        # Gates driven by the client-observed latency (signal = "latency", or no metrics).
        self.latency_params = {
            g.name: GradientParams.for_gate(g, config.coordinator)
            for g in config.gates
            if g.latency_driven
        }
        self.latency_states: dict[str, GradientState] = {}
        self.windows = ObsWindows()
        self.published: dict[str, int] = {}
        self.metrics_port: int | None = None
        self._wake_poll = asyncio.Event()
        self._stopping = False
        self._client: Any = None
        self._election: Election | None = None
        self._publisher: Publisher | None = None
        self.sources: dict[str, MetricsSource] = {}
        self._errors = {
            name: _ErrorLog(name) for name in ("election", "poll", "reaper", "prune", "diagnosis")
        }
        # Idle gates are looked at every prune_check_interval (a quarter of the idle period, at
        # least every reaper sweep, at most a minute apart).
        idle = config.coordinator.prune_idle_after
        self.prune_check_interval = min(60.0, max(reap_interval, idle / 4))
        self._next_prune = 0.0
        self.safety_findings: list[str] | None = None  # None until the start-up check ran
        self._gate_failures = 0  # gates that failed in the current poll
        # gates whose last scrape failed: a failure is logged when it starts, not every poll
        self._scrape_failing: set[str] = set()

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
        # Scrapes run at most SCRAPE_CONCURRENCY at once over kept-alive connections: a
        # thousand simultaneous connects cost more (SYN backlog, TLS handshakes) than they save.
        # Each gate has its own small pool (see scrape/sources.py); they share one SSL context.
        self._scrape_slots = asyncio.Semaphore(SCRAPE_CONCURRENCY)
        tls = httpx.create_ssl_context()
        if self.http == "httpx":
            _quiet_httpx()

        def fetcher(gate: GateConfig) -> Fetcher:
            if self.http == "httpx":
                return HttpxFetcher(new_client(len(gate.metrics_urls), tls))
            return LeanHttp(tls)

        self.sources = {
            g.name: MetricsSource(g, fetcher(g)) for g in cfg.gates if self.params[g.name].adaptive
        }
        host, port = cfg.coordinator.metrics_address
        try:
            server, thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:  # taken, not ours, or a host that does not resolve
            raise ConfigError(
                f"metrics_listen: cannot listen on {cfg.coordinator.metrics_listen}: {exc}"
            ) from None
        self.metrics_port = int(server.server_port)
        log.info(
            "coordinator %s: redis %s prefix %r, %d gates (%d on metrics, %d on latency), "
            "metrics on %s:%d",
            self.id,
            redact(cfg.redis.url),
            cfg.redis.prefix,
            len(cfg.gates),
            sum(1 for p in self.params.values() if p.adaptive),
            sum(1 for p in self.latency_params.values() if p.adaptive),
            host,
            self.metrics_port,
        )
        tasks = [
            asyncio.create_task(self._election_loop(), name="election"),
            asyncio.create_task(self._poll_loop(), name="poll"),
            asyncio.create_task(self._reaper_loop(), name="reaper"),
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
            await asyncio.gather(*(src.fetcher.aclose() for src in self.sources.values()))
            await self._client.aclose()
            server.shutdown()
            server.server_close()
            thread.join(5)
            log.info("coordinator %s stopped", self.id)

    def _text(self, exc: BaseException) -> str:
        """``exc`` as one line for a log, never with the Redis password."""
        return scrub(f"{type(exc).__name__}: {exc}", self.config.redis.url)

    async def _safety_check(self) -> None:
        """Check the server's settings once Redis answers; log every finding as WARNING."""
        while not self._stopping:
            try:
                findings = await server_findings(self._client)
            except REDIS_ERRORS:
                await asyncio.sleep(SAFETY_RETRY)
                continue
            except Exception as exc:
                log.warning("could not check the Redis settings: %s", self._text(exc))
                return
            self.safety_findings = [f.message for f in findings]
            for finding in findings:
                log.warning("Redis settings: %s", finding.message)
            return

    async def _diagnose(self, exc: BaseException) -> None:
        """After a WRONGTYPE error, name the offending keys in the log."""
        if not is_wrongtype(exc):
            return
        try:
            findings = await find_bad_keys(
                self._client, self.config.redis.prefix, [g.name for g in self.config.gates]
            )
        except Exception as diag:
            self._errors["diagnosis"].error(f"could not find the bad key: {self._text(diag)}")
            return
        for finding in findings:
            self._errors["diagnosis"].error(finding.message)

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
                if election.is_leader:
                    self._errors["election"].ok()
            except REDIS_ERRORS as exc:
                self._errors["election"].error(
                    f"Redis unreachable ({self._text(exc)})", level=logging.WARNING
                )
            except Exception as exc:
                # Bad state in Redis (fg:epoch of the wrong type, ...): log, keep campaigning.
                if self._errors["election"].error(f"failed: {self._text(exc)}", trace=True):
                    await self._diagnose(exc)
            leading = election.is_leader
            self.metrics.leader.set(1 if leading else 0)
            # a standby's period is part of a target's lifetime (CoordinatorSettings.takeover)
            await asyncio.sleep(ttl / 3 if leading else self.config.coordinator.campaign_interval)

    async def _on_new_term(self, term: Leadership) -> None:
        """Warm failover: continue from the controller states the last leader stored."""
        self.metrics.epoch.set(term.epoch)
        self.windows.clear()
        try:
            # one read for every gate: its stored state, and whether its target has run out
            stored = await self.publisher.stored_states([g.name for g in self.config.gates])
            self.states = {
                name: load_state(state, self.params[name], lapsed=lapsed)
                for name, (state, lapsed) in stored.items()
            }
            self.latency_states = {
                name: load_gradient_state(stored[name][0], lp, lapsed=stored[name][1])
                for name, lp in self.latency_params.items()
            }
        except Exception as exc:
            # Unreachable or a util key of the wrong type: lead anyway, from a cold start.
            log.warning(
                "could not load the previous controller states (%s); cold start", self._text(exc)
            )
            self.states = {}
            self.latency_states = {}
            await self._diagnose(exc)
        self.published = {}
        resumed = {n: s.target for n, s in self.states.items() if self.params[n].adaptive}
        resumed.update({n: s.target for n, s in self.latency_states.items()})
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
            errors = self._errors["poll"]
            self._gate_failures = 0
            try:
                await self.poll_once()
                if not self._gate_failures:
                    errors.ok()
            except REDIS_ERRORS as exc:
                errors.error(
                    f"Redis unreachable ({self._text(exc)}); targets decay if this persists",
                    level=logging.WARNING,
                )
            except Exception as exc:
                if errors.error(f"failed: {self._text(exc)}", trace=True):
                    await self._diagnose(exc)

    async def _scrape(self, gate: GateConfig) -> Signals | None:
        if not self.params[gate.name].adaptive:
            return None
        c = self.config.coordinator
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

    async def poll_once(self) -> list[Publication]:
        """Scrape, decide and publish once (the leader's poll). Returns what was decided."""
        t0 = time.perf_counter()
        gates = self.config.gates
        now = await self.publisher.server_time()
        # The obs counters are read while the scrapes are in flight: no extra wait.
        observing = asyncio.ensure_future(self._observations(gates, now))
        signals = await asyncio.gather(*(self._scrape(g) for g in gates))
        observed = await observing
        in_flight = await self._in_flight(gates)
        pubs = [
            self._decide_isolated(g, s, in_flight.get(g.name), now, r)
            for g, s, r in zip(gates, signals, observed, strict=True)
        ]
        term = self.election.term
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
            self.election.term = None
            self.metrics.leader.set(0)
        self.metrics.poll_seconds.observe(time.perf_counter() - t0)
        return pubs

    async def _in_flight(self, gates: tuple[GateConfig, ...]) -> dict[str, int]:
        """Fleet in-flight per gate; a gate whose key is broken is unknown, not fatal."""
        try:
            return await self.publisher.in_flight(gates)
        except REDIS_ERRORS:
            raise
        except Exception:
            pass  # one bad key fails the whole pipeline: ask gate by gate
        counts: dict[str, int] = {}
        for gate in gates:
            try:
                counts.update(await self.publisher.in_flight((gate,)))
            except REDIS_ERRORS:
                raise
            except Exception as exc:
                self._gate_failures += 1
                self._errors["poll"].error(
                    f"gate {gate.name}: in-flight unknown: {self._text(exc)}"
                )
                await self._diagnose(exc)
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
                self._gate_failures += 1
                results.append(None)
                self._errors["poll"].error(
                    f"gate {pub.gate.name}: not published: {self._text(exc)}"
                )
                await self._diagnose(exc)
        return results

    async def _deposed(self, epoch: int, refused: list[str]) -> bool:
        """A refused target means a newer leader -- if a newer epoch was ever issued.

        Epochs come only from ``INCR`` of the epoch counter. When the counter is still at our
        epoch, nobody newer exists and the gate's stored epoch is corrupt (planted, or the
        counter was reset): stepping down would only make every coordinator flap forever.
        """
        try:
            counter = await self._client.get(fleet_keys(self.config.redis.prefix).epoch)
            latest = int(counter) if counter is not None else None
        except REDIS_ERRORS:
            raise
        except Exception:
            latest = None
        if latest is None or latest > epoch:
            return True
        self._gate_failures += 1
        self._errors["poll"].error(
            f"gates {', '.join(refused)}: target refused although no epoch above {epoch} was "
            "ever issued (the stored target epoch is corrupt, or the epoch counter was reset); "
            "these gates keep their old target until it expires, and their old config and "
            "snapshot (every gate write is fenced by that epoch). Delete their target keys "
            f"(redis-cli DEL '{self.config.redis.prefix}:{{<gate>}}:target') to fix."
        )
        return False

    async def _observations(
        self, gates: tuple[GateConfig, ...], now: float
    ) -> list[Reading | None]:
        """Every adapted gate's client-observed counters (None: static gates, failed reads)."""
        wanted = [
            g
            for g in gates
            if self.params[g.name].adaptive
            or (g.name in self.latency_params and self.latency_params[g.name].adaptive)
        ]
        readings = await read_observations(
            self._client, [self.publisher.keys(g.name) for g in wanted], now
        )
        by_name = dict(zip((g.name for g in wanted), readings, strict=True))
        return [by_name.get(g.name) for g in gates]

    def _decide_latency(
        self, gate: GateConfig, in_flight: int | None, now: float, reading: Reading | None
    ) -> Publication:
        params = self.latency_params[gate.name]
        state = self.latency_states.get(gate.name) or GradientState.initial(params)
        outcomes, latency = self.windows.update(gate.name, reading)
        view = LatencyView(outcomes, latency, in_flight) if params.adaptive else None
        decision = step_latency(state, view, params, now)
        self.latency_states[gate.name] = decision.state
        observed = Observed(outcomes, True, decision.p50, decision.state.no_load)
        pub = Publication(gate, decision, None, in_flight, now, observed)
        self._account(pub)
        return pub

    def _decide_isolated(
        self,
        gate: GateConfig,
        signals: Signals | None,
        in_flight: int | None,
        now: float,
        reading: Reading | None,
    ) -> Publication:
        """:meth:`_decide`, but a failure (a bug of ours on some input) makes this gate's poll
        unknown -- held, unpublished, so its target decays -- instead of aborting the poll of
        every gate while the leader keeps its lease (no standby would take over)."""
        try:
            pub = self._decide(gate, signals, in_flight, now, reading)
        except Exception as exc:
            self._errors["poll"].error(
                f"gate {gate.name}: decision failed ({self._text(exc)}); held as unknown",
                trace=True,
            )
            return self._held(gate, in_flight, now)
        return pub

    def _held(self, gate: GateConfig, in_flight: int | None, now: float) -> Publication:
        """An unknown poll for this gate: held, not published, and from the floor (published
        once) after ``unknown_reset_polls`` of them, as for a scrape that failed -- else the
        first good poll would publish the stale target at once."""
        decision: Decision | GradientDecision
        if gate.name in self.latency_params:
            lp = self.latency_params[gate.name]
            gs = self.latency_states.get(gate.name) or GradientState.initial(lp)
            decision = unknown_latency_poll(gs, lp)
            self.latency_states[gate.name] = decision.state
        else:
            cp = self.params[gate.name]
            cs = self.states.get(gate.name) or ControllerState.initial(cp)
            decision = unknown_poll(cs, cp)
            self.states[gate.name] = decision.state
        return Publication(gate, decision, None, in_flight, now)

    def _decide(
        self,
        gate: GateConfig,
        signals: Signals | None,
        in_flight: int | None,
        now: float,
        reading: Reading | None = None,
    ) -> Publication:
        if gate.name in self.latency_params:
            return self._decide_latency(gate, in_flight, now, reading)
        params = self.params[gate.name]
        state = self.states.get(gate.name) or ControllerState.initial(params)
        obs = Observation.from_signals(signals, in_flight) if signals is not None else None
        decision = step(state, obs, params, now)
        outcomes, _ = self.windows.update(gate.name, reading) if params.adaptive else (None, None)
        decision = cut_for_overload(decision, outcomes, params, now)
        self.states[gate.name] = decision.state
        source = self.sources.get(gate.name)
        urls = source.urls if source is not None and source.urls else ()
        pub = Publication(gate, decision, signals, in_flight, now, Observed(outcomes), urls)
        self._account(pub)
        return pub

    def _account(self, pub: Publication) -> None:
        """The coordinator's metrics and log line for one decision."""
        decision, signals, in_flight = pub.decision, pub.signals, pub.in_flight
        m, name = self.metrics, pub.gate.name
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
            util = pub.snapshot().encode()
            observed = {k: util[k] for k in (*OBSERVED_FIELDS, *LATENCY_FIELDS) if k in util}
            log.info(
                "gate=%s target %s -> %d reason=%s running=%s waiting_capacity=%s in_flight=%s%s",
                name,
                previous if previous is not None else "-",
                decision.target,
                decision.reason.value,
                signals.running if signals else None,
                signals.waiting_capacity if signals else None,
                in_flight,
                "".join(f" {k}={v}" for k, v in observed.items() if v not in ("", "0")),
            )
        if decision.publish:
            self.published[name] = decision.target

    # -- reaper ------------------------------------------------------------------------------

    async def _reaper_loop(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.reap_interval)
            if not self.election.is_leader:
                continue
            errors = self._errors["reaper"]
            try:
                names = await self.publisher.registered_gates()
                # A non-transactional pipeline runs every gate's sweep even if one fails.
                await self.publisher.sweep(names)
                self.metrics.reaped_gates.inc(len(names))
                errors.ok()
            except REDIS_ERRORS as exc:
                errors.error(f"Redis unreachable ({self._text(exc)})", level=logging.WARNING)
                continue
            except Exception as exc:
                if errors.error(f"sweep failed: {self._text(exc)}", trace=True):
                    await self._diagnose(exc)
                continue
            errors = self._errors["prune"]
            try:
                await self._prune(names)
            except REDIS_ERRORS as exc:
                errors.error(f"Redis unreachable ({self._text(exc)})", level=logging.WARNING)
            except Exception as exc:
                if errors.error(f"failed: {self._text(exc)}", trace=True):
                    await self._diagnose(exc)

    async def _prune(self, names: list[str]) -> None:
        """Drop registered gates that are not configured here and idle for prune_idle_after."""
        idle = self.config.coordinator.prune_idle_after
        now = time.monotonic()
        if idle <= 0 or now < self._next_prune:
            return
        self._next_prune = now + self.prune_check_interval
        term = self.election.term
        configured = {g.name for g in self.config.gates}
        candidates = [n for n in names if n not in configured]
        if term is None or not term.valid() or not candidates:
            return
        pruned, failed = await self.publisher.prune(term.epoch, candidates, int(idle * 1000))
        errors = self._errors["prune"]
        for name, exc in failed:
            if errors.error(f"gate {name}: idle check failed: {self._text(exc)}"):
                await self._diagnose(exc)
        if not failed:
            errors.ok()
        if pruned:
            self.metrics.pruned_gates.inc(len(pruned))
            shown = ", ".join(pruned[:10]) + (
                f" (+{len(pruned) - 10} more)" if len(pruned) > 10 else ""
            )
            log.info("pruned %d gates idle for %g s: %s", len(pruned), idle, shown)


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
