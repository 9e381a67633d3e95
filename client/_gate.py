"""One gate as seen from one process: the public API, and the hooks its drivers call.

A :class:`Gate` is given what it needs from its process -- a :class:`~._runtime.Runtime`
(scripts, ids, metrics, background tasks, fleet or fallback mode) and the process's
:class:`~._wakes.WakeListeners` -- and knows nothing of the :class:`~._fleet.Fleet`, the
heartbeat or the fallback that drive it. Those call in through the methods under "driven by the
heartbeat" and "driven by the fallback" below.

A gate is built in three layers, each in a module of its own: :class:`~._gate_state.GateState`
(what the process holds of the gate and last saw in Redis), :class:`~._acquire.GateAcquirer`
(the fleet acquire machinery: request, park, cancel, hand-offs, releases) and :class:`Gate`
(this facade: permits, ``map``, the local permits of the fallback, the heartbeat's reply).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Sequence
from typing import Any, TypeVar

import msgspec

from fleetgate.ask import DEFAULT_ASK, DEFAULT_DEADLINE, Ask
from fleetgate.errors import ConfigError, FleetgateError, Overloaded
from fleetgate.scripts import HeartbeatReply, Snapshot
from fleetgate.settings import settings_differing

from ._acquire import GateAcquirer, Requeue
from ._deadline import Deadline
from ._gate_state import Renewal
from ._lease import Lease
from ._map import Fn, RetryPolicy, batched, merge_indexed, run_map
from ._metrics import ClientMetrics

T = TypeVar("T")

__all__ = ["Gate", "Lease", "Renewal"]

log = logging.getLogger("fleetgate.client")


def _ask_of(
    ask: Ask | None,
    deadline: float | None,
    weight: int,
    priority: int,
    tenant: str | None,
    tokens: int = 0,
) -> Ask:
    """The :class:`Ask` of a call: ``ask`` as given, or one made of the keyword arguments.
    Both at once is a :class:`ConfigError` (which would win is not obvious); a keyword left at
    its default counts as not given."""
    if ask is None:
        return Ask.of(
            weight=weight, priority=priority, tenant=tenant, deadline=deadline, tokens=tokens
        )
    if not isinstance(ask, Ask):
        raise ConfigError(f"ask: expected a fleetgate.ask.Ask, got {type(ask).__name__}")
    if (weight, priority, tenant, deadline, tokens) != (1, 0, None, DEFAULT_DEADLINE, 0):
        raise ConfigError(
            "ask: given with deadline, weight, priority, tenant or tokens; give one or the other"
        )
    return ask


class Gate(GateAcquirer):
    """A named fleet-wide limit. Obtain one with :meth:`Fleet.gate`."""

    # -- public API --------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def permit(
        self,
        deadline: float | None = DEFAULT_DEADLINE,
        *,
        weight: int = 1,
        priority: int = 0,
        tenant: str | None = None,
        tokens: int = 0,
        ask: Ask | None = None,
    ) -> AsyncIterator[Lease]:
        """Hold one permit for the block: ``async with gate.permit(deadline=30.0) as lease:``.

        ``weight`` (units, int >= 1) counts against the gate's limit; ``priority`` (int in
        [-100, 100], higher first) picks the band: a band is served only when nobody waits in a
        higher one, and a band below the gate's ``shed_below`` never parks (:class:`Overloaded`
        when it cannot start at once); ``tenant`` (a name, or None) shares its band fairly with
        the other tenants waiting in it. See README "Priorities, tenants and weights".
        ``tokens`` (int >= 0) counts against the gate's token budget, if it has one: what the
        call holds at its peak (prompt + output); :meth:`Lease.resize` changes it while the
        block runs. See README "Token budgets".
        ``ask``: a ready :class:`~fleetgate.ask.Ask` instead of those five arguments.

        ``deadline`` (seconds, or None) is total: it covers the queue wait and the block itself.
        When it fires while parked the caller leaves the wait list (no permit consumed); when it
        fires inside the block, the block is cancelled and the lease released. Either way
        :class:`DeadlineExceeded` is raised. A full wait list raises :class:`Overloaded` at once.
        If the lease was lost while the block ran (``lease.is_lost``), leaving the block raises
        :class:`LeaseLost`, and if it was revoked (``lease.is_revoked``) :class:`LeaseRevoked`,
        unless the block raised an exception of its own.
        """
        asked = _ask_of(ask, deadline, weight, priority, tenant, tokens)
        async with self._total_deadline(asked.deadline, "permit") as dl:
            lease = await self._acquire(dl, asked)
            try:
                yield lease
            finally:
                await lease.release()
            if lease.is_lost:
                raise lease.lost_error()
            if lease.is_revoked:
                raise lease.revoked_error()

    async def acquire(
        self,
        deadline: float | None = DEFAULT_DEADLINE,
        *,
        weight: int = 1,
        priority: int = 0,
        tenant: str | None = None,
        tokens: int = 0,
        ask: Ask | None = None,
    ) -> Lease:
        """Acquire a permit and return its lease; the caller must ``await lease.release()``.

        ``deadline`` bounds the wait only; ``weight``, ``priority``, ``tenant``, ``tokens`` and
        ``ask`` as for :meth:`permit`. Prefer :meth:`permit`, which releases for you.
        """
        asked = _ask_of(ask, deadline, weight, priority, tenant, tokens)
        async with self._total_deadline(asked.deadline, "queue wait") as dl:
            return await self._acquire(dl, asked)

    async def map(
        self,
        fn: Fn[T],
        items: Iterable[T] | AsyncIterable[T],
        *,
        max_in_flight: int | None = 8,
        deadline: float | None = DEFAULT_DEADLINE,
        retry: RetryPolicy = None,
        return_exceptions: bool = False,
        call_timeout: float | None = None,
        weight: int | Callable[[Any], int] = 1,
        priority: int = 0,
        tenant: str | None = None,
        tokens: int | Callable[[Any], int] = 0,
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
          ``tokens`` (likewise, of the token budget), ``priority`` and ``tenant``: as for
          :meth:`permit`.

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
            tokens=tokens,
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

    async def acquire_for(self, dl: Deadline, ask: Ask = DEFAULT_ASK) -> Lease:
        """Acquire ``ask`` under an enclosing deadline ``dl``, which applies instead of the
        ask's own (used by :meth:`map`)."""
        return await self._acquire(dl, ask)

    @property
    def metrics(self) -> ClientMetrics:
        """The client metrics of the gate's fleet."""
        return self.runtime.metrics

    async def capacity(self) -> int:
        """The gate's current fleet-wide limit (live target, else floor)."""
        return (await self.snapshot()).limit

    async def snapshot(self) -> Snapshot:
        """A consistent view of the gate in Redis (holders, waiters, limit, config, stats),
        after this process's own releases so far (:meth:`flush`); ``differing`` names the
        settings this process gave that Redis holds otherwise (the stored ones apply). Redis
        unreachable: :class:`~fleetgate.errors.RedisUnavailable` (in either mode)."""
        await self.flush()
        snap = await self.runtime.snapshot(self.keys, defaults=self.defaults)
        differing = settings_differing(self.defaults, self.given, snap.cfg, snap.tenant_weights)
        return msgspec.structs.replace(snap, differing=differing)

    def _total_deadline(self, seconds: float | None, where: str) -> Deadline:
        """A total deadline for this gate, counted in the deadline-exceeded metric."""
        counter = self.series.deadline_exceeded
        return Deadline(self.name, seconds, where=where, on_expire=counter.inc)

    async def _acquire(self, dl: Deadline, ask: Ask = DEFAULT_ASK) -> Lease:
        """A lease for ``ask``: from the fleet, or under the local bound while Redis is
        unreachable; tried again until one of them grants or refuses."""
        while True:
            if self.runtime.fallback_active:
                lease = await self._acquire_local(ask)
            else:
                lease = await self._acquire_fleet(dl, ask)
            if lease is not None:
                return lease

    def shut_down(self, reason: FleetgateError) -> None:
        """The fleet closes: parked callers fail with ``reason``, held leases are released in
        the background (the fleet waits for them)."""
        self.fail_waiters(reason)
        for lease in list(self.leases.values()):
            self.runtime.spawn(lease.release())

    # -- driven by the heartbeat ---------------------------------------------------------------

    def on_heartbeat(self, reply: HeartbeatReply, sent: Renewal, sent_at: float) -> None:
        """Apply the reply to the heartbeat that carried ``sent``, sent at ``sent_at`` (loop
        time)."""
        self.last_limit = reply.limit
        self.last_token_limit = reply.token_limit
        self.note_ttls(reply.lease_ms, reply.waiter_ms)
        self._count_live_pods(reply, sent_at)
        self._renewed(reply, sent)
        self._readopted(reply.adopted)
        for lease_id, token in zip(reply.granted_waiters, reply.granted_tokens, strict=True):
            waiter = self.waiters.get(lease_id)
            if waiter is not None:
                waiter.expires_at = max(waiter.expires_at, reply.expires_at)
            self.on_granted(lease_id, token)
        for lease_id in reply.evicted:
            self.on_evicted(lease_id)
        holds = reply.too_late_hold_ms or [-1] * len(reply.too_late)
        for lease_id, expected_ms, hold_ms in zip(
            reply.too_late, reply.too_late_ms, holds, strict=True
        ):
            self.on_too_late(lease_id, expected_ms, hold_ms)
        for lease_id in reply.too_heavy:
            self.on_too_heavy(lease_id, reply.ceiling)
        for lease_id in reply.revoked:
            lease = self.leases.get(lease_id)
            if lease is not None and lease._mark_revoked():
                self.series.of(lease).revoked.inc()
                log.info("gate %s: lease %s revoked: give it back", self.name, lease_id)
        for lease_id in reply.lost_waiters:
            waiter = self.waiters.get(lease_id)
            if waiter is not None and not waiter.future.done():
                log.warning("gate %s: parked entry %s expired; parking again", self.name, lease_id)
                waiter.future.set_exception(Requeue())
                waiter.future.exception()  # seen, even if its acquire call is still in flight

    def _renewed(self, reply: HeartbeatReply, sent: Renewal) -> None:
        """The leases ``sent`` renewed get the new expiry; those Redis lost are lost."""
        lost = set(reply.lost_leases)
        for lease_id, _ in sent.leases:
            lease = self.leases.get(lease_id)
            if lease is not None and lease_id not in lost:
                lease.expires_at = reply.expires_at
        self._lose(reply.lost_leases, "not renewed in time")

    def _lose(self, lease_ids: Iterable[str], why: str) -> None:
        """Redis no longer counts these leases (of this gate): their holders are told."""
        for lease_id in lease_ids:
            lease = self.leases.pop(lease_id, None)
            if lease is not None:
                log.warning("gate %s: lease %s lost (%s)", self.name, lease_id, why)
                self.series.lease_lost.inc()
                lease.series().drop(lease.weight)
                lease._mark_lost()

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

    async def _acquire_local(self, ask: Ask = DEFAULT_ASK) -> Lease | None:
        """``ask.weight`` units (and ``ask.tokens``) under the local bound, by
        ``ask.priority``; None if fleet mode came back meanwhile. A weight above
        :meth:`fair_share` (or tokens above :meth:`token_share`) raises :class:`Overloaded` at
        once.

        No new permit starts while Redis is back and running work is being adopted
        (``recovering``): it would be uncounted when another pod resumes fleet mode.
        """
        try:
            if not await self._local.acquire(ask.weight, ask.priority, ask.tokens):
                return None
        except Overloaded:
            self.series.of(ask).rejected.inc()
            raise
        # No await from the grant to here: a cancelled caller holds nothing.
        # adopted with its weight when Redis is back
        lease = Lease(self, ask.lease_id(self.runtime.next_id()), 0, ask, local=True)
        self.local_leases[lease.id] = lease
        # Local grants are not counted in granted_total (they never were): in flight only.
        series = lease._series = self.series.of(ask)
        series.in_flight.inc()
        series.in_flight_units.inc(ask.weight)
        return lease

    async def adopt_running(self) -> None:
        """Redis is back: count every permit this pod still runs as a fleet lease again.

        Local permits become fleet leases (renewed by the heartbeat, released by the release
        script); fleet leases Redis still holds are kept (and renewed), those it lost in a
        restart before they could expire are re-added. A fleet lease that expired and was
        reaped meanwhile (this pod cut off past its TTL: its units may have gone to another
        pod) lapsed: it is not counted again and its holder is told (``lease.lost``), as the
        heartbeat tells a frozen holder. Raises the Redis error if Redis fails again (the fleet
        stays in fallback and retries).

        A permit released while the adoption is in flight may have been counted again by it
        (adopt.lua adds every id it is given that Redis does not hold: a local one always, a
        fleet one whose release reached Redis first). Each is given back after the reply, with
        the retries of any failed release (:meth:`_cancel`): left in Redis, it would hold its
        units for nobody until its lease TTL (after a slot migration on Cluster, the gate short
        of its limit for ``lease_ms``).
        """
        local = list(self.local_leases.values())
        held = [(lease.id, lease) for lease in self.leases.values()]  # a resize changes the id
        if not held and not local:
            return
        max_token = max((lease.fencing_token for _, lease in held), default=0)
        reply = await self.runtime.scripts.adopt(
            self.keys,
            [lease.id for lease in local],
            [(lease_id, lease.expires_at) for lease_id, lease in held],
            max_token,
            self.runtime.fence_ms,
        )
        lapsed = set(reply.lapsed)
        for lease_id, lease in held:
            if lease_id not in lapsed:
                lease.expires_at = reply.expires_at
        for lease in local:
            lease.expires_at = reply.expires_at
        self._lose(reply.lapsed, "its renewal time passed while Redis was unreachable")
        for lease_id, lease in held:
            if lease_id not in lapsed and self.leases.get(lease_id) is not lease:
                # Released (or resized to a new id) while the adoption was in flight: if that
                # reached Redis first, the adoption added the id back. A no-op otherwise.
                self.runtime.spawn(self._cancel(lease_id))
        for lease in local:
            if self.local_leases.pop(lease.id, None) is None:
                # Released while the adoption was in flight: give the fresh lease back.
                self.runtime.spawn(self._cancel(lease.id))
                continue
            lease.local = False
            self.leases[lease.id] = lease
            self._local.release(lease.weight, lease.tokens)  # a fleet lease from now on

    def __repr__(self) -> str:
        return f"Gate({self.name!r}, limit≈{self.last_limit})"
