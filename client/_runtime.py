"""What every gate of one process is given: the per-process machinery.

A :class:`Runtime` holds the connection to Redis (the pool and the scripts), the pod's identity
and its lease ids, the metrics, the background tasks, and whether the fleet is in fleet mode or
in the fair-share fallback. Gates, the heartbeat, the fallback and the wake listeners are given
one; it knows none of them. The two things it must hand on -- "the heartbeat should re-plan" and
"Redis is unreachable" -- go to whoever the :class:`~fleetgate.client.Fleet` put in charge
(:attr:`Runtime.replan` is an event the heartbeat waits on; :attr:`Runtime.on_outage` a
callback the fallback installs).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
from collections.abc import Callable, Coroutine
from typing import Any, Literal

import redis.asyncio as aredis

from fleetgate._redis import REDIS_ERRORS, connect, error_text, prepare, redact
from fleetgate.errors import FleetgateError, RedisUnavailable
from fleetgate.keys import GateKeys
from fleetgate.scripts import GateScripts, Snapshot
from fleetgate.settings import GateSettings

from ._metrics import ClientMetrics
from ._mode import ClientMode

__all__ = ["OUTAGE_ERRORS", "OnRedisError", "Runtime"]

log = logging.getLogger("fleetgate.client")

OnRedisError = Literal["fair_share", "fail"]

# "Redis unreachable right now" as the client sees it: fleetgate._redis.REDIS_ERRORS plus an
# AttributeError "'NoneType' object has no attribute 'writelines'" from redis-py 8.1's cluster
# client: on a connection error it disconnects a node's free connections from a snapshot while
# another task may already be writing on one of them (a race in redis-py, not a fleetgate bug;
# tests/chaos/test_cluster_faults.py::test_master_failover_under_load[kill]). These except
# clauses wrap only the script calls, so anything else raising AttributeError there would also
# read as an outage: it is logged with its message when the fallback starts.
OUTAGE_ERRORS: tuple[type[BaseException], ...] = (*REDIS_ERRORS, AttributeError)


class Runtime:
    """The per-process machinery shared by every gate of one :class:`Fleet`."""

    def __init__(
        self,
        url: str,
        *,
        prefix: str,
        pod_key: str,
        on_redis_error: OnRedisError,
        heartbeat_interval: float,
        metrics: ClientMetrics,
        redis_options: dict[str, Any],
        recovery_fence: float | None = None,
    ) -> None:
        self.url = url
        self.prefix = prefix
        #: what lease ids, wake lists and the live-pod registry carry (see Fleet.pod_key)
        self.pod_key = pod_key
        self.on_redis_error = on_redis_error
        self.heartbeat_interval = heartbeat_interval
        # Every pod registers itself as live on each gate it uses at least this often (an idle
        # gate's heartbeat); a live-pod count is trusted one such period after registering.
        self.register_period = 3 * heartbeat_interval
        # How long a gate this pod finds without state holds every grant (Fleet's
        # recovery_fence; lua/lib_fence.lua gate_birth): one registration period by default.
        fence = self.register_period if recovery_fence is None else recovery_fence
        self.fence_ms = int(fence * 1000)
        #: a first permit has been held behind the recovery fence and said why (once a Fleet)
        self.fence_said = False
        self.metrics = metrics
        self.redis_options = redis_options
        #: connecting, fleet, fallback, recovering or closing: the one state machine (_mode.py)
        self.mode = ClientMode()
        #: set to make the heartbeat re-plan now (see poke_heartbeat)
        self.replan = asyncio.Event()
        #: loop time the heartbeat's nap ends (inf while it is not napping); see renew_by
        self.heartbeat_wakes_at = math.inf
        #: called (in fair_share mode) when Redis is found unreachable; the fallback sets it
        self.on_outage: Callable[[BaseException], None] = lambda exc: None
        self.tasks: set[asyncio.Task[Any]] = set()
        self._ids = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._redis: aredis.Redis | None = None
        self._scripts: GateScripts | None = None

    # -- the mode (read here, changed by ClientMode.fire) ---------------------------------------

    @property
    def fallback_active(self) -> bool:
        """Redis cannot serve writes here now: gates serve under their local fair share."""
        return self.mode.fallback_active

    @property
    def recovering(self) -> bool:
        """Redis writes again after an outage: running work is being adopted, no new local
        permit starts until fleet mode resumes (see _fallback.Fallback)."""
        return self.mode.recovering

    @property
    def closing(self) -> bool:
        return self.mode.closing

    @property
    def reached_redis(self) -> bool:
        """Redis has answered this process at least once (see _contact.FirstContact)."""
        return self.mode.reached

    @reached_redis.setter
    def reached_redis(self, value: bool) -> None:
        if value:
            self.mode.fire("answered")

    # -- the connection ----------------------------------------------------------------------

    async def connect(self) -> None:
        """Open the connection pool (Redis need not be up yet)."""
        self._loop = asyncio.get_running_loop()
        self._redis = connect(self.url, **self.redis_options)
        await prepare(self._redis)
        self._scripts = GateScripts(self._redis)

    @property
    def started(self) -> bool:
        return self._redis is not None

    async def disconnect(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()
        self._redis = None

    @property
    def redis(self) -> aredis.Redis:
        if self._redis is None:
            raise FleetgateError("the fleet is not started: use `async with Fleet(...)`")
        return self._redis

    @property
    def scripts(self) -> GateScripts:
        if self._scripts is None:
            raise FleetgateError("the fleet is not started: use `async with Fleet(...)`")
        return self._scripts

    def dedicated_client(self, socket_timeout: float) -> Any:
        """A client bound to a connection of its own (for a blocking command), not prepared
        yet (:func:`fleetgate._redis.prepare`): the caller closes it, also when cancelled while
        preparing."""
        return connect(
            self.url, dedicated=True, **{**self.redis_options, "socket_timeout": socket_timeout}
        )

    async def refresh_connections(self) -> None:
        """After an outage: drop the pool's idle connections and prepare the client again.

        Why: :meth:`fleetgate._redis.RedisMode.disconnect_idle`. New connections are opened on
        demand.
        """
        mode = self.scripts.redis
        await mode.disconnect_idle()
        await mode.prepare()

    async def snapshot(self, keys: GateKeys, *, defaults: GateSettings | None) -> Snapshot:
        """A gate's snapshot (``defaults``: what an acquire would register). A read has no
        fallback: Redis unreachable raises :class:`RedisUnavailable` in either mode, as the
        calls that cannot fall back do, never redis-py's own error."""
        try:
            return await self.scripts.snapshot(keys, defaults=defaults)
        except OUTAGE_ERRORS as exc:
            raise self.unreachable(exc) from exc

    def unreachable(self, exc: BaseException) -> RedisUnavailable:
        return RedisUnavailable(f"Redis at {redact(self.url)} is unreachable: {error_text(exc)}")

    def redis_failed(self, exc: BaseException) -> None:
        """Redis could not be reached: raise (``fail``) or hand over to the fallback."""
        if self.on_redis_error == "fail":
            raise self.unreachable(exc) from exc
        self.on_outage(exc)

    # -- ids, tasks, errors ------------------------------------------------------------------

    def next_id(self) -> str:
        """A fresh waiter/lease id: ``<pod_key>:<n>``."""
        return f"{self.pod_key}:{next(self._ids)}"

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` in the background, keeping a reference until it ends."""
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def drain(self, timeout: float) -> None:
        """Wait (at most ``timeout`` s) for the background tasks, including ones they spawn."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.tasks:
            left = deadline - loop.time()
            if left <= 0:
                break
            await asyncio.wait(list(self.tasks), timeout=left)

    def background_error(self, task: str, exc: BaseException, gate: str = "") -> None:
        """A background task met an unexpected error: logged and counted; the task goes on."""
        self.metrics.background_errors.labels(task).inc()
        where = f"gate {gate}: " if gate else ""
        log.warning("%s%s failed: %s: %s (retrying)", where, task, type(exc).__name__, exc)

    def fenced(self, gate: str, fence_ms: int) -> None:
        """An acquire of ``gate`` met the recovery fence (``fence_ms`` more): say once per
        Fleet why it waits and how a new prefix avoids it (``fleetgate init``)."""
        if self.fence_said:
            return
        self.fence_said = True
        log.warning(
            "gate %s: no permit for up to %.1f s: Redis held no state for this gate, which is how "
            "a new prefix and a Redis that lost its state (restarted empty, flushed) both look, "
            "so nothing is granted until the pods that may still run work under it have counted "
            "it (the recovery fence, docs/failure-modes.md). On a new prefix, `fleetgate init "
            "--prefix %s` (on Cluster with --gate for each gate) before the fleet's first start "
            "skips it.",
            gate,
            fence_ms / 1000,
            self.prefix,
        )

    def renew_by(self, when: float) -> None:
        """A gate got its first lease or waiter and must be renewed by ``when`` (loop time):
        wake the heartbeat only if it sleeps past that. (Waking it on every such event cost
        the uncontended permit a loop iteration and a re-plan each time.)"""
        if when < self.heartbeat_wakes_at:
            self.replan.set()

    def poke_heartbeat(self) -> None:
        """Make the heartbeat re-plan now (a gate appeared, got work, or its TTLs changed).

        Safe from any thread (``SyncFleet.gate`` runs in the caller's thread)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return  # not started: the heartbeat plans every gate when it starts
        try:
            here: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if here is loop:
            self.replan.set()
        else:
            loop.call_soon_threadsafe(self.replan.set)
