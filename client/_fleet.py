"""The per-process fleet handle: it builds the machinery, hands out gates, and shuts it down.

Who knows whom (one direction only)::

    Fleet ─┬─> Heartbeat ─┐
           ├─> Fallback ──┼─> Gate ─┬─> WakeListeners ─> Runtime
           └──────────────┘         └──────────────────> Runtime

The :class:`~._runtime.Runtime` is the per-process machinery every gate is given (connection,
scripts, ids, metrics, background tasks, fleet/fallback mode); the heartbeat, the fallback and
the wake listeners are modules of their own that drive gates from outside.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import uuid
from types import TracebackType
from typing import TYPE_CHECKING, Any

import redis.asyncio as aredis
from prometheus_client import CollectorRegistry

from fleetgate._redis import redact
from fleetgate.configfile import redis_from_env
from fleetgate.errors import ConfigError, FleetgateError
from fleetgate.keys import GateKeys, validate_gate_name, validate_name, validate_prefix
from fleetgate.scripts import GateScripts
from fleetgate.settings import GateSettings, GateSettingsKwargs, check_setting_names

from ._contact import FirstContact
from ._fallback import Fallback
from ._gate import Gate
from ._heartbeat import Heartbeat
from ._metrics import client_metrics
from ._runtime import OnRedisError, Runtime
from ._utilization import GateUtilization, utilization_of
from ._wakes import WakeListeners

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack is Python 3.11+

__all__ = ["Fleet", "GateUtilization"]

log = logging.getLogger("fleetgate.client")

_MAX_POD_ID = 64


def _default_pod_id() -> str:
    host = socket.gethostname().replace(":", "-")[:40]
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Fleet:
    """Owns the Redis connections and background tasks of one process; hands out gates.

    ``async with Fleet("redis://redis:6379/0") as fleet:`` then ``fleet.gate("bge-m3")``.
    url and prefix left out (None): ``$FLEETGATE_REDIS_URL`` and ``$FLEETGATE_PREFIX``, else
    ``redis://127.0.0.1:6379/0`` and ``fg``.

    on_redis_error: ``"fair_share"`` (default) keeps serving while Redis is unreachable, each pod
    bounded by ``ceil(last limit / last live pods)`` of the gate (1 while it has not counted its
    peers yet), and returns to fleet mode when Redis answers again; ``"fail"`` raises
    :class:`RedisUnavailable` instead.

    pod_id is a label (logs, the worker's metrics); lease ids stay unique per process whatever
    it says (:attr:`pod_key` adds a random suffix), so several processes may share one.

    recovery_fence (seconds; None = one registration period, ``3 × heartbeat_interval``): when
    this pod is the first to find a gate without state in Redis (Redis restarted empty or was
    flushed, or the gate is new), the gate grants nothing for that long, so that pods still
    running work the lost state counted can count it again first; callers park meanwhile. On a
    standalone Redis only gates first seen within a fence period of the server's first
    fleetgate state pay it (a restarted or flushed server); on Cluster every new gate does; on
    a prefix stamped by ``fleetgate init`` (:func:`fleetgate.stamp.init_prefix`) none does
    until a wipe removes the stamp. The first permit that waits for it logs why, once. 0
    turns it off: safe only when Redis keeps its state (AOF persistence) or one process uses
    the prefix. See docs/failure-modes.md.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        prefix: str | None = None,
        pod_id: str | None = None,
        on_redis_error: OnRedisError = "fair_share",
        heartbeat_interval: float = 1.0,
        wake_block: float = 2.0,
        registry: CollectorRegistry | None = None,
        redis_options: dict[str, Any] | None = None,
        recovery_fence: float | None = None,
    ) -> None:
        if on_redis_error not in ("fair_share", "fail"):
            raise ConfigError(
                f"on_redis_error: expected 'fair_share' or 'fail', got {on_redis_error!r}"
            )
        if heartbeat_interval <= 0:
            raise ConfigError(f"heartbeat_interval: expected > 0, got {heartbeat_interval}")
        if recovery_fence is not None and not 0 <= recovery_fence <= 3600:
            raise ConfigError(
                f"recovery_fence: expected None or 0 to 3600 seconds, got {recovery_fence}"
            )
        url, prefix = redis_from_env(url, prefix)
        self.url = url
        self.prefix = validate_prefix(prefix)
        self.pod_id = pod_id or _default_pod_id()
        if len(self.pod_id) > _MAX_POD_ID:
            raise ConfigError(f"pod_id: at most {_MAX_POD_ID} characters, got {len(self.pod_id)}")
        validate_name(self.pod_id, "pod_id")  # a plain gate name's rules (no group braces)
        # What lease ids, wake lists and the live-pod registry use: unique per process even
        # when several processes are given the same pod_id ($HOSTNAME with several workers):
        # two processes minting the same lease ids would share holder entries (limit 2 -> 3
        # running; tests/client/test_fleet_processes.py::
        # test_processes_sharing_a_pod_id_keep_the_cap).
        self.pod_key = self.pod_id if pod_id is None else f"{self.pod_id}-{uuid.uuid4().hex[:8]}"
        self.on_redis_error = on_redis_error
        self.heartbeat_interval = heartbeat_interval
        self.wake_block = wake_block
        self.metrics = client_metrics(registry)
        self.runtime = Runtime(
            url,
            prefix=self.prefix,
            pod_key=self.pod_key,
            on_redis_error=on_redis_error,
            heartbeat_interval=heartbeat_interval,
            metrics=self.metrics,
            redis_options=dict(redis_options or {}),
            recovery_fence=recovery_fence,
        )
        self._gates: dict[str, Gate] = {}
        self._gates_lock = threading.Lock()
        self._wakes = WakeListeners(self.runtime, block=wake_block)
        self._fallback = Fallback(self.runtime, self._gates)
        self._contact = FirstContact(self.runtime)
        self._beats = Heartbeat(self.runtime, self._gates)
        self.runtime.on_outage = self._fallback.enter
        self._heartbeat: asyncio.Task[None] | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> Fleet:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def start(self) -> None:
        """Open the connection pool and start the heartbeat. Redis need not be up yet."""
        if self.runtime.started:
            return
        await self.runtime.connect()
        await self._contact.start()
        self._heartbeat = asyncio.create_task(self._beats.run(), name="fleetgate-heartbeat")
        log.debug("fleet %s started against %s", self.pod_id, redact(self.url))

    async def close(self) -> None:
        """Stop background tasks, leave every wait list, release held leases, close connections."""
        self.runtime.mode.fire("close")
        loops = [t for t in (self._heartbeat, self._fallback.task, self._contact.task) if t]
        for t in loops:
            t.cancel()
        tasks = [*loops, *self._wakes.cancel_all()]
        # redis-py may hold a blocking call on a dedicated connection until it returns (at most
        # wake_block), or turn the cancellation into a connection error; the loops also stop on
        # the flag, and close() never waits longer than that.
        if tasks:
            await asyncio.wait(tasks, timeout=self.wake_block + 1.0)
        closing = FleetgateError("fleet closed")
        for gate in self._gates.values():
            gate.shut_down(closing)
        # Releases and cancels still in flight (possibly spawning more) finish before the
        # connections close; bounded, since Redis may be gone.
        await self.runtime.drain(timeout=2.0)
        # A gate used but not listed yet (a process that lived less than a heartbeat) is
        # listed now, so `fleetgate status` shows it; the leader prunes it once idle.
        unlisted = [g for g in self._gates.values() if g.used and not g.in_registry]
        if unlisted and not self.runtime.fallback_active:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._beats.list_in_registry(unlisted), 1.0)
        await self.runtime.disconnect()

    # -- gates -------------------------------------------------------------------------------

    def gate(self, name: str, **settings: Unpack[GateSettingsKwargs]) -> Gate:
        """The gate ``name``. ``settings`` are the fields of
        :class:`~fleetgate.settings.GateSettings` as keywords (``floor=4``, ``ceiling=...``:
        :class:`~fleetgate.settings.GateSettingsKwargs`), defaults registered (by the gate's
        first heartbeat or call) only if the gate has no configuration in Redis yet -- again
        after Redis lost it (the coordinator's config wins, and a setting it
        lacks takes its default, not this one); None takes the default. The first call for a
        name fixes them: a later call returns the same gate and ignores its settings.

        The admission order's settings (docs/admission.md):
        ``max_queued_per_tenant`` bounds one tenant's waiters over all priorities (default: the
        same as ``max_queued``); ``tenant_weights`` maps tenant names to their share of the
        units while several tenants wait in one priority band (int 1..1000, unlisted tenants
        weigh 1); permits of a priority below ``shed_below`` (default 0) never wait: granted at
        once or :class:`~fleetgate.errors.Overloaded`. A bad value is a
        :class:`~fleetgate.errors.ConfigError` naming the gate and the setting.
        """
        check_setting_names(settings, "Fleet.gate")
        validate_gate_name(name)
        found = self._gates.get(name)
        if found is not None:
            return found
        # Created under a lock (SyncFleet calls this from its callers' threads): two threads
        # that each built a gate left one outside the fleet, never renewed by the heartbeat.
        with self._gates_lock:
            found = self._gates.get(name)
            if found is not None:
                return found
            defaults = GateSettings.for_gate(name, **settings)
            given = frozenset(k for k, v in settings.items() if v is not None)
            gate = Gate(name, defaults, self.runtime, self._wakes, given)
            self._gates[name] = gate
            self.runtime.poke_heartbeat()  # a live pod of the gate now, not a period later
            return gate

    async def flush(self) -> None:
        """Wait until the releases this process made so far have reached Redis (a permit is
        released without waiting for Redis; see :meth:`Lease.release`). For tests and tools
        that read Redis right after a permit block."""
        for gate in list(self._gates.values()):
            await gate.flush()

    async def utilization(self, name: str) -> GateUtilization:
        """Snapshot of gate ``name``: limit, fleet in-flight and queue, the coordinator's view
        (after this process's own releases so far: :meth:`flush`). Redis unreachable:
        :class:`RedisUnavailable`, whatever ``on_redis_error`` says."""
        gate = self._gates.get(name)
        defaults = gate.defaults if gate is not None else None
        if gate is not None:
            await gate.flush()  # this process's own releases are in what it reads
        snap = await self.runtime.snapshot(GateKeys.of(self.prefix, name), defaults=defaults)
        return utilization_of(name, snap)

    # -- state, for tools and tests ------------------------------------------------------------

    @property
    def fallback_active(self) -> bool:
        """Whether Redis is unreachable and gates serve under their local fair share."""
        return self.runtime.fallback_active

    @property
    def reached_redis(self) -> bool:
        """Whether Redis has answered this fleet at least once since :meth:`start` (which
        waits up to a second for it). False for a wrong URL, host or port (an ERROR is logged
        every 30 s meanwhile) or a Redis not up yet; an outage later leaves it True."""
        return self.runtime.reached_redis

    @property
    def scripts(self) -> GateScripts:
        return self.runtime.scripts

    @property
    def redis(self) -> aredis.Redis:
        return self.runtime.redis
