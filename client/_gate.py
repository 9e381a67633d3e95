"""One gate as seen from one process: acquiring, parking, releasing and the local fallback."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from fleetgate._redis import REDIS_ERRORS as _REDIS_ERRORS
from fleetgate.errors import Overloaded
from fleetgate.keys import GateKeys
from fleetgate.scripts import GRANTED, REJECTED, GateDefaults, HeartbeatReply, Snapshot

from ._deadline import Deadline, cancel_requests, raise_if_cancel_lost
from ._map import Fn, RetryPolicy, batched, merge_indexed, run_map

if TYPE_CHECKING:
    from ._fleet import Fleet
    from ._metrics import ClientMetrics

T = TypeVar("T")
R = TypeVar("R")

__all__ = ["Gate", "Lease"]

log = logging.getLogger("fleetgate.client")

# "Redis unreachable right now" as the client sees it: fleetgate._redis.REDIS_ERRORS plus an
# AttributeError "'NoneType' object has no attribute 'writelines'" from redis-py 8.1's cluster
# client: on a connection error it disconnects a node's free connections from a snapshot while
# another task may already be writing on one of them (a race in redis-py, not a fleetgate bug;
# tests/chaos/test_cluster_faults.py::test_master_failover_under_load[kill]). These except
# clauses wrap only the script calls, so anything else raising AttributeError there would also
# read as an outage: it is logged with its message when the fallback starts.
REDIS_ERRORS: tuple[type[BaseException], ...] = (*_REDIS_ERRORS, AttributeError)

# Park "forever" when the caller gives no deadline; the waiter heartbeat still bounds how long a
# dead process' entry survives.
NO_DEADLINE_WAIT_MS = 24 * 3600 * 1000


class _Requeue(Exception):
    """The parked entry vanished from Redis (expired while this process stalled): park again."""


class _GoLocal(Exception):
    """Redis became unreachable while parked: continue under the local fair-share bound."""


class Lease:
    """One granted permit. Released by the ``permit()`` context manager or :meth:`release`.

    ``token`` is a fencing token, monotonic per gate in grant order. ``lost`` is set when the
    lease could not be renewed and Redis no longer counts it; ``is_lost`` reads the same from any
    thread.
    """

    def __init__(
        self, gate: Gate, lease_id: str, token: int, *, local: bool = False, expires_at: int = 0
    ) -> None:
        self.gate = gate
        self.id = lease_id
        self.token = token
        self.local = local
        # Redis server time (ms) this lease was last seen renewed to (0: not known yet). The
        # heartbeat sends it back, so the gate can tell a lease it lost (restart) from one that
        # expired (see lua/heartbeat.lua).
        self.expires_at = expires_at
        self.lost = asyncio.Event()
        self._lost_flag = threading.Event()
        self._released = False

    @property
    def is_lost(self) -> bool:
        return self._lost_flag.is_set()

    def _mark_lost(self) -> None:
        self._lost_flag.set()
        self.lost.set()

    async def release(self) -> None:
        """Give the permit back (idempotent). Never raises for an unreachable Redis."""
        if self._released:
            return
        self._released = True
        # Spawned on the fleet (which waits for it on close) and shielded: a cancelled caller
        # still gives the permit back.
        await asyncio.shield(self.gate.fleet.spawn(self.gate._release(self)))

    def __repr__(self) -> str:
        kind = "local" if self.local else "fleet"
        return f"Lease(gate={self.gate.name!r}, id={self.id!r}, token={self.token}, {kind})"


@dataclass
class _Waiter:
    id: str
    future: asyncio.Future[None]
    deadline: Deadline
    parked_at: float = field(default_factory=time.monotonic)
    # Set once the acquire reply said "parked": only then does the heartbeat refresh it (before,
    # Redis may not have it yet and would report it lost).
    parked: bool = False
    # Server time (ms) the lease handed to this waiter expires at, when a heartbeat saw the grant.
    expires_at: int = 0

    def remaining_ms(self) -> int:
        left = self.deadline.remaining()
        return NO_DEADLINE_WAIT_MS if left is None else max(1, int(left * 1000))


class Gate:
    """A named fleet-wide limit. Obtain one with :meth:`Fleet.gate`."""

    def __init__(self, fleet: Fleet, name: str, defaults: GateDefaults) -> None:
        self.fleet = fleet
        self.name = name
        self.keys = GateKeys.of(fleet.prefix, name)
        self.defaults = defaults
        self.leases: dict[str, Lease] = {}
        self.waiters: dict[str, _Waiter] = {}
        self.last_limit = defaults.floor
        # Live pods of this gate as last counted by a heartbeat this pod trusts (0: none yet,
        # the fair share is then 1): see on_heartbeat.
        self.last_live_pods = 0
        # When (loop time) the heartbeat that created this pod's live entry was sent.
        self.registered_at: float | None = None
        # TTLs in force in Redis (the coordinator's config may differ from our defaults), from
        # every acquire and heartbeat reply; the heartbeat is paced by them.
        self.ttl_ms = min(defaults.lease_ms, defaults.waiter_ms)
        # When (loop time) this gate's leases and waiters were last renewed (or, for a gate
        # that just got its first work, granted): the heartbeat's pacing (Fleet).
        self.last_beat = 0.0
        # Permits granted locally while Redis was unreachable (the fair-share fallback).
        self.local_leases: dict[str, Lease] = {}
        self.registered = False  # in the fleet's gate registry (for `fleetgate status`)
        self._local_cond = asyncio.Condition()
        self._labels = fleet.metrics, name

    # -- public API --------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def permit(self, deadline: float | None = 30.0) -> AsyncIterator[Lease]:
        """Hold one permit for the block: ``async with gate.permit(deadline=30.0) as lease:``.

        ``deadline`` (seconds, or None) is total: it covers the queue wait and the block itself.
        When it fires while parked the caller leaves the wait list (no permit consumed); when it
        fires inside the block, the block is cancelled and the lease released. Either way
        :class:`DeadlineExceeded` is raised. A full wait list raises :class:`Overloaded` at once.
        """
        async with self.deadline(deadline, "permit") as dl:
            lease = await self._acquire(dl)
            try:
                yield lease
            finally:
                await lease.release()

    async def acquire(self, deadline: float | None = 30.0) -> Lease:
        """Acquire a permit and return its lease; the caller must ``await lease.release()``.

        ``deadline`` bounds the wait only. Prefer :meth:`permit`, which releases for you.
        """
        async with self.deadline(deadline, "queue wait") as dl:
            return await self._acquire(dl)

    async def map(
        self,
        fn: Fn[T, R],
        items: Iterable[T] | AsyncIterable[T],
        *,
        max_in_flight: int | None = 8,
        deadline: float | None = 30.0,
        retry: RetryPolicy = None,
        return_exceptions: bool = False,
        call_timeout: float | None = None,
    ) -> list[Any]:
        """Call ``fn(item)`` for every item, each call inside its own permit; results in order.

        * ``max_in_flight``: this request's calls at once (None: only the gate limits).
        * ``deadline``: one total deadline (seconds) over queue waits, calls and retries; on
          expiry parked calls leave the queue without reaching ``fn``, running ones are
          cancelled, permits are released, and :class:`DeadlineExceeded` is raised.
        * ``retry``: None/True = retry timeouts, connection errors and 5xx with jittered
          back-off (4 attempts), False = never, or a tenacity ``AsyncRetrying``. Retries run
          inside the permit (never re-queued), stop at the deadline, and never retry
          fleetgate's own errors (:class:`Overloaded` above all).
        * ``return_exceptions``: per-item outcomes (exceptions in place) instead of failing
          fast; by default the first failure cancels the siblings and is raised.
        * ``call_timeout``: a per-attempt timeout (a timeout counts as transient).

        ``fn`` may be async or sync (run in a thread); ``items`` may be an async iterable.
        """
        return await run_map(
            self,
            fn,
            items,
            max_in_flight=max_in_flight,
            deadline=deadline,
            retry=retry,
            return_exceptions=return_exceptions,
            call_timeout=call_timeout,
        )

    async def map_batches(
        self,
        fn: Fn[Sequence[T], Any],
        items: Sequence[T],
        *,
        batch_size: int,
        indexed: bool = False,
        **options: Any,
    ) -> list[Any]:
        """Split ``items`` into batches of ``batch_size``, run each batch through :meth:`map`,
        and return one result per item in the original order.

        ``fn(batch)`` returns either one value per batch item, in order, or -- with
        ``indexed=True``, as rerankers do -- ``(index within the batch, value)`` pairs in any
        order, which land at ``batch id × batch_size + index``. With 512-passage batches a
        typical rerank request is a single call.
        """
        if options.get("return_exceptions"):
            raise ValueError("map_batches does not support return_exceptions")
        batches = batched(items, batch_size)
        per_batch = await self.map(fn, batches, **options)
        if indexed:
            return merge_indexed(per_batch, batch_size, len(items))
        flat: list[Any] = []
        for batch, values in zip(batches, per_batch, strict=True):
            if len(values) != len(batch):
                raise ValueError(f"fn returned {len(values)} results for a batch of {len(batch)}")
            flat.extend(values)
        return flat

    def deadline(self, seconds: float | None, where: str) -> Deadline:
        """A total deadline for this gate, counted in the deadline-exceeded metric."""
        counter = self.fleet.metrics.deadline_exceeded.labels(self.name)
        return Deadline(self.name, seconds, where=where, on_expire=counter.inc)

    async def acquire_for(self, dl: Deadline) -> Lease:
        """Acquire under an enclosing deadline (used by :meth:`map`)."""
        return await self._acquire(dl)

    @property
    def metrics(self) -> ClientMetrics:
        return self.fleet.metrics

    async def capacity(self) -> int:
        """The gate's current fleet-wide limit (live target, else floor)."""
        return (await self.snapshot()).limit

    async def snapshot(self) -> Snapshot:
        """A consistent view of the gate in Redis (holders, waiters, limit, config, stats)."""
        return await self.fleet.scripts.inspect(self.keys, defaults=self.defaults)

    # -- acquiring ---------------------------------------------------------------------------

    async def _acquire(self, dl: Deadline) -> Lease:
        fleet = self.fleet
        metrics = fleet.metrics
        while True:
            if fleet.fallback_active:
                lease = await self._acquire_local()
                if lease is not None:
                    return lease
                continue
            lease_id = fleet.next_id()
            waiter = _Waiter(lease_id, asyncio.get_running_loop().create_future(), dl)
            if not self.leases and not self.waiters:
                fleet.work_started(self)  # paces the first renewal from now
            # Registered before the call: a hand-off can be popped by the wake listener
            # before this coroutine sees the script's reply.
            self.waiters[lease_id] = waiter
            pending = cancel_requests()
            try:
                reply = await fleet.scripts.acquire(
                    self.keys, lease_id, waiter.remaining_ms(), self.defaults
                )
                # A cancellation redis-py swallowed (Python 3.11): raised here, so the except
                # below gives back what the script did (tests/chaos/test_cancel_ends.py).
                raise_if_cancel_lost(pending)
            except REDIS_ERRORS as exc:
                self.waiters.pop(lease_id, None)
                fleet.forget_later(self, lease_id)
                fleet.redis_failed(exc)  # raises RedisUnavailable in "fail" mode
                raise_if_cancel_lost(pending)
                continue
            except BaseException:
                self.waiters.pop(lease_id, None)
                fleet.forget_later(self, lease_id)
                raise
            self.last_limit = reply.limit
            self.note_ttls(reply.lease_ms, reply.waiter_ms)
            if reply.status == GRANTED:
                self.waiters.pop(lease_id, None)
                return self._granted(lease_id, reply.token, reply.expires_at)
            if reply.status == REJECTED:
                self.waiters.pop(lease_id, None)
                metrics.rejected.labels(self.name).inc()
                raise Overloaded(self.name, reply.n)
            lease = await self._park(waiter, reply.token)
            if lease is not None:
                return lease

    async def _park(self, waiter: _Waiter, token: int) -> Lease | None:
        """Wait for the hand-off. Returns the lease, or None to try again (requeue/fallback)."""
        waiter.parked = True
        depth = self.fleet.metrics.queue_depth.labels(self.name)
        depth.inc()
        self.fleet.ensure_listener(self)
        try:
            await waiter.future
        except _Requeue:
            self.waiters.pop(waiter.id, None)
            return None
        except _GoLocal:
            # Leave the fleet queue if Redis still answers; else the entry expires by TTL.
            self.waiters.pop(waiter.id, None)
            self.fleet.spawn(self._cancel(waiter.id))
            return None
        except BaseException:
            # Cancelled or deadline while parked: leave the queue; a grant that raced in is
            # released by the same script.
            self.waiters.pop(waiter.id, None)
            await asyncio.shield(self.fleet.spawn(self._cancel(waiter.id)))
            raise
        finally:
            depth.dec()
        self.waiters.pop(waiter.id, None)
        self.fleet.metrics.wait_seconds.labels(self.name).observe(
            time.monotonic() - waiter.parked_at
        )
        return self._granted(waiter.id, token, waiter.expires_at)

    def _granted(self, lease_id: str, token: int, expires_at: int = 0) -> Lease:
        lease = Lease(self, lease_id, token, expires_at=expires_at)
        self.leases[lease_id] = lease
        self.fleet.metrics.granted.labels(self.name).inc()
        self.fleet.metrics.in_flight.labels(self.name).inc()
        return lease

    async def _cancel(self, waiter_id: str) -> None:
        try:
            await self.fleet.scripts.cancel(self.keys, waiter_id)
        except REDIS_ERRORS as exc:
            # Retried until Redis answers (see _release): a parked entry left behind is handed
            # a slot that nobody uses until its TTL.
            log.debug("gate %s: cancel of %s failed (%s); retrying", self.name, waiter_id, exc)
            self.fleet.forget_later(self, waiter_id)

    # -- releasing ---------------------------------------------------------------------------

    async def _release(self, lease: Lease) -> None:
        if lease.local:
            async with self._local_cond:
                self.local_leases.pop(lease.id, None)
                self._local_cond.notify_all()
            self.fleet.metrics.in_flight.labels(self.name).dec()
            return
        if self.leases.pop(lease.id, None) is not None:
            self.fleet.metrics.in_flight.labels(self.name).dec()
        if self.fleet.fallback_active:
            async with self._local_cond:
                self._local_cond.notify_all()
        try:
            await self.fleet.scripts.release(self.keys, lease.id)
        except REDIS_ERRORS as exc:
            # Retried (as a cancel, which releases a held id) until Redis answers, else it
            # expires by TTL. Without the retry, permits released while Redis was unreachable
            # but not lost (a cut link, a slot migration, a failover) kept their slots after
            # recovery until their lease TTL: the gate stood still with every slot held by
            # nobody (tests/chaos/test_cluster_faults.py::test_slot_migration_under_load).
            log.debug("gate %s: release of %s failed (%s); retrying", self.name, lease.id, exc)
            self.fleet.forget_later(self, lease.id)

    # -- events from the wake listener and the heartbeat ---------------------------------------

    def on_granted(self, lease_id: str, expires_at: int = 0) -> None:
        """A hand-off for ``lease_id`` arrived (wake list or heartbeat)."""
        waiter = self.waiters.get(lease_id)
        if waiter is not None:
            waiter.expires_at = max(waiter.expires_at, expires_at)
            if not waiter.future.done():
                waiter.future.set_result(None)
            return
        if lease_id not in self.leases:
            # Nobody waits for it any more (cancelled meanwhile): give it back.
            self.fleet.spawn(self._cancel(lease_id))

    def note_ttls(self, lease_ms: int, waiter_ms: int) -> None:
        """The TTLs in force in Redis; a shorter one re-paces the heartbeat at once."""
        ttl = min(lease_ms, waiter_ms)
        if ttl != self.ttl_ms:
            self.ttl_ms = ttl
            self.fleet.poke_heartbeat()

    def on_heartbeat(self, reply: HeartbeatReply, sent_at: float, renewed: list[str]) -> None:
        """Apply a heartbeat reply; ``sent_at`` is when (loop time) it was sent, ``renewed`` the
        lease ids it carried."""
        self.last_limit = reply.limit
        self.note_ttls(reply.lease_ms, reply.waiter_ms)
        # The live-pod count is trusted only from a heartbeat sent a full registration period
        # after this pod's entry was created: by then every live pod of the gate that started
        # about when this one did has registered too. Until then the fair share is 1, never
        # the whole limit (4 pods x limit 4 ran 16 at once before; tests/test_fault_holes.py).
        if reply.pod_new:
            if self.registered_at is not None:
                self.registered = False  # created anew: a wiped Redis? register the gate again
            self.registered_at = sent_at
            self.last_live_pods = 0
        elif (
            self.registered_at is not None
            and sent_at - self.registered_at >= self.fleet.register_period
        ):
            self.last_live_pods = reply.live_pods
        lost = set(reply.lost_leases)
        for lease_id in renewed:
            lease = self.leases.get(lease_id)
            if lease is not None and lease_id not in lost:
                lease.expires_at = reply.expires_at
        for lease_id in reply.lost_leases:
            lease = self.leases.pop(lease_id, None)
            if lease is not None:
                log.warning("gate %s: lease %s lost (not renewed in time)", self.name, lease_id)
                self.fleet.metrics.lease_lost.labels(self.name).inc()
                self.fleet.metrics.in_flight.labels(self.name).dec()
                lease._mark_lost()
        running = [lid for lid in reply.adopted if lid in self.leases]
        if running:
            log.warning(
                "gate %s: Redis had lost %d running leases of this pod before they could expire "
                "(a restart or failover?); they count against the limit again",
                self.name,
                len(running),
            )
        for lease_id in reply.adopted:
            if lease_id not in self.leases:
                # Released while this heartbeat was in flight (its release ran first and the
                # heartbeat counted it again): give it back again.
                self.fleet.spawn(self._cancel(lease_id))
        for lease_id in reply.granted_waiters:
            self.on_granted(lease_id, reply.expires_at)
        for lease_id in reply.lost_waiters:
            waiter = self.waiters.get(lease_id)
            if waiter is not None and not waiter.future.done():
                log.warning("gate %s: parked entry %s expired; parking again", self.name, lease_id)
                waiter.future.set_exception(_Requeue())
                waiter.future.exception()  # seen, even if its acquire call is still in flight

    def fail_waiters(self, exc: BaseException | None) -> None:
        """Redis is gone: parked callers continue locally (exc None) or fail with ``exc``."""
        for waiter in list(self.waiters.values()):
            if not waiter.future.done():
                waiter.future.set_exception(exc if exc is not None else _GoLocal())
                # A caller whose acquire call is still in flight never awaits this future
                # (its own call fails too): mark the exception as seen.
                waiter.future.exception()

    # -- fallback ----------------------------------------------------------------------------

    def fair_share(self) -> int:
        """Local bound while Redis is unreachable: ceil(last limit / live pods), with the live
        pods as last counted by a heartbeat this pod trusts; 1 while it has no such count (a
        pod that started, or fell back, before it could count its peers)."""
        if self.last_live_pods <= 0:
            return 1
        return max(1, math.ceil(self.last_limit / self.last_live_pods))

    async def _acquire_local(self) -> Lease | None:
        """A permit under the local bound, or None if fleet mode came back meanwhile."""
        fleet = self.fleet
        async with self._local_cond:
            await self._local_cond.wait_for(
                lambda: (
                    not fleet.fallback_active
                    or (
                        # Not while Redis is back and running work is being adopted: a permit
                        # started now would be uncounted when another pod resumes fleet mode.
                        not fleet.recovering
                        and len(self.local_leases) + len(self.leases) < self.fair_share()
                    )
                )
            )
            if not fleet.fallback_active:
                return None
            lease = Lease(self, fleet.next_id(), 0, local=True)
            self.local_leases[lease.id] = lease
        fleet.metrics.in_flight.labels(self.name).inc()
        return lease

    async def adopt_running(self) -> None:
        """Redis is back: count every permit this pod still runs as a fleet lease again.

        Local permits become fleet leases (renewed by the heartbeat, released by the release
        script); fleet leases that Redis lost in a restart are re-added. Raises the Redis error
        if Redis fails again (the fleet stays in fallback and retries).
        """
        local = list(self.local_leases.values())
        held = list(self.leases.values())
        ids = [*(lease.id for lease in held), *(lease.id for lease in local)]
        if not ids:
            return
        max_token = max((lease.token for lease in held), default=0)
        _, expires_at = await self.fleet.scripts.adopt(self.keys, ids, max_token)
        for lease in (*held, *local):
            lease.expires_at = expires_at
        for lease in local:
            if self.local_leases.pop(lease.id, None) is None:
                # Released while the adoption was in flight: give the fresh lease back.
                self.fleet.spawn(self.fleet.scripts.release(self.keys, lease.id))
                continue
            lease.local = False
            self.leases[lease.id] = lease

    async def wake_local(self) -> None:
        async with self._local_cond:
            self._local_cond.notify_all()

    def __repr__(self) -> str:
        return f"Gate({self.name!r}, limit≈{self.last_limit})"
