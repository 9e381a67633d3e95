"""One gate as seen from one process: acquiring, parking, releasing and the local fallback.

A :class:`Gate` is given what it needs from its process -- a :class:`~._runtime.Runtime`
(scripts, ids, metrics, background tasks, fleet or fallback mode) and the process's
:class:`~._wakes.WakeListeners` -- and knows nothing of the :class:`~._fleet.Fleet`, the
heartbeat or the fallback that drive it. Those call in through the methods under "driven by the
heartbeat" and "driven by the fallback" below.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential

from fleetgate._redis import error_text
from fleetgate.admission import (
    class_member,
    lane_class,
    validate_priority,
    validate_tenant,
    validate_weight,
    waiter_member,
    weighted_id,
)
from fleetgate.errors import ConfigError, FleetgateError, LeaseLost, Overloaded
from fleetgate.keys import GateKeys
from fleetgate.observed import tally
from fleetgate.scripts import (
    GRANTED,
    MAX_BATCH,
    PARKED,
    REJECTED,
    REJECTED_TENANT,
    SHED,
    TOO_HEAVY,
    AcquireReply,
    HeartbeatReply,
    Snapshot,
)
from fleetgate.settings import GateSettings

from ._batch import Batcher
from ._deadline import Deadline
from ._local import LocalPermits
from ._map import Fn, RetryPolicy, batched, merge_indexed, run_map
from ._metrics import ClassMetrics, ClientMetrics, GateMetrics
from ._report import Reporting
from ._runtime import OUTAGE_ERRORS, Runtime
from ._wakes import WakeListeners

T = TypeVar("T")
R = TypeVar("R")

__all__ = ["Gate", "Lease", "Renewal"]

log = logging.getLogger("fleetgate.client")

# Park "forever" when the caller gives no deadline; the waiter heartbeat still bounds how long a
# dead process' entry survives.
NO_DEADLINE_WAIT_MS = 24 * 3600 * 1000
#: how long a parked caller that gives up waits for its cancel's round trip before it returns
CANCEL_WAIT_S = 0.25


class _Requeue(Exception):
    """The parked entry vanished from Redis (expired while this process stalled): park again."""


class _GoLocal(Exception):
    """Redis became unreachable while parked: continue under the local fair-share bound."""


# One call of a gate's batch: (lease id, wait ms, class) acquires, (lease id, None, report)
# releases (report: fleetgate.observed.encode_report, "" for none). The weight is in the lease
# id (fleetgate.admission.weighted_id), the priority and tenant in the class
# (fleetgate.admission.lane_class).
_Call = tuple[str, int | None, str]

# The wake value of a waiter evicted by a higher band ('<id>=x'); a grant is '<id>=<token>'.
_EVICTED = "x"
# The wake value of a waiter refused because it weighs more than the ceiling C, lowered after it
# parked, starts so: '<id>=c<C>'.
_REFUSED = "c"


@dataclass(frozen=True)
class _Ask:
    """What one acquire asks for: weight (units), priority band and tenant, validated."""

    weight: int = 1
    priority: int = 0
    tenant: str | None = None

    @classmethod
    def of(cls, weight: int, priority: int, tenant: str | None) -> _Ask:
        # the common case, without the checks' cost (a bool is refused by them)
        plain = type(weight) is type(priority) is int and (weight, priority) == (1, 0)
        if plain and tenant is None:
            return _DEFAULT_ASK
        return cls(validate_weight(weight), validate_priority(priority), validate_tenant(tenant))

    @functools.cached_property
    def cls(self) -> str:
        return lane_class(self.priority, self.tenant)


_DEFAULT_ASK = _Ask()


class Lease(Reporting):
    """One granted permit. Released by the ``permit()`` context manager or :meth:`release`.

    ``token`` is a fencing token, monotonic per gate in grant order; ``weight`` the units it
    holds, ``priority`` and ``tenant`` what it was asked with. ``lost`` is set when the
    lease could not be renewed and Redis no longer counts it; ``is_lost`` reads the same from any
    thread. Leaving a ``permit()`` block whose lease was lost raises :class:`LeaseLost` (unless
    the block raised already).
    """

    def __init__(
        self,
        gate: Gate,
        lease_id: str,
        token: int,
        *,
        local: bool = False,
        expires_at: int = 0,
        weight: int = 1,
        priority: int = 0,
        tenant: str | None = None,
    ) -> None:
        self.gate = gate
        self.id = lease_id
        self.token = token
        self.local = local
        self.weight = weight
        self.priority = priority
        self.tenant = tenant
        # The metric series it counts in (set when granted; kept, so its release counts there).
        self._series: ClassMetrics | None = None
        # Redis server time (ms) this lease was last seen renewed to (0: not known yet). The
        # heartbeat sends it back, so the gate can tell a lease it lost (restart) from one that
        # expired (see lua/heartbeat.lua).
        self.expires_at = expires_at
        # A plain flag (is_lost reads it from any thread) and the event made on first use: most
        # leases are never asked, and two events cost as much as the rest of the lease.
        self._is_lost = False
        self._lost: asyncio.Event | None = None
        self._released = False
        self._granted_at = time.monotonic()  # the default latency of report() counts from here

    @property
    def lost(self) -> asyncio.Event:
        """An event set when the lease is lost (use it on the fleet's event loop)."""
        event = self._lost
        if event is None:
            # Stored before the flag is read: a _mark_lost in between sets one or the other.
            event = self._lost = asyncio.Event()
            if self._is_lost:
                event.set()
        return event

    def series(self) -> ClassMetrics:
        """The metric series of the lease's class (priority, tenant)."""
        if self._series is None:
            self._series = self.gate.series.of(self)
        return self._series

    @property
    def is_lost(self) -> bool:
        """Whether the lease was lost; safe to read from any thread."""
        return self._is_lost

    def _mark_lost(self) -> None:
        self._is_lost = True
        if self._lost is not None:
            self._lost.set()

    def lost_error(self) -> LeaseLost:
        """The error for leaving a permit block whose lease was lost."""
        return LeaseLost(
            f"gate {self.gate.name!r}: lease {self.id} (token {self.token}) was lost while its "
            "block ran: it was not renewed in time, so Redis stopped counting it and the fleet "
            "may have run over its limit"
        )

    async def release(self) -> None:
        """Give the permit back (idempotent). Never raises for an unreachable Redis.

        A fleet lease is released without waiting for Redis: the release leaves with this
        process's next script call on the gate (group commit, see ``_batch.py``), ahead of any
        acquire of the gate this process makes after it, so a caller that releases and acquires
        again pays one round trip. :meth:`Fleet.close` waits for releases in flight.
        """
        if self._released:
            return
        self._released = True
        if self.local:
            self.gate._release_local(self)  # synchronous: nothing to cancel, nothing to race
        else:
            self.gate._release_fleet(self)

    def __repr__(self) -> str:
        kind = "local" if self.local else "fleet"
        return f"Lease(gate={self.gate.name!r}, id={self.id!r}, token={self.token}, {kind})"


@dataclass
class _Waiter:
    id: str
    #: set to the fencing token of the grant (or an exception)
    future: asyncio.Future[int]
    deadline: Deadline
    ask: _Ask = _DEFAULT_ASK
    #: its entry in Redis once parked ('<tenant>}<R>}<seq20>}<id>')
    member: str = ""
    parked_at: float = field(default_factory=time.monotonic)
    # Set once the acquire reply said "parked": only then does the heartbeat refresh it (before,
    # Redis may not have it yet and would report it lost).
    parked: bool = False
    # Server time (ms) the lease handed to this waiter expires at, when a heartbeat saw the grant.
    expires_at: int = 0

    def remaining_ms(self) -> int:
        left = self.deadline.remaining()
        return NO_DEADLINE_WAIT_MS if left is None else max(1, int(left * 1000))


@dataclass(frozen=True)
class Renewal:
    """What one heartbeat of a gate renews: its leases (id, expiry last seen) and its parked
    waiters (waiter member, ms left of the caller's deadline), and the highest token it
    holds."""

    leases: list[tuple[str, int]]
    waiters: list[tuple[str, int]]
    max_token: int


class Gate:
    """A named fleet-wide limit. Obtain one with :meth:`Fleet.gate`."""

    def __init__(
        self, name: str, defaults: GateSettings, runtime: Runtime, wakes: WakeListeners
    ) -> None:
        self.name = name
        self.defaults = defaults
        self.runtime = runtime
        self.wakes = wakes
        self.keys = GateKeys.of(runtime.prefix, name)
        # This pod's wake and re-arm lists of the gate (named once: every park asks for them).
        self._wake_key = self.keys.wake(runtime.pod_key)
        self._rearm_key = self.keys.rearm(runtime.pod_key)
        self.leases: dict[str, Lease] = {}
        self.waiters: dict[str, _Waiter] = {}
        #: this gate's series of the client metrics
        self.series = GateMetrics(runtime.metrics, name, tenants=defaults.tenant_weights)
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
        # that just got its first work, granted): the heartbeat paces the next renewal by it.
        self.renewed_at = 0.0
        # Loop time by which the heartbeat should beat this gate whatever its schedule (inf:
        # none): the end of a recovery fence its waiters park behind (see beat_after).
        self.beat_by = math.inf
        # Permits granted locally while Redis was unreachable (the fair-share fallback).
        self.local_leases: dict[str, Lease] = {}
        # Listed in the fleet's gate registry (`fg:gates`, for `fleetgate status`).
        self.in_registry = False
        # The local bound while Redis is unreachable: units by priority (see _local.py).
        self._local = LocalPermits(
            self.fair_share,
            in_use=self._fleet_units,
            allowed=lambda: not runtime.recovering,
            active=lambda: runtime.fallback_active,
            gate=name,
        )
        # This process's acquires and releases of the gate, each sent as one script call per
        # batch (group commit: see _batch.py).
        # (lease id, wait ms) to acquire, (lease id, None) to release.
        self._calls: Batcher[_Call, AcquireReply | None] = Batcher(
            self._send_calls,
            spawn=runtime.spawn,
            max_batch=MAX_BATCH,
            on_orphan=self._acquire_orphaned,
        )

    # -- public API --------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def permit(
        self,
        deadline: float | None = 30.0,
        *,
        weight: int = 1,
        priority: int = 0,
        tenant: str | None = None,
    ) -> AsyncIterator[Lease]:
        """Hold one permit for the block: ``async with gate.permit(deadline=30.0) as lease:``.

        ``weight`` (units, int >= 1) counts against the gate's limit; ``priority`` (int in
        [-100, 100], higher first) picks the band: a band is served only when nobody waits in a
        higher one, and a band below the gate's ``shed_below`` never parks (:class:`Overloaded`
        when it cannot start at once); ``tenant`` (a name, or None) shares its band fairly with
        the other tenants waiting in it. See README "Priorities, tenants and weights".

        ``deadline`` (seconds, or None) is total: it covers the queue wait and the block itself.
        When it fires while parked the caller leaves the wait list (no permit consumed); when it
        fires inside the block, the block is cancelled and the lease released. Either way
        :class:`DeadlineExceeded` is raised. A full wait list raises :class:`Overloaded` at once.
        If the lease was lost while the block ran (``lease.is_lost``), leaving the block raises
        :class:`LeaseLost`, unless the block raised an exception of its own.
        """
        ask = _Ask.of(weight, priority, tenant)
        async with self._total_deadline(deadline, "permit") as dl:
            lease = await self._acquire(dl, ask)
            try:
                yield lease
            finally:
                await lease.release()
            if lease.is_lost:
                raise lease.lost_error()

    async def acquire(
        self,
        deadline: float | None = 30.0,
        *,
        weight: int = 1,
        priority: int = 0,
        tenant: str | None = None,
    ) -> Lease:
        """Acquire a permit and return its lease; the caller must ``await lease.release()``.

        ``deadline`` bounds the wait only; ``weight``, ``priority`` and ``tenant`` as for
        :meth:`permit`. Prefer :meth:`permit`, which releases for you.
        """
        ask = _Ask.of(weight, priority, tenant)
        async with self._total_deadline(deadline, "queue wait") as dl:
            return await self._acquire(dl, ask)

    async def map(
        self,
        fn: Fn[T],
        items: Iterable[T] | AsyncIterable[T],
        *,
        max_in_flight: int | None = 8,
        deadline: float | None = 30.0,
        retry: RetryPolicy = None,
        return_exceptions: bool = False,
        call_timeout: float | None = None,
        weight: int | Callable[[Any], int] = 1,
        priority: int = 0,
        tenant: str | None = None,
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
        * ``weight`` (units per call: an int, or ``fn(item) -> int`` to weigh each item),
          ``priority`` and ``tenant``: as for :meth:`permit`.

        ``fn`` may be async or sync (run in a thread); ``items`` may be an async iterable.
        A lease lost under a call is counted and logged, not raised: the call's result stands.
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
            weight=weight,
            priority=priority,
            tenant=tenant,
        )

    async def map_batches(
        self,
        fn: Fn[Sequence[T]],
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

    async def flush(self) -> None:
        """Wait until this process's releases (and acquires) of the gate so far have reached
        Redis: a released permit leaves with the gate's next script call, not before
        :meth:`Lease.release` returns."""
        await self._calls.flush()

    async def acquire_for(
        self, dl: Deadline, *, weight: int = 1, priority: int = 0, tenant: str | None = None
    ) -> Lease:
        """Acquire under an enclosing deadline (used by :meth:`map`)."""
        return await self._acquire(dl, _Ask.of(weight, priority, tenant))

    @property
    def metrics(self) -> ClientMetrics:
        return self.runtime.metrics

    async def capacity(self) -> int:
        """The gate's current fleet-wide limit (live target, else floor)."""
        return (await self.snapshot()).limit

    async def snapshot(self) -> Snapshot:
        """A consistent view of the gate in Redis (holders, waiters, limit, config, stats),
        after this process's own releases so far (:meth:`flush`)."""
        await self.flush()
        return await self.runtime.scripts.snapshot(self.keys, defaults=self.defaults)

    def _total_deadline(self, seconds: float | None, where: str) -> Deadline:
        """A total deadline for this gate, counted in the deadline-exceeded metric."""
        counter = self.series.deadline_exceeded
        return Deadline(self.name, seconds, where=where, on_expire=counter.inc)

    # -- acquiring ---------------------------------------------------------------------------

    async def _acquire(self, dl: Deadline, ask: _Ask = _DEFAULT_ASK) -> Lease:
        rt = self.runtime
        while True:
            if rt.fallback_active:
                lease = await self._acquire_local(ask.weight, ask.priority, ask.tenant)
                if lease is not None:
                    return lease
                continue
            lease_id = weighted_id(rt.next_id(), ask.weight)
            loop = asyncio.get_running_loop()
            waiter = _Waiter(lease_id, loop.create_future(), dl, ask)
            was_idle = not self.busy
            # Registered before the call: a hand-off can be popped by the wake listener
            # before this coroutine sees the script's reply.
            self.waiters[lease_id] = waiter
            if was_idle:
                # The first lease or waiter: renew it a renewal period from now (the grant is
                # as fresh as a renewal), whatever the heartbeat was sleeping on before.
                self.renewed_at = loop.time()
                rt.renew_by(self.renewed_at + self.renewal_period)
            try:
                reply = await self._request(lease_id, waiter.remaining_ms(), ask.cls)
            except OUTAGE_ERRORS as exc:
                self.waiters.pop(lease_id, None)
                self._forget_later(lease_id)
                rt.redis_failed(exc)  # raises RedisUnavailable in "fail" mode
                continue
            except asyncio.CancelledError:
                self.waiters.pop(lease_id, None)  # what was sent is undone by _request
                raise
            except BaseException:
                self.waiters.pop(lease_id, None)
                self._forget_later(lease_id)
                raise
            self.last_limit = reply.limit
            self.note_ttls(reply.lease_ms, reply.waiter_ms)
            if reply.fence_ms > 0:
                self.beat_after(reply.fence_ms / 1000)
            if reply.status == GRANTED:
                self.waiters.pop(lease_id, None)
                return self._granted(lease_id, reply.token, reply.expires_at, ask)
            if reply.status != PARKED:
                self.waiters.pop(lease_id, None)
                raise self._refusal(reply, ask)
            waiter.member = waiter_member(ask.priority, ask.tenant, reply.token, lease_id)
            lease = await self._park(waiter)
            if lease is not None:
                return lease

    def _refusal(self, reply: AcquireReply, ask: _Ask) -> FleetgateError:
        """The error for an acquire the gate refused (counted in the metrics)."""
        if reply.status == TOO_HEAVY:
            return ConfigError(
                f"gate {self.name!r}: weight: {ask.weight} is above the gate's ceiling "
                f"({reply.max_queued}); it could never be granted"
            )
        self.series.of(ask).rejected.inc()
        if reply.status == REJECTED_TENANT:
            return Overloaded(
                self.name,
                reply.max_queued,
                reason=f"tenant {ask.tenant!r} has max_queued_per_tenant={reply.max_queued} "
                "calls waiting",
            )
        if reply.status == SHED:
            return Overloaded(
                self.name,
                reply.max_queued,
                reason=f"priority {ask.priority} is below shed_below={reply.max_queued} and "
                "the call could not start at once (a sheddable band never waits)",
            )
        assert reply.status == REJECTED, reply.status
        return Overloaded(self.name, reply.max_queued)

    async def _request(self, lease_id: str, wait_ms: int, cls: str = "") -> AcquireReply:
        """One acquire, sent with this process's batch of the gate; its answer.

        Cancel-safe: a request cancelled before it left is never sent, one cancelled after is
        undone by the batcher once answered (:meth:`_acquire_orphaned`), and an answer that
        arrived just before the cancellation reached this task is undone here.
        """
        call: _Call = (lease_id, wait_ms, cls)
        answer = self._calls.submit(call)
        try:
            reply = await answer
        except asyncio.CancelledError:
            if answer.done() and not answer.cancelled():
                self._acquire_orphaned(call, answer.exception() or answer.result())
            raise
        assert reply is not None
        return reply

    async def _send_calls(self, calls: Sequence[_Call]) -> list[AcquireReply | None]:
        """One batch of the gate's calls: its releases, then its acquires, in one script call
        (release.lua alone when there is nothing to acquire)."""
        releases = [lease_id for lease_id, wait_ms, _ in calls if wait_ms is None]
        observed = tally(report for _, wait_ms, report in calls if wait_ms is None)
        requests = [
            (lease_id, wait_ms, cls) for lease_id, wait_ms, cls in calls if wait_ms is not None
        ]
        scripts = self.runtime.scripts
        if not requests:
            await scripts.release_many(self.keys, releases, observed)
            return [None] * len(calls)
        replies = iter(
            await scripts.acquire_many(
                self.keys,
                requests,
                self.defaults,
                releases=releases,
                observed=observed,
                fence_ms=self.runtime.fence_ms,
            )
        )
        return [None if wait_ms is None else next(replies) for _, wait_ms, _ in calls]

    def _acquire_orphaned(self, call: _Call, outcome: AcquireReply | BaseException | None) -> None:
        """The caller of an acquire gave up after it was sent: undo what it did."""
        lease_id, wait_ms, cls = call
        if wait_ms is None or outcome is None:
            return  # a release: nobody awaits it (_released handles its outcome)
        if isinstance(outcome, BaseException):
            # Outcome unknown: cancel once Redis answers. That releases a grant; an entry that
            # parked (under a seq this process never learnt) expires within waiter_ms, and a
            # hand-off to it before then reaches this process's wake list, which gives it back
            # (on_granted: nobody waits for it).
            self._forget_later(lease_id)
        elif outcome.status == GRANTED:
            self.runtime.spawn(self._cancel(lease_id))  # give it back
        elif outcome.status == PARKED:
            member = class_member(cls, outcome.token, lease_id)
            self.runtime.spawn(self._cancel(lease_id, member))  # leave the wait list

    async def _park(self, waiter: _Waiter) -> Lease | None:
        """Wait for the hand-off. Returns the lease, or None to try again (requeue/fallback)."""
        waiter.parked = True
        depth = self.series.queue_depth
        depth.inc()
        # Looked up on every wake (not bound now), so a hook on on_granted sees every grant.
        self.wakes.ensure(self.name, self._wake_key, self._woken, self._rearm_key)
        try:
            token = await waiter.future
        except _Requeue:
            self.waiters.pop(waiter.id, None)
            return None
        except _GoLocal:
            # Leave the fleet queue if Redis still answers; else the entry expires by TTL.
            self.waiters.pop(waiter.id, None)
            self.runtime.spawn(self._cancel(waiter.id, waiter.member))
            return None
        except BaseException:
            # Cancelled or deadline while parked: leave the queue; a grant that raced in is
            # released by the same script. The caller waits for that a moment (a round trip, so
            # it usually returns gone from the queue), never longer: awaited to the end, a
            # Redis that stopped answering held it past its total deadline (socket timeout,
            # pool wait: up to 10 s). The cancel runs on, retried until Redis answers.
            self.waiters.pop(waiter.id, None)
            cancel = self.runtime.spawn(self._cancel(waiter.id, waiter.member))
            await asyncio.wait({cancel}, timeout=CANCEL_WAIT_S)
            raise
        finally:
            depth.dec()
        self.waiters.pop(waiter.id, None)
        self.series.of(waiter.ask).wait_seconds.observe(time.monotonic() - waiter.parked_at)
        return self._granted(waiter.id, token, waiter.expires_at, waiter.ask)

    def _granted(
        self, lease_id: str, token: int, expires_at: int = 0, ask: _Ask = _DEFAULT_ASK
    ) -> Lease:
        lease = Lease(
            self,
            lease_id,
            token,
            expires_at=expires_at,
            weight=ask.weight,
            priority=ask.priority,
            tenant=ask.tenant,
        )
        self.leases[lease_id] = lease
        lease._series = self.series.of(ask)
        lease._series.hold(ask.weight)
        return lease

    async def _cancel(self, waiter_id: str, member: str = "") -> None:
        """Leave the wait list (``member``: the entry it parked as) or give the lease back."""
        try:
            await self.runtime.scripts.cancel(self.keys, waiter_id, member)
        except OUTAGE_ERRORS as exc:
            # Retried until Redis answers (see _release): a parked entry left behind is handed
            # a slot that nobody uses until its TTL.
            log.debug(
                "gate %s: cancel of %s failed (%s); retrying", self.name, waiter_id, error_text(exc)
            )
            self._forget_later(waiter_id, member)

    def _forget_later(self, lease_id: str, member: str = "") -> None:
        """An acquire whose outcome is unknown (connection lost mid-call), or a release or
        cancel that failed: cancel the id once Redis answers (retried at least every second, so
        a slot is freed within about a second of recovery); if that never happens, the entry
        expires by TTL."""

        async def forget() -> None:
            try:
                async for attempt in AsyncRetrying(
                    retry=retry_if_exception_type(OUTAGE_ERRORS),
                    wait=wait_exponential(multiplier=0.1, max=1.0),
                    stop=stop_after_delay(self.defaults.lease_ms / 1000),
                    reraise=True,
                ):
                    with attempt:
                        await self.runtime.scripts.cancel(self.keys, lease_id, member)
            except OUTAGE_ERRORS:
                pass  # never answered: the entry expires by TTL
            except Exception as exc:  # e.g. WRONGTYPE: logged, never an unretrieved task error
                log.warning(
                    "gate %s: could not cancel %s: %s", self.name, lease_id, error_text(exc)
                )

        self.runtime.spawn(forget())

    # -- releasing ---------------------------------------------------------------------------

    def _release_local(self, lease: Lease) -> None:
        if self.local_leases.pop(lease.id, None) is not None:
            lease.series().drop(lease.weight)
            self._local.release(lease.weight)

    def _release_fleet(self, lease: Lease) -> None:
        if self.leases.pop(lease.id, None) is not None:
            lease.series().drop(lease.weight)
        if self.runtime.fallback_active:
            self.runtime.spawn(self.wake_local())
        answer = self._calls.submit((lease.id, None, lease._report))  # report: see _report.py
        answer.add_done_callback(functools.partial(self._released, lease.id))

    def _released(self, lease_id: str, answer: asyncio.Future[AcquireReply | None]) -> None:
        """The outcome of a release nobody awaits."""
        exc = RuntimeError("release not sent") if answer.cancelled() else answer.exception()
        if exc is None:
            return
        if isinstance(exc, OUTAGE_ERRORS) or answer.cancelled():
            # Retried (as a cancel, which releases a held id) until Redis answers, else it
            # expires by TTL. Without the retry, permits released while Redis was unreachable
            # but not lost (a cut link, a slot migration, a failover) kept their slots after
            # recovery until their lease TTL: the gate stood still with every slot held by
            # nobody (tests/chaos/test_cluster_faults.py::test_slot_migration_under_load).
            log.debug(
                "gate %s: release of %s failed (%s); retrying", self.name, lease_id, error_text(exc)
            )
            self._forget_later(lease_id)
        else:
            self.runtime.background_error("release", exc, self.name)

    def shut_down(self, reason: FleetgateError) -> None:
        """The fleet closes: parked callers fail with ``reason``, held leases are released in
        the background (the fleet waits for them)."""
        self.fail_waiters(reason)
        for lease in list(self.leases.values()):
            self.runtime.spawn(lease.release())

    # -- hand-offs (from the wake listener and the heartbeat) ----------------------------------

    def _woken(self, value: str) -> None:
        """A wake: '<id>=<token>' (granted), '<id>=x' (evicted by a higher band) or
        '<id>=c<ceiling>' (heavier than the ceiling now in force)."""
        lease_id, _, token = value.rpartition("=")
        if token == _EVICTED:
            self.on_evicted(lease_id)
        elif token.startswith(_REFUSED) and token[1:].isdigit():
            self.on_too_heavy(lease_id, int(token[1:]))
        elif lease_id and token.isdigit():
            self.on_granted(lease_id, int(token))

    def on_evicted(self, lease_id: str) -> None:
        """A higher band's arrival took ``lease_id``'s place in the full wait list."""
        waiter = self.waiters.get(lease_id)
        if waiter is not None and not waiter.future.done():
            self.series.of(waiter.ask).rejected.inc()
            waiter.future.set_exception(
                Overloaded(
                    self.name,
                    0,
                    reason=f"the wait list is full and a call of a higher priority than "
                    f"{waiter.ask.priority} took this call's place in it",
                )
            )

    def on_too_heavy(self, lease_id: str, ceiling: int) -> None:
        """The gate's ceiling was lowered below ``lease_id``'s weight while it waited: it can
        never be granted (the error an arrival that heavy gets)."""
        waiter = self.waiters.get(lease_id)
        if waiter is not None and not waiter.future.done():
            waiter.future.set_exception(
                ConfigError(
                    f"gate {self.name!r}: weight: {waiter.ask.weight} is above the gate's "
                    f"ceiling ({ceiling}); it could never be granted (the ceiling was lowered "
                    "while the call waited)"
                )
            )

    def on_granted(self, lease_id: str, token: int) -> None:
        """A hand-off for ``lease_id`` with fencing ``token`` arrived (wake list or
        heartbeat)."""
        waiter = self.waiters.get(lease_id)
        if waiter is not None:
            if not waiter.future.done():
                waiter.future.set_result(token)
            return
        if lease_id not in self.leases:
            # Nobody waits for it any more (cancelled meanwhile): give it back.
            self.runtime.spawn(self._cancel(lease_id))

    # -- driven by the heartbeat ---------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Whether this process holds leases or waiters of the gate (they need renewing)."""
        return bool(self.leases or self.waiters)

    @property
    def renewal_period(self) -> float:
        """Seconds between two heartbeats of the gate: with leases or waiters, at most a third
        of the TTLs in force; idle, the live-pod registration period."""
        if self.busy:
            return min(self.runtime.heartbeat_interval, self.ttl_ms / 3000)
        return self.runtime.register_period

    def renewal(self) -> Renewal:
        """What the next heartbeat of this gate renews."""
        held = list(self.leases.values())
        return Renewal(
            leases=[(lease.id, lease.expires_at) for lease in held],
            waiters=[
                (w.member, w.remaining_ms())
                for w in self.waiters.values()
                if w.parked and not w.future.done()
            ],
            max_token=max((lease.token for lease in held), default=0),
        )

    def beat_after(self, seconds: float) -> None:
        """Beat this gate ``seconds`` from now, even if it is not due: the gate's recovery
        fence ends then, and the heartbeat's script hands the free units to the waiters that
        parked behind it (else they would wait up to a renewal period longer)."""
        # a few ms after the fence's end in server time: a beat that came early hands nothing
        when = asyncio.get_running_loop().time() + seconds + 0.005
        if when < self.beat_by:
            if self.beat_by == math.inf:  # once per fence, not per caller
                log.info(
                    "gate %s: found without state in Redis (new, or Redis restarted or flushed);"
                    " no grant for %.2f s while pods count their running work again",
                    self.name,
                    seconds,
                )
            self.beat_by = when
            self.runtime.renew_by(when)

    def note_ttls(self, lease_ms: int, waiter_ms: int) -> None:
        """The TTLs in force in Redis; a shorter one re-paces the heartbeat at once."""
        ttl = min(lease_ms, waiter_ms)
        if ttl != self.ttl_ms:
            self.ttl_ms = ttl
            self.runtime.poke_heartbeat()

    def on_heartbeat(self, reply: HeartbeatReply, sent: Renewal, sent_at: float) -> None:
        """Apply the reply to the heartbeat that carried ``sent``, sent at ``sent_at`` (loop
        time)."""
        self.last_limit = reply.limit
        self.note_ttls(reply.lease_ms, reply.waiter_ms)
        self._count_live_pods(reply, sent_at)
        lost = set(reply.lost_leases)
        for lease_id, _ in sent.leases:
            lease = self.leases.get(lease_id)
            if lease is not None and lease_id not in lost:
                lease.expires_at = reply.expires_at
        for lease_id in reply.lost_leases:
            lease = self.leases.pop(lease_id, None)
            if lease is not None:
                log.warning("gate %s: lease %s lost (not renewed in time)", self.name, lease_id)
                self.series.lease_lost.inc()
                lease.series().drop(lease.weight)
                lease._mark_lost()
        self._readopted(reply.adopted)
        for lease_id, token in zip(reply.granted_waiters, reply.granted_tokens, strict=True):
            waiter = self.waiters.get(lease_id)
            if waiter is not None:
                waiter.expires_at = max(waiter.expires_at, reply.expires_at)
            self.on_granted(lease_id, token)
        for lease_id in reply.evicted:
            self.on_evicted(lease_id)
        for lease_id in reply.too_heavy:
            self.on_too_heavy(lease_id, reply.ceiling)
        for lease_id in reply.lost_waiters:
            waiter = self.waiters.get(lease_id)
            if waiter is not None and not waiter.future.done():
                log.warning("gate %s: parked entry %s expired; parking again", self.name, lease_id)
                waiter.future.set_exception(_Requeue())
                waiter.future.exception()  # seen, even if its acquire call is still in flight

    def _count_live_pods(self, reply: HeartbeatReply, sent_at: float) -> None:
        # The live-pod count is trusted only from a heartbeat sent a full registration period
        # after this pod's entry was created: by then every live pod of the gate that started
        # about when this one did has registered too. Until then the fair share is 1, never
        # the whole limit (4 pods x limit 4 ran 16 at once before; tests/test_fault_holes.py).
        if reply.pod_new:
            if self.registered_at is not None:
                self.in_registry = False  # created anew: a wiped Redis? register the gate again
            self.registered_at = sent_at
            self.last_live_pods = 0
        elif (
            self.registered_at is not None
            and sent_at - self.registered_at >= self.runtime.register_period
        ):
            self.last_live_pods = reply.live_pods

    def _readopted(self, adopted: list[str]) -> None:
        """Leases of this pod that the heartbeat found missing and counted again."""
        running = [lid for lid in adopted if lid in self.leases]
        if running:
            log.warning(
                "gate %s: Redis had lost %d running leases of this pod before they could expire "
                "(a restart or failover?); they count against the limit again",
                self.name,
                len(running),
            )
        for lease_id in adopted:
            if lease_id not in self.leases:
                # Released while this heartbeat was in flight (its release ran first and the
                # heartbeat counted it again): give it back again.
                self.runtime.spawn(self._cancel(lease_id))

    def fail_waiters(self, exc: BaseException) -> None:
        """Parked callers fail with ``exc`` (the fleet closes, or Redis is gone in "fail"
        mode)."""
        self._end_parking(exc)

    # -- driven by the fallback ----------------------------------------------------------------

    def send_waiters_local(self) -> None:
        """Redis is gone: parked callers continue under the local fair-share bound."""
        self._end_parking(None)

    def _end_parking(self, exc: BaseException | None) -> None:
        for waiter in list(self.waiters.values()):
            if not waiter.future.done():
                waiter.future.set_exception(exc if exc is not None else _GoLocal())
                # A caller whose acquire call is still in flight never awaits this future
                # (its own call fails too): mark the exception as seen.
                waiter.future.exception()

    def fair_share(self) -> int:
        """Local bound in units while Redis is unreachable: ceil(last limit / live pods), with
        the live pods as last counted by a heartbeat this pod trusts; 1 while it has no such
        count (a pod that started, or fell back, before it could count its peers). Local
        permits and the fleet leases still running share it, each by its weight."""
        if self.last_live_pods <= 0:
            return 1
        return max(1, math.ceil(self.last_limit / self.last_live_pods))

    def _fleet_units(self) -> int:
        """Units of the fleet leases this pod still holds (they count against the local bound)."""
        return sum(lease.weight for lease in self.leases.values())

    async def _acquire_local(
        self, weight: int = 1, priority: int = 0, tenant: str | None = None
    ) -> Lease | None:
        """``weight`` units under the local bound, by ``priority``; None if fleet mode came
        back meanwhile. A weight above :meth:`fair_share` raises :class:`Overloaded` at once.

        No new permit starts while Redis is back and running work is being adopted
        (``recovering``): it would be uncounted when another pod resumes fleet mode.
        """
        rt = self.runtime
        try:
            if not await self._local.acquire(weight, priority):
                return None
        except Overloaded:
            self.series.for_ask(priority, tenant).rejected.inc()
            raise
        # No await from the grant to here: a cancelled caller holds nothing.
        # adopted with its weight when Redis is back
        lease_id = weighted_id(rt.next_id(), weight)
        lease = Lease(
            self, lease_id, 0, local=True, weight=weight, priority=priority, tenant=tenant
        )
        self.local_leases[lease.id] = lease
        # Local grants are not counted in granted_total (they never were): in flight only.
        cls = lease._series = self.series.for_ask(priority, tenant)
        cls.in_flight.inc()
        cls.in_flight_units.inc(weight)
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
        scripts = self.runtime.scripts
        _, expires_at = await scripts.adopt(self.keys, ids, max_token, self.runtime.fence_ms)
        for lease in (*held, *local):
            lease.expires_at = expires_at
        for lease in local:
            if self.local_leases.pop(lease.id, None) is None:
                # Released while the adoption was in flight: give the fresh lease back.
                self.runtime.spawn(scripts.release(self.keys, lease.id))
                continue
            lease.local = False
            self.leases[lease.id] = lease
            self._local.release(lease.weight)  # counted as a fleet lease from now on

    async def wake_local(self) -> None:
        """Let callers waiting for a local permit look again (the mode or the bound changed)."""
        self._local.notify()

    def __repr__(self) -> str:
        return f"Gate({self.name!r}, limit≈{self.last_limit})"
