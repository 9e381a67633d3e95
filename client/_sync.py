"""The synchronous face: the same asyncio core, run on a background event-loop thread.

Nothing here re-implements gate logic: every call is submitted to the loop that owns the
:class:`Fleet`. An interrupted caller (KeyboardInterrupt, or an exception raised into the
thread) cancels the submitted coroutine, so a parked acquire leaves the wait list; a grant that
lands as the caller gives up is released (nobody else would ever release it), and a release is
never cancelled.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from fleetgate.ask import DEFAULT_DEADLINE, Ask
from fleetgate.settings import GateSettingsKwargs, check_setting_names

from ._fleet import Fleet
from ._gate import Gate
from ._lease import Lease
from ._utilization import GateUtilization

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack is Python 3.11+

__all__ = ["SyncFleet", "SyncGate"]

T = TypeVar("T")

log = logging.getLogger("fleetgate.client")


class _Job(Generic[T]):
    """One coroutine run on the portal's loop for a caller in another thread or event loop.

    ``future`` is put in the RUNNING state as soon as the coroutine starts, so nobody can cancel
    it from outside (``concurrent.futures.Future.cancel`` fails on a running future): a result
    can never be dropped silently, as ``run_coroutine_threadsafe`` drops one that lands after
    its future was cancelled. The caller gives up with :meth:`abandon` instead; a result that
    arrives anyway (before or after that) is passed to ``undo`` on the loop -- a granted lease
    is released -- and ``cleanup`` completes once the coroutine has ended and any undo has run.
    """

    def __init__(
        self,
        portal: _Portal,
        coro: Coroutine[Any, Any, T],
        undo: Callable[[T], Awaitable[Any]] | None,
    ) -> None:
        self.portal = portal
        self.coro = coro
        self.undo = undo
        self.future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self.cleanup: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.cleanup.set_running_or_notify_cancel()  # set by us only, never cancelled
        self._lock = threading.Lock()
        self._abandoned = False
        self._task: asyncio.Task[T] | None = None
        portal.loop.call_soon_threadsafe(self._start)

    # -- on the loop ---------------------------------------------------------------------------

    def _start(self) -> None:
        with self._lock:
            # False if cancelled from outside before it started (asyncio.wrap_future does that).
            start = not self._abandoned and self.future.set_running_or_notify_cancel()
        if not start:
            self.coro.close()  # never started: nothing to undo
            if not self.future.done():
                self.future.set_exception(concurrent.futures.CancelledError())
            if self._abandoned:
                self.cleanup.set_result(None)
            return
        self._task = self.portal.loop.create_task(self.coro)
        self._task.add_done_callback(self._settle)

    def _settle(self, task: asyncio.Task[T]) -> None:
        with self._lock:
            abandoned = self._abandoned
            if not abandoned:
                if task.cancelled():
                    self.future.set_exception(concurrent.futures.CancelledError())
                elif task.exception() is not None:
                    self.future.set_exception(task.exception())
                else:
                    self.future.set_result(task.result())
        if not abandoned:
            return
        if task.cancelled() or task.exception() is not None:
            self.future.set_exception(concurrent.futures.CancelledError())
            self.cleanup.set_result(None)
        else:
            # The result arrived after the caller gave up: nobody will ever see it.
            self.future.set_exception(concurrent.futures.CancelledError())
            self._undo(task.result())

    def _undo(self, result: T) -> None:
        if self.undo is None:
            self.cleanup.set_result(None)
            return

        async def run(undo: Callable[[T], Awaitable[Any]]) -> None:
            try:
                await undo(result)
            except Exception:
                log.exception("could not undo the result of an abandoned call: %r", result)
            finally:
                self.cleanup.set_result(None)

        self.portal.keep(self.portal.loop.create_task(run(self.undo)))

    def _cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    # -- in the caller's thread ----------------------------------------------------------------

    def abandon(self) -> None:
        """The caller gives up: cancel the coroutine; undo a result it delivers regardless."""
        with self._lock:
            if self._abandoned:
                return
            self._abandoned = True
            delivered = self.future.done() and not self.future.cancelled()
        try:
            if not delivered:
                # _start (if still due) sees the flag; otherwise the task is cancelled and
                # _settle undoes a result that races the cancellation.
                self.portal.loop.call_soon_threadsafe(self._cancel)
            elif self.future.exception() is not None:
                self.cleanup.set_result(None)
            else:
                # Delivered, but the caller was interrupted before it took the result.
                self.portal.loop.call_soon_threadsafe(self._undo, self.future.result())
        except RuntimeError:  # the loop is closed: nothing runs there any more
            if not self.cleanup.done():
                self.cleanup.set_result(None)


class _Portal:
    """An event loop on a daemon thread, and a way to run coroutines on it from other threads."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._keep: set[asyncio.Task[Any]] = set()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="fleetgate-loop", daemon=True
        )
        self._thread.start()

    def keep(self, task: asyncio.Task[Any]) -> None:
        """Hold a reference to a background task of the loop until it ends."""
        self._keep.add(task)
        task.add_done_callback(self._keep.discard)

    def submit(
        self,
        coro: Coroutine[Any, Any, T],
        undo: Callable[[T], Awaitable[Any]] | None = None,
    ) -> _Job[T]:
        return _Job(self, coro, undo)

    def call(
        self,
        coro: Coroutine[Any, Any, T],
        *,
        undo: Callable[[T], Awaitable[Any]] | None = None,
        shielded: bool = False,
    ) -> T:
        """Run ``coro`` on the loop and return its result.

        If the calling thread is interrupted (KeyboardInterrupt, an exception raised into it),
        the coroutine is cancelled -- a parked acquire leaves the wait list -- and a result it
        still produces is passed to ``undo``; with ``shielded`` (a release) it runs on to the
        end instead. Either way the caller waits (at most 2 s) for that cleanup.
        """
        job = self.submit(coro, undo)
        try:
            return job.future.result()
        except BaseException:
            if shielded:
                concurrent.futures.wait([job.future], timeout=2.0)
            else:
                job.abandon()
                concurrent.futures.wait([job.cleanup], timeout=2.0)
            raise

    async def acall(
        self,
        coro: Coroutine[Any, Any, T],
        *,
        undo: Callable[[T], Awaitable[Any]] | None = None,
        shielded: bool = False,
    ) -> T:
        """:meth:`call` for a caller on another event loop: a cancelled caller abandons the
        call (or, ``shielded``, lets it run on) and waits (at most 2 s) for its cleanup before
        the cancellation propagates."""
        job = self.submit(coro, undo)
        if shielded:
            return await asyncio.shield(asyncio.wrap_future(job.future))
        try:
            return await asyncio.wrap_future(job.future)
        except BaseException:
            job.abandon()
            await asyncio.wait([asyncio.wrap_future(job.cleanup)], timeout=2.0)
            raise

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()


class SyncGate:
    """Blocking twin of :class:`Gate`; obtain it with :meth:`SyncFleet.gate`."""

    def __init__(self, portal: _Portal, gate: Gate) -> None:
        #: the fleet's loop thread, where every call of this gate runs
        self.portal = portal
        self.gate = gate
        self.name = gate.name

    @contextlib.contextmanager
    def permit(
        self,
        deadline: float | None = DEFAULT_DEADLINE,
        *,
        weight: int = 1,
        priority: int = 0,
        tenant: str | None = None,
        tokens: int = 0,
        ask: Ask | None = None,
    ) -> Iterator[Lease]:
        """``with gate.permit(deadline=30.0) as lease:`` — blocks until granted.

        The deadline bounds the queue wait; a thread cannot be interrupted mid-call, so the block
        itself runs to completion (use :meth:`map` for a deadline that abandons running calls).
        ``weight``, ``priority``, ``tenant``, ``tokens`` and ``ask`` as for :meth:`Gate.permit`.
        If the lease was lost while the block ran (``lease.is_lost``), leaving the block raises
        :class:`LeaseLost`, and if it was revoked (``lease.is_revoked``) :class:`LeaseRevoked`,
        unless the block raised an exception of its own.
        """
        lease = self.acquire(
            deadline, weight=weight, priority=priority, tenant=tenant, tokens=tokens, ask=ask
        )
        try:
            yield lease
        finally:
            self.release(lease)
        if lease.is_lost:
            raise lease.lost_error()
        if lease.is_revoked:
            raise lease.revoked_error()

    def acquire(
        self,
        deadline: float | None = DEFAULT_DEADLINE,
        *,
        weight: int = 1,
        priority: int = 0,
        tenant: str | None = None,
        tokens: int = 0,
        ask: Ask | None = None,
    ) -> Lease:
        """Acquire a permit (``weight``, ``priority``, ``tenant``, ``tokens``, ``ask`` as for
        :meth:`Gate.permit`); release it with :meth:`release`."""
        acquire = self.gate.acquire(
            deadline, weight=weight, priority=priority, tenant=tenant, tokens=tokens, ask=ask
        )
        return self.portal.call(acquire, undo=release_lease)

    def release(self, lease: Lease) -> None:
        self.portal.call(lease.release(), shielded=True)

    def resize(self, lease: Lease, tokens: int) -> int:
        """Blocking :meth:`Lease.resize`: the tokens ``lease`` holds now. (The blocking API
        hands out the same :class:`Lease` objects as the async one, whose methods are
        coroutines; this is the one lease call that needs Redis while the lease is held.)"""
        return self.portal.call(lease.resize(tokens))

    def map(self, fn: Any, items: Iterable[Any], **options: Any) -> list[Any]:
        """Blocking :meth:`Gate.map`: same options; a sync ``fn`` runs in worker threads."""
        return self.portal.call(self.gate.map(fn, items, **options))

    def map_batches(self, fn: Any, items: Sequence[Any], **options: Any) -> list[Any]:
        """Blocking :meth:`Gate.map_batches`."""
        return self.portal.call(self.gate.map_batches(fn, items, **options))

    def capacity(self) -> int:
        """The gate's current fleet-wide limit."""
        return self.portal.call(self.gate.capacity())


class SyncFleet:
    """Blocking twin of :class:`Fleet` (same arguments): ``with SyncFleet(url) as fleet:``."""

    def __init__(self, url: str | None = None, **kwargs: Any) -> None:
        self._url = url
        self._kwargs = kwargs
        self._portal: _Portal | None = None
        self._fleet: Fleet | None = None
        self._gates: dict[str, SyncGate] = {}
        self._gates_lock = threading.Lock()

    def __enter__(self) -> SyncFleet:
        self.start()
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def start(self) -> None:
        if self._portal is not None:
            return
        self._portal = _Portal()
        self._fleet = self._portal.call(_started(Fleet(self._url, **self._kwargs)))

    def close(self) -> None:
        if self._portal is None or self._fleet is None:
            return
        self._portal.call(self._fleet.close())
        self._portal.stop()
        self._portal = None
        self._fleet = None

    @property
    def fleet(self) -> Fleet:
        if self._fleet is None:
            raise RuntimeError("SyncFleet is not started: use `with SyncFleet(...)`")
        return self._fleet

    @property
    def portal(self) -> _Portal:
        if self._portal is None:
            raise RuntimeError("SyncFleet is not started: use `with SyncFleet(...)`")
        return self._portal

    def gate(self, name: str, **settings: Unpack[GateSettingsKwargs]) -> SyncGate:
        """Same as :meth:`Fleet.gate` (the same settings, the first call for a name fixes
        them), returning the blocking twin."""
        check_setting_names(settings, "SyncFleet.gate")
        with self._gates_lock:  # one SyncGate per gate, whatever threads ask at once
            found = self._gates.get(name)
            if found is None:
                gate = self.fleet.gate(name, **settings)
                found = SyncGate(self.portal, gate)
                self._gates[name] = found
        return found

    def utilization(self, name: str) -> GateUtilization:
        return self.portal.call(self.fleet.utilization(name))

    def flush(self) -> None:
        """Blocking :meth:`Fleet.flush`."""
        self.portal.call(self.fleet.flush())


async def release_lease(lease: Lease) -> None:
    await lease.release()


async def _started(fleet: Fleet) -> Fleet:
    await fleet.start()
    return fleet
