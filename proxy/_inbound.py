"""The caller's side of one exchange: its request body and whether it is still there.

One task (:meth:`Inbound.run`) owns the ASGI ``receive`` for the whole exchange: it buffers the
body as it arrives (at most ``limit`` bytes: beyond, :attr:`Inbound.too_large`) and, once the
body is complete, keeps listening for ``http.disconnect``. So a caller that goes away is seen at
once in every phase -- its body read, queued for a permit, waiting for the upstream, streaming
the response -- and the callbacks given to :meth:`Inbound.on_gone` run (they cancel what the
exchange is doing).

:meth:`Inbound.read_all` waits for the whole body (the app reads it before asking for a
permit); :meth:`Inbound.body` hands the buffer and then the rest, as it arrives, to the upstream
(a route that streams its uploads). Every buffered byte is taken from the proxy's
:class:`BodyBudget` (``max_buffered_bytes``, across all connections) as it arrives and given
back when it is streamed on or the exchange ends (:meth:`Inbound.release`); a chunk the budget
has no room for stops the exchange (:attr:`Inbound.over_budget`).

A body that goes ``idle_s`` without a byte before it is complete is :attr:`Inbound.stalled`.
:attr:`Inbound.stop` is set the moment the exchange cannot go on because of the caller -- gone,
body too large, body stalled, no room to buffer it -- whatever phase it is in, and
:meth:`Inbound.failure` says which (a :class:`CallerStopped`); :meth:`Inbound.race` waits for a
step of the exchange (the permit, the upstream's answer) unless that happens first.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

__all__ = [
    "BodyBudget",
    "BodyStalled",
    "BodyTooLarge",
    "BuffersFull",
    "CallerStopped",
    "ClientGone",
    "Inbound",
]

Receive = Callable[[], Awaitable[dict[str, Any]]]
T = TypeVar("T")


class CallerStopped(Exception):
    """The caller's side stopped the exchange (:meth:`Inbound.failure`)."""


class ClientGone(CallerStopped):
    """The caller disconnected."""


class BodyTooLarge(CallerStopped):
    """The request body is larger than the proxy's ``max_request_bytes``."""


class BodyStalled(CallerStopped):
    """No byte of the request body came for the proxy's ``body_timeout_s``."""


class BuffersFull(CallerStopped):
    """Buffering the request body would pass the proxy's ``max_buffered_bytes``."""


class BodyBudget:
    """The request body bytes one proxy buffers across all its connections: at most ``limit``
    (``max_buffered_bytes``). One event loop uses it: no lock."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def fits(self, size: int) -> bool:
        """Whether ``size`` more bytes fit now."""
        return self.used + size <= self.limit

    def take(self, size: int) -> bool:
        """Count ``size`` bytes as buffered, unless they do not fit (False)."""
        if self.used + size > self.limit:
            return False
        self.used += size
        return True

    def give(self, size: int) -> None:
        """``size`` bytes taken are no longer buffered."""
        self.used -= size


class Inbound:
    """The caller's side of one exchange (see the module's docstring)."""

    def __init__(
        self,
        receive: Receive,
        limit: int,
        idle_s: float = 30.0,
        budget: BodyBudget | None = None,
    ) -> None:
        self._receive = receive
        self.limit = limit
        self.idle_s = idle_s
        self.budget = BodyBudget(limit) if budget is None else budget
        self.received = 0
        self.held = 0  # bytes of the body buffered here, taken from the budget
        self.complete = False
        self.too_large = False
        self.stalled = False
        self.over_budget = False
        self.gone = asyncio.Event()
        self.stop = _Stop()  # gone, too large or stalled: the exchange cannot go on
        self._chunks: deque[bytes] = deque()
        self._news = asyncio.Event()
        self._callbacks: list[Callable[[], None]] = []
        self._idle: asyncio.TimerHandle | None = None

    async def run(self) -> None:
        """Read the body, then wait for the disconnect (cancelled when the exchange ends)."""
        loop = asyncio.get_running_loop()
        self._idle = loop.call_later(self.idle_s, self._stall)
        try:
            while True:
                message = await self._receive()
                kind = message.get("type")
                if kind == "http.disconnect":
                    self._set_gone()
                    return
                if kind != "http.request" or self.complete or self.stop.is_set():
                    continue
                self._idle.cancel()
                self._take(message)
                if not (self.complete or self.stop.is_set()):  # the body's idle time anew
                    self._idle = loop.call_later(self.idle_s, self._stall)
                self._news.set()
        finally:
            self._idle.cancel()

    def _take(self, message: dict[str, Any]) -> None:
        chunk = message.get("body", b"")
        if chunk:
            size = len(chunk)
            self.received += size
            if self.received > self.limit:
                self.too_large = True
                self._drop()
            elif not self.budget.take(size):
                self.over_budget = True
                self._drop()
            else:
                self.held += size
                self._chunks.append(chunk)
        if not message.get("more_body", False):
            self.complete = True

    def _drop(self) -> None:
        """The body cannot be had: what is buffered goes, and the exchange stops."""
        self.release()
        self.stop.set()

    def release(self) -> None:
        """Give the buffered body's bytes back to the budget (the exchange has ended)."""
        self._chunks.clear()
        self.budget.give(self.held)
        self.held = 0

    def _stall(self) -> None:
        if not (self.complete or self.stop.is_set()):
            self.stalled = True
            self.stop.set()
            self._news.set()

    def failure(self) -> CallerStopped:
        """Why :attr:`stop` is set: :class:`ClientGone`, :class:`BodyTooLarge`,
        :class:`BuffersFull` or :class:`BodyStalled`."""
        if self.gone.is_set():
            return ClientGone()
        if self.too_large:
            return BodyTooLarge()
        if self.over_budget:
            return BuffersFull()
        return BodyStalled()

    async def race(
        self,
        task: asyncio.Future[T],
        timeout: float | None = None,
        discard: Callable[[T], Awaitable[None]] | None = None,
    ) -> T:
        """``task``'s result, unless the caller's side stops the exchange first (gone, a body too
        large or stalled: :meth:`failure` is raised) or ``timeout`` passes
        (:class:`TimeoutError`): then ``task`` is cancelled and a result it produced anyway is
        handed to ``discard`` (a lease to release, a response to close)."""
        stop = self.stop
        waiter = stop.future()  # a future, not a task awaiting stop.wait(): two per request
        pending: set[asyncio.Future[Any]] = {task, waiter}
        try:
            await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # this exchange is cancelled itself (the server's shutdown)
            task.cancel()
            if discard is not None:
                task.add_done_callback(functools.partial(_discard_later, discard))
            raise
        finally:
            stop.forget(waiter)
        if task.done() and not stop.is_set():
            return task.result()
        task.cancel()
        try:
            result = await task
        except asyncio.CancelledError:
            pass
        except Exception:
            pass  # the task failed as it was abandoned: nothing to clean
        else:
            if discard is not None:
                await discard(result)
        if stop.is_set():
            raise self.failure()
        raise TimeoutError

    def on_gone(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when the caller disconnects (at once if it has)."""
        if self.gone.is_set():
            callback()
        else:
            self._callbacks.append(callback)

    def _set_gone(self) -> None:
        self.gone.set()
        self.stop.set()
        self._news.set()
        callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb()

    async def read_all(self, timeout: float | None = None) -> bytes:
        """The whole body (it stays buffered, for :meth:`body`): a :class:`CallerStopped` if it
        cannot be had, :class:`TimeoutError` if it is not complete within ``timeout`` s."""
        if not (self.complete or self.stop.is_set()):
            try:
                await asyncio.wait_for(self._settled(), timeout)
            except asyncio.TimeoutError:  # not the built-in one before Python 3.11
                raise TimeoutError from None
        self._check()
        if len(self._chunks) > 1:
            whole = b"".join(self._chunks)
            self._chunks.clear()
            self._chunks.append(whole)
        return self._chunks[0] if self._chunks else b""

    async def _settled(self) -> None:
        """Until the body is complete or the exchange stopped."""
        while not (self.complete or self.stop.is_set()):
            self._news.clear()
            await self._news.wait()

    def _check(self) -> None:
        if self.too_large:
            raise BodyTooLarge
        if self.over_budget:
            raise BuffersFull
        if self.stalled:
            raise BodyStalled
        if self.gone.is_set() and not self.complete:
            raise ClientGone

    async def body(self) -> AsyncIterator[bytes]:
        """The body for the upstream: what is buffered, then the rest as it arrives (each
        chunk leaves the budget as it goes on)."""
        while True:
            self._check()
            while self._chunks:
                chunk = self._chunks.popleft()
                self.held -= len(chunk)
                self.budget.give(len(chunk))
                yield chunk
                self._check()
            if self.complete:
                return
            self._news.clear()
            if not (self._chunks or self.complete or self.stop.is_set()):
                await self._news.wait()


class _Stop(asyncio.Event):
    """An event that also hands out plain futures resolved when it is set (:meth:`future`), to
    race against without a task awaiting :meth:`wait` (one per race, two per request)."""

    def __init__(self) -> None:
        super().__init__()
        self._futures: list[asyncio.Future[None]] = []

    def set(self) -> None:
        super().set()
        futures, self._futures = self._futures, []
        for fut in futures:
            if not fut.done():
                fut.set_result(None)

    def future(self) -> asyncio.Future[None]:
        """A future done when the event is set (at once if it is); :meth:`forget` it after."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.is_set():
            fut.set_result(None)
        else:
            self._futures.append(fut)
        return fut

    def forget(self, fut: asyncio.Future[None]) -> None:
        """Stop tracking ``fut`` (the race it was for is over)."""
        fut.cancel()
        with contextlib.suppress(ValueError):
            self._futures.remove(fut)


# cleanups started from callbacks, kept referenced until they finish
_cleanups: set[asyncio.Future[None]] = set()


def _discard_later(discard: Callable[[Any], Awaitable[None]], task: asyncio.Future[Any]) -> None:
    if task.cancelled() or task.exception() is not None:
        return
    cleanup = asyncio.ensure_future(discard(task.result()))
    _cleanups.add(cleanup)
    cleanup.add_done_callback(_cleanups.discard)
