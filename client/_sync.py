"""The synchronous face: the same asyncio core, run on a background event-loop thread.

Nothing here re-implements gate logic: every call is submitted to the loop that owns the
:class:`Fleet`. An interrupted caller (KeyboardInterrupt, or an exception raised into the
thread) cancels the submitted coroutine, so a parked acquire leaves the wait list.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Coroutine, Iterable, Iterator, Sequence
from types import TracebackType
from typing import Any, TypeVar

from ._fleet import Fleet, GateUtilization
from ._gate import Gate, Lease

__all__ = ["SyncFleet", "SyncGate"]

T = TypeVar("T")


class _Portal:
    """An event loop on a daemon thread, and a way to run coroutines on it from other threads."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="fleetgate-loop", daemon=True
        )
        self._thread.start()

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result()
        except BaseException:
            if not fut.done():
                fut.cancel()
                # Give the coroutine's cleanup (leaving the queue) a moment to run.
                concurrent.futures.wait([fut], timeout=2.0)
            raise

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()


class SyncGate:
    """Blocking twin of :class:`Gate`; obtain it with :meth:`SyncFleet.gate`."""

    def __init__(self, portal: _Portal, gate: Gate) -> None:
        self._portal = portal
        self.gate = gate
        self.name = gate.name

    @contextlib.contextmanager
    def permit(self, deadline: float | None = 30.0) -> Iterator[Lease]:
        """``with gate.permit(deadline=30.0) as lease:`` — blocks until granted.

        The deadline bounds the queue wait; a thread cannot be interrupted mid-call, so the block
        itself runs to completion (use :meth:`map` for a deadline that abandons running calls).
        """
        lease = self.acquire(deadline)
        try:
            yield lease
        finally:
            self._portal.call(lease.release())

    def acquire(self, deadline: float | None = 30.0) -> Lease:
        """Acquire a permit; release it with :meth:`release`."""
        return self._portal.call(self.gate.acquire(deadline))

    def release(self, lease: Lease) -> None:
        self._portal.call(lease.release())

    def map(self, fn: Any, items: Iterable[Any], **options: Any) -> list[Any]:
        """Blocking :meth:`Gate.map`: same options; a sync ``fn`` runs in worker threads."""
        return self._portal.call(self.gate.map(fn, items, **options))

    def map_batches(self, fn: Any, items: Sequence[Any], **options: Any) -> list[Any]:
        """Blocking :meth:`Gate.map_batches`."""
        return self._portal.call(self.gate.map_batches(fn, items, **options))

    def capacity(self) -> int:
        """The gate's current fleet-wide limit."""
        return self._portal.call(self.gate.capacity())


class SyncFleet:
    """Blocking twin of :class:`Fleet` (same arguments): ``with SyncFleet(url) as fleet:``."""

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", **kwargs: Any) -> None:
        self._url = url
        self._kwargs = kwargs
        self._portal: _Portal | None = None
        self._fleet: Fleet | None = None
        self._gates: dict[str, SyncGate] = {}

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

    def gate(self, name: str, **settings: Any) -> SyncGate:
        """Same as :meth:`Fleet.gate`, returning the blocking twin."""
        found = self._gates.get(name)
        if found is None:
            found = SyncGate(self.portal, self.fleet.gate(name, **settings))
            self._gates[name] = found
        return found

    def utilization(self, name: str) -> GateUtilization:
        return self.portal.call(self.fleet.utilization(name))


async def _started(fleet: Fleet) -> Fleet:
    await fleet.start()
    return fleet
