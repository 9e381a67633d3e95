"""The fleet acquire machinery of one gate: request, park, cancel, hand-offs and releases.

:class:`GateAcquirer` adds to :class:`~._gate_state.GateState` what turns an
:class:`~fleetgate.ask.Ask` into a fleet lease: the request in the gate's batch (``_calls.py``,
group commit), parking until the wake list or the heartbeat hands the caller a slot, leaving
the wait list when the caller gives up, undoing what a request nobody waits for any more did,
and the releases of fleet leases. Every step is cancel-safe: a caller cancelled at any point
leaves nothing behind in Redis (at worst an entry that expires by its TTL).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time

from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential

from fleetgate._redis import error_text
from fleetgate.ask import DEFAULT_ASK, Ask
from fleetgate.errors import ConfigError, DeadlineUnreachable, FleetgateError, Overloaded
from fleetgate.protocol import GRANTED_WAKE, Wake, decode_wake
from fleetgate.scripts import (
    GRANTED,
    MAX_BATCH,
    OVER_SHARE,
    PARKED,
    REJECTED,
    REJECTED_TENANT,
    RESIZE_LOST,
    RESIZE_TOO_MANY,
    RESIZED,
    SHED,
    TOO_HEAVY,
    TOO_LATE,
    TOO_MANY_TOKENS,
    AcquireReply,
)
from fleetgate.settings import GateSettings

from ._batch import Batcher
from ._calls import AcquireCall, GateCall, ReleaseCall, send_calls
from ._deadline import Deadline
from ._gate_state import GateState, Waiter
from ._lease import Lease
from ._runtime import OUTAGE_ERRORS, Runtime
from ._wakes import WakeListeners

__all__ = ["CANCEL_WAIT_S", "GateAcquirer", "GoLocal", "Requeue"]

log = logging.getLogger("fleetgate.client")

#: how long a parked caller that gives up waits for its cancel's round trip before it returns
CANCEL_WAIT_S = 0.25

class Requeue(Exception):
    """The parked entry vanished from Redis (expired while this process stalled): park again."""


class GoLocal(Exception):
    """Redis became unreachable while parked: continue under the local fair-share bound."""


class GateAcquirer(GateState):
    """A gate's fleet acquires and releases, on top of what the process knows of it."""

    def __init__(
        self,
        name: str,
        defaults: GateSettings,
        runtime: Runtime,
        wakes: WakeListeners,
        given: frozenset[str] = frozenset(),
    ) -> None:
        super().__init__(name, defaults, runtime, wakes, given)
        # This pod's wake and re-arm lists of the gate (named once: every park asks for them).
        self._wake_key = self.keys.wake(runtime.pod_key)
        self._rearm_key = self.keys.rearm(runtime.pod_key)
        # This process's acquires and releases of the gate, each sent as one script call per
        # batch (group commit: see _batch.py).
        self._calls: Batcher[GateCall, AcquireReply | None] = Batcher(
            functools.partial(send_calls, runtime, self.keys, defaults),
            spawn=runtime.spawn,
            max_batch=MAX_BATCH,
            on_orphan=self._acquire_orphaned,
        )

    # -- acquiring ---------------------------------------------------------------------------

    async def _acquire_fleet(self, dl: Deadline, ask: Ask) -> Lease | None:
        """One fleet acquire of ``ask``: the lease, or None to try again (Redis unreachable,
        the parked entry lost, the fallback took over). A refusal raises."""
        rt = self.runtime
        lease_id = ask.lease_id(rt.next_id())
        loop = asyncio.get_running_loop()
        waiter = Waiter(lease_id, loop.create_future(), dl, ask)
        was_idle = not self.busy
        # Registered before the call: a hand-off can be popped by the wake listener before this
        # coroutine sees the script's reply.
        self.waiters[lease_id] = waiter
        if was_idle:
            # The first lease or waiter: renew it a renewal period from now (the grant is as
            # fresh as a renewal), whatever the heartbeat was sleeping on before.
            self.renewed_at = loop.time()
            rt.renew_by(self.renewed_at + self.renewal_period)
        try:
            wait_ms = waiter.remaining_ms()
            reply = await self._request(lease_id, wait_ms, ask)
        except OUTAGE_ERRORS as exc:
            self.waiters.pop(lease_id, None)
            self._forget_later(lease_id)
            rt.redis_failed(exc)  # raises RedisUnavailable in "fail" mode
            return None
        except asyncio.CancelledError:
            self.waiters.pop(lease_id, None)  # what was sent is undone by _request
            raise
        except BaseException:
            self.waiters.pop(lease_id, None)
            self._forget_later(lease_id)
            raise
        self.last_limit = reply.limit
        self.note_ttls(reply.lease_ms, reply.waiter_ms)
        self.used = True
        if self.settings_unchecked:  # once: the gate is stored now
            self.settings_unchecked = False
            rt.spawn(self.check_settings())
        if reply.fence_ms > 0:
            self.beat_after(reply.fence_ms / 1000)
            rt.fenced(self.name, reply.fence_ms)
        if reply.status == GRANTED:
            self.waiters.pop(lease_id, None)
            return self._granted(lease_id, reply.fencing_token, reply.expires_at, ask)
        if reply.status != PARKED:
            self.waiters.pop(lease_id, None)
            raise self._refusal(reply, ask, wait_ms)
        waiter.member = ask.member(reply.seq, lease_id)
        if reply.expected_wait_ms >= 0:
            waiter.expected_wait = reply.expected_wait_ms / 1000
            self.series.of(ask).expected_wait_seconds.observe(waiter.expected_wait)
        return await self._park(waiter)

    def _refusal(self, reply: AcquireReply, ask: Ask, wait_ms: int) -> FleetgateError:
        """The error for an acquire the gate refused (counted in the metrics); ``wait_ms``:
        what it said it could wait."""
        if reply.status == TOO_HEAVY:
            return ConfigError(
                f"gate {self.name!r}: weight: {ask.weight} is above the gate's ceiling "
                f"({reply.bound}); it could never be granted"
            )
        if reply.status == OVER_SHARE:
            return ConfigError(
                f"gate {self.name!r}: weight: {ask.weight} is above the share of the ceiling "
                f"that band_share gives priority {ask.priority} ({reply.bound}); it could "
                "never be granted"
            )
        if reply.status == TOO_MANY_TOKENS:
            return ConfigError(
                f"gate {self.name!r}: tokens: {ask.tokens} is above the gate's token_ceiling "
                f"({reply.bound}); it could never be granted"
            )
        self.series.of(ask).rejected.inc()
        if reply.status == REJECTED_TENANT:
            return Overloaded(
                self.name,
                reply.bound,
                reason=f"tenant {ask.tenant!r} has max_queued_per_tenant={reply.bound} "
                "calls waiting",
            )
        if reply.status == TOO_LATE:
            return self._too_late(reply.expected_wait_ms, wait_ms, reply.expected_hold_ms)
        if reply.status == SHED:
            return Overloaded(
                self.name,
                reply.bound,
                reason=f"priority {ask.priority} is below shed_below={reply.bound} and "
                "the call could not start at once (a sheddable band never waits)",
            )
        assert reply.status == REJECTED, reply.status
        # the gate's estimate of when a place frees for this caller, behind those refused
        # before it (their returns spread over the drain), spread a little more (x1 to x1.5)
        back = reply.retry_after_ms / 1000
        later = back * random.uniform(1.0, 1.5) if back > 0 else None
        return Overloaded(self.name, reply.bound, retry_after=later)

    async def _request(self, lease_id: str, wait_ms: int, ask: Ask = DEFAULT_ASK) -> AcquireReply:
        """One acquire, sent with this process's batch of the gate; its answer.

        Cancel-safe: a request cancelled before it left is never sent, one cancelled after is
        undone by the batcher once answered (:meth:`_acquire_orphaned`), and an answer that
        arrived just before the cancellation reached this task is undone here.
        """
        call = AcquireCall(lease_id, wait_ms, ask)
        answer = self._calls.submit(call)
        try:
            reply = await answer
        except asyncio.CancelledError:
            if answer.done() and not answer.cancelled():
                self._acquire_orphaned(call, answer.exception() or answer.result())
            raise
        assert reply is not None
        return reply

    def _acquire_orphaned(
        self, call: GateCall, outcome: AcquireReply | BaseException | None
    ) -> None:
        """The caller of an acquire gave up after it was sent: undo what it did."""
        if not isinstance(call, AcquireCall) or outcome is None:
            return  # a release: nobody awaits it (_released handles its outcome)
        if isinstance(outcome, BaseException):
            # Outcome unknown: cancel once Redis answers. That releases a grant; an entry that
            # parked (under a seq this process never learnt) expires within waiter_ms, and a
            # hand-off to it before then reaches this process's wake list, which gives it back
            # (on_granted: nobody waits for it).
            self._forget_later(call.lease_id)
        elif outcome.status == GRANTED:
            self.runtime.spawn(self._cancel(call.lease_id))  # give it back
        elif outcome.status == PARKED:
            member = call.ask.member(outcome.seq, call.lease_id)
            self.runtime.spawn(self._cancel(call.lease_id, member))  # leave the wait list

    async def _park(self, waiter: Waiter) -> Lease | None:
        """Wait for the hand-off. Returns the lease, or None to try again (requeue/fallback)."""
        waiter.parked = True
        depth = self.series.queue_depth
        depth.inc()
        # Looked up on every wake (not bound now), so a hook on on_granted sees every grant.
        self.wakes.ensure(self.name, self._wake_key, self._woken, self._rearm_key)
        try:
            token = await waiter.future
        except Requeue:
            self.waiters.pop(waiter.id, None)
            return None
        except GoLocal:
            # Leave the fleet queue if Redis still answers; else the entry expires by TTL.
            self.waiters.pop(waiter.id, None)
            self.runtime.spawn(self._cancel(waiter.id, waiter.member))
            return None
        except BaseException:
            # Cancelled or deadline while parked: leave the queue; a grant that raced in is
            # released by the same script. The caller waits for that a moment (a round trip, so
            # it usually returns gone from the queue), never longer: awaited to the end, a
            # Redis that stopped answering would hold it past its total deadline (socket
            # timeout, pool wait: up to 10 s). The cancel runs on, retried until Redis answers.
            self.waiters.pop(waiter.id, None)
            cancel = self.runtime.spawn(self._cancel(waiter.id, waiter.member))
            await asyncio.wait({cancel}, timeout=CANCEL_WAIT_S)
            raise
        finally:
            depth.dec()
        self.waiters.pop(waiter.id, None)
        self.series.of(waiter.ask).wait_seconds.observe(time.monotonic() - waiter.parked_at)
        lease = self._granted(waiter.id, token, waiter.expires_at, waiter.ask)
        lease.expected_wait = waiter.expected_wait
        return lease

    def _granted(self, lease_id: str, token: int, expires_at: int, ask: Ask) -> Lease:
        lease = Lease(self, lease_id, token, ask, expires_at=expires_at)
        self.leases[lease_id] = lease
        lease._series = self.series.of(ask)
        lease._series.hold(ask.weight)
        return lease

    async def _resize_fleet(self, lease: Lease, tokens: int) -> int:
        """``lease.resize(tokens)`` of a fleet lease: one script call; the lease's id changes
        with its tokens (``lua/resize.lua``)."""
        try:
            reply = await self.runtime.scripts.resize(self.keys, lease.id, tokens)
        except OUTAGE_ERRORS as exc:
            log.warning(
                "gate %s: resize of %s to %d tokens failed (%s); it holds %d",
                self.name,
                lease.id,
                tokens,
                error_text(exc),
                lease.tokens,
            )
            return lease.tokens
        if reply.status == RESIZED:
            if self.leases.pop(lease.id, None) is not None:
                self.leases[reply.id] = lease
            lease._resized(reply.id, reply.tokens)
        elif reply.status == RESIZE_TOO_MANY:
            raise ConfigError(
                f"gate {self.name!r}: tokens: {tokens} is above the gate's token_ceiling "
                f"({reply.tokens}); it could never be granted"
            )
        elif reply.status == RESIZE_LOST:
            raise lease.lost_error()
        return lease.tokens

    async def _cancel(self, waiter_id: str, member: str = "") -> None:
        """Leave the wait list (``member``: the entry it parked as) or give the lease back."""
        try:
            await self.runtime.scripts.cancel(self.keys, waiter_id, member)
        except OUTAGE_ERRORS as exc:
            # Retried until Redis answers (see _released): a parked entry left behind is handed
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

    def _release_fleet(self, lease: Lease) -> None:
        if self.leases.pop(lease.id, None) is not None:
            lease.series().drop(lease.weight)
        if self.runtime.fallback_active:
            self.runtime.spawn(self.wake_local())
        answer = self._calls.submit(ReleaseCall(lease.id, lease._report))  # see _report.py
        answer.add_done_callback(functools.partial(self._released, lease.id))

    def _released(self, lease_id: str, answer: asyncio.Future[AcquireReply | None]) -> None:
        """The outcome of a release nobody awaits."""
        exc = RuntimeError("release not sent") if answer.cancelled() else answer.exception()
        if exc is None:
            return
        if isinstance(exc, OUTAGE_ERRORS) or answer.cancelled():
            # Retried (as a cancel, which releases a held id) until Redis answers, else it
            # expires by TTL. Without the retry, permits released while Redis was unreachable
            # but not lost (a cut link, a slot migration, a failover) would keep their slots
            # after recovery until their lease TTL: the gate would stand still with every slot
            # held by nobody (tests/chaos/test_cluster_faults.py::test_slot_migration_under_load).
            log.debug(
                "gate %s: release of %s failed (%s); retrying", self.name, lease_id, error_text(exc)
            )
            self._forget_later(lease_id)
        else:
            self.runtime.background_error("release", exc, self.name)

    # -- hand-offs (from the wake listener and the heartbeat) ----------------------------------

    def _woken(self, value: str) -> None:
        """A wake (:func:`fleetgate.protocol.decode_wake`): granted, evicted by a higher band,
        or refused by a bound now in force (the ceiling, the token ceiling, its band's share)."""
        news = decode_wake(value)
        if news is None:
            return
        lease_id, kind, n = news
        if kind == GRANTED_WAKE:
            self.on_granted(lease_id, n)
        elif kind == Wake.EVICTED:
            self.on_evicted(lease_id)
        else:
            tokens, share = kind == Wake.TOO_MANY_TOKENS, kind == Wake.OVER_SHARE
            self.on_too_heavy(lease_id, n, tokens=tokens, share=share)

    def _too_late(self, expected_ms: int, wait_ms: int, hold_ms: int) -> DeadlineUnreachable:
        """The error of a call that would start ``expected_ms`` from now and may wait
        ``wait_ms``, its deadline covering ``hold_ms`` of its band's expected hold too (the gate's
        deadline_admission is "finish"; -1: not); counted in the metrics."""
        expected, deadline = expected_ms / 1000, wait_ms / 1000
        hold = hold_ms / 1000 if hold_ms >= 0 else None
        self.series.deadline_unreachable.inc()
        # Back by how much later the queue ahead is expected to have drained enough, spread (x1
        # to x1.5) so that callers refused together do not return together.
        later = max(expected + (hold or 0) - deadline, 0.001) * random.uniform(1.0, 1.5)
        return DeadlineUnreachable(
            self.name, expected, deadline, retry_after=later, expected_hold=hold
        )

    def on_too_late(self, lease_id: str, expected_ms: int, hold_ms: int = -1) -> None:
        """By the drain, parked ``lease_id`` would now start (or, with deadline_admission
        "finish", end) after its deadline: the heartbeat took it out of the wait list
        (deadline-aware admission)."""
        waiter = self.waiters.get(lease_id)
        if waiter is not None and not waiter.future.done():
            self.series.of(waiter.ask).rejected.inc()
            waiter.future.set_exception(self._too_late(expected_ms, waiter.remaining_ms(), hold_ms))

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

    def on_too_heavy(
        self, lease_id: str, ceiling: int | None, *, tokens: bool = False, share: bool = False
    ) -> None:
        """The gate's ceiling (``tokens``: its token ceiling; ``share``: its band's share of the
        ceiling) was lowered below ``lease_id``'s weight (tokens) while it waited: it can never
        be granted (the error an arrival that heavy gets). ``ceiling`` None: which is not known;
        from a heartbeat's report ``ceiling`` is the gate's ceiling in force."""
        waiter = self.waiters.get(lease_id)
        if waiter is not None and not waiter.future.done():
            ask = waiter.ask
            if tokens:
                what = f"tokens: {ask.tokens} is above the gate's token_ceiling ({ceiling})"
            elif share:
                what = (
                    f"weight: {ask.weight} is above the share of the ceiling that band_share "
                    f"gives priority {ask.priority} ({ceiling})"
                )
            elif ceiling is not None and ask.weight <= ceiling and ask.tokens:
                what = f"tokens: {ask.tokens} is above the gate's token_ceiling"
            elif ceiling is not None and ask.weight <= ceiling:
                what = (
                    f"weight: {ask.weight} is above the share of the ceiling that band_share "
                    f"gives priority {ask.priority}"
                )
            else:
                what = f"weight: {ask.weight} is above the gate's ceiling ({ceiling})"
            waiter.future.set_exception(
                ConfigError(
                    f"gate {self.name!r}: {what}; it could never be granted (the ceiling was "
                    "lowered while the call waited)"
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

    def _end_parking(self, exc: BaseException | None) -> None:
        """Every parked caller fails with ``exc``, or (None) goes on under the local bound."""
        for waiter in list(self.waiters.values()):
            if not waiter.future.done():
                waiter.future.set_exception(exc if exc is not None else GoLocal())
                # A caller whose acquire call is still in flight never awaits this future
                # (its own call fails too): mark the exception as seen.
                waiter.future.exception()
