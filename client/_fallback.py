"""The fair-share fallback: serving while Redis cannot serve writes here, and the way back.

On the first outage (``on_redis_error="fair_share"``) every gate of the process switches to a
local bound, ``ceil(last limit / last live pods)`` (see :meth:`Gate.fair_share`); parked callers
continue under it. A probe then asks Redis every :data:`PROBE_PERIOD` seconds: a PING, then a
write (the fleet's gate registry, ``SADD``), since a Redis that answers PING may still refuse or
hold every write (``CLIENT PAUSE ... WRITE``, NOREPLICAS, OOM). When the write is answered, the
pod adopts its running work as fleet leases, waits :data:`RECOVERY_GRACE` (no new local permit
meanwhile), adopts again and resumes fleet mode. The mode changes go through
:class:`~._mode.ClientMode`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from redis.exceptions import ResponseError

from fleetgate._redis import ServerUnavailable, error_text, redact, unavailable_reply
from fleetgate.keys import fleet_keys

from ._gate import Gate
from ._runtime import OUTAGE_ERRORS, Runtime

__all__ = ["PROBE_PERIOD", "RECOVERY_GRACE", "Fallback"]

log = logging.getLogger("fleetgate.client")

# While Redis is unreachable each pod probes it every PROBE_PERIOD seconds (at most). After it
# answers again, a pod waits RECOVERY_GRACE seconds (its running work adopted, no new local
# permit started) before it is granted from Redis: longer than the other pods' probe period, so
# they adopt their running work first, and short enough that the fleet is back within about a
# heartbeat (1 s by default) of Redis returning. See Fallback._probe.
PROBE_PERIOD = 0.25
RECOVERY_GRACE = 0.4


class Fallback:
    """Switches ``gates`` (the fleet's live mapping) to their local bound and back."""

    def __init__(self, runtime: Runtime, gates: Mapping[str, Gate]) -> None:
        self.runtime = runtime
        self.gates = gates
        self.task: asyncio.Task[None] | None = None

    def enter(self, exc: BaseException) -> None:
        """Redis cannot serve writes here: serve locally and start probing (once per outage;
        an outage met while recovering is the probe's own)."""
        rt = self.runtime
        if rt.fallback_active or not rt.mode.fire("outage"):
            return
        for gate in self.gates.values():
            # Redis may come back empty (a restart): register the gate again on the next
            # heartbeat so `fleetgate status` lists it (tests/chaos/test_redis_restart.py).
            gate.in_registry = False
        log.warning(
            "Redis at %s unreachable (%s): serving with local fair-share bounds until it is back",
            redact(rt.url),
            error_text(exc),  # some errors have no text (redis-py's MaxConnectionsError)
        )
        for gate in self.gates.values():
            rt.metrics.fallback.labels(gate.name).set(1)
            log.warning("gate %s: local bound %d units", gate.name, gate.fair_share())
            gate.send_waiters_local()
        self.task = asyncio.create_task(self._probe(), name="fleetgate-probe")

    async def _probe(self) -> None:
        # Survives every exception: a reply that means "cannot serve writes now" (READONLY
        # after a failover, OOM, ...) is an outage like a refused connection (the scripts
        # raise ServerUnavailable), and anything else is logged, counted and retried: a
        # ResponseError during adoption must not end this task, or the pod stays in fallback
        # for good (tests/client/test_fallback.py::test_pod_resumes_after_redis_refused_writes).
        rt = self.runtime
        while not rt.closing:
            await asyncio.sleep(min(PROBE_PERIOD, rt.heartbeat_interval))
            try:
                await self._resume()
            except Exception as exc:
                if not isinstance(exc, OUTAGE_ERRORS):
                    rt.background_error("probe", exc)
                if rt.mode.fire("outage"):  # failed while recovering: local permits again
                    await self._wake_local_waiters()
                continue
            break
        if not rt.mode.fire("resumed"):
            return  # closing
        log.warning("Redis at %s reachable again: back to fleet mode", redact(rt.url))
        for gate in self.gates.values():
            rt.metrics.fallback.labels(gate.name).set(0)
        await self._wake_local_waiters()

    async def _resume(self) -> None:
        """Redis takes writes again: adopt running work, wait out the grace, adopt again."""
        rt = self.runtime
        await rt.redis.ping()
        await rt.refresh_connections()
        await self._write()
        # Before fleet mode resumes, what still runs counts against the fleet cap. From here
        # no new local permit starts (recovering), and this pod waits RECOVERY_GRACE before
        # it is granted from Redis again: every other pod in fallback probes within
        # PROBE_PERIOD and adopts its running work meanwhile. Without this, the first pod back
        # was granted up to the whole limit while the other pods' local permits still ran
        # uncounted (up to 17 calls running under a limit of 12 in
        # tests/chaos/test_redis_restart.py::test_redis_restart_fair_share).
        rt.mode.fire("writable")
        await self._adopt_all()
        await asyncio.sleep(RECOVERY_GRACE)
        await self._adopt_all()  # renews what the first pass adopted (no heartbeat yet)

    async def _write(self) -> None:
        """One write, answered: ``SADD`` of the gates in use to the fleet's registry
        (idempotent; the heartbeat lists them anyway). Under ``CLIENT PAUSE ... WRITE`` it waits
        (the socket timeout ends it) while local permits go on. Before, the probe took an
        answered PING for Redis being back: 25 local grants against 191 for a full pause of the
        same length (tests/chaos/test_refusals.py::
        test_a_write_pause_serves_from_the_fallback_like_a_full_pause).
        A refusal (OOM, NOREPLICAS, READONLY, ...) raises :class:`ServerUnavailable`; any other
        error reply (a registry key of the wrong type) is an answer: the write was served."""
        rt = self.runtime
        names = [gate.name for gate in self.gates.values() if gate.used]
        if not names:
            return  # nothing to adopt: the PING was enough
        try:
            await rt.redis.sadd(fleet_keys(rt.prefix).gates, *names)
        except ResponseError as exc:
            if unavailable_reply(exc):
                raise ServerUnavailable(str(exc)) from exc

    async def _adopt_all(self) -> None:
        for gate in list(self.gates.values()):
            try:
                await gate.adopt_running()
            except OUTAGE_ERRORS:
                raise
            except Exception as exc:  # one gate's broken keys never hold the others back
                self.runtime.background_error("adopt", exc, gate.name)

    async def _wake_local_waiters(self) -> None:
        for gate in list(self.gates.values()):
            await gate.wake_local()
