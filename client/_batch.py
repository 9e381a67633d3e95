"""Group commit for one gate's script calls: the calls a process makes while one is in flight go
to Redis together as the next call.

The first request finds nothing in flight and is sent at once (one loop turn later: the sending
task's first step). Requests made while a batch is in flight wait for it and then leave as one
batch of up to ``max_batch``. So a lone caller pays no wait, and a busy process (many tasks
acquiring and releasing the same gate) pays one round trip, one script call's fixed costs and one
reply for many callers: the batch grows with the load, which is when it pays.

A caller that gives up (cancelled) before its request leaves is simply dropped from the batch.
One that gives up after gets nothing back; its reply (or the batch's error) goes to
``on_orphan``, which undoes what the call did -- after the reply is known, never racing it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, Generic, TypeVar

__all__ = ["Batcher"]

Q = TypeVar("Q")
A = TypeVar("A")


class Batcher(Generic[Q, A]):
    """Sends requests of type ``Q`` in batches through ``send``, which returns one answer of type
    ``A`` per request, in order (or raises for the whole batch)."""

    def __init__(
        self,
        send: Callable[[Sequence[Q]], Awaitable[Sequence[A]]],
        *,
        spawn: Callable[[Coroutine[Any, Any, Any]], Any],
        max_batch: int,
        on_orphan: Callable[[Q, A | BaseException], None] | None = None,
    ) -> None:
        self._send = send
        self._spawn = spawn
        self._max = max_batch
        self._on_orphan = on_orphan
        self._pending: list[tuple[Q, asyncio.Future[A]]] = []
        self._running = False
        self._idle = asyncio.Event()
        self._idle.set()

    def submit(self, request: Q) -> asyncio.Future[A]:
        """Queue ``request``; the future gets its answer, or the batch's exception."""
        future: asyncio.Future[A] = asyncio.get_running_loop().create_future()
        self._pending.append((request, future))
        if not self._running:
            self._running = True
            self._idle.clear()
            self._spawn(self._drain())
        return future

    async def flush(self) -> None:
        """Wait until every request submitted so far has been answered (or failed)."""
        await self._idle.wait()

    async def _drain(self) -> None:
        try:
            while self._pending:
                live = [(q, f) for q, f in self._pending[: self._max] if not f.cancelled()]
                del self._pending[: self._max]
                if live:
                    await self._send_batch(live)
        finally:
            self._running = False
            self._idle.set()
            if self._pending:  # only if _send_batch raised BaseException (closing)
                for _, f in self._pending:
                    f.cancel()
                self._pending.clear()

    async def _send_batch(self, batch: list[tuple[Q, asyncio.Future[A]]]) -> None:
        try:
            answers = await self._send([q for q, _ in batch])
        except Exception as exc:
            for q, f in batch:
                if f.done():
                    self._orphan(q, exc)
                else:
                    f.set_exception(exc)
            return
        except BaseException as exc:  # cancelled (the fleet closes): nobody gets an answer
            for q, f in batch:
                if f.done():
                    self._orphan(q, exc)
                else:
                    f.cancel()
            raise
        for (q, f), answer in zip(batch, answers, strict=True):
            if f.done():
                self._orphan(q, answer)
            else:
                f.set_result(answer)

    def _orphan(self, request: Q, outcome: A | BaseException) -> None:
        if self._on_orphan is not None:
            self._on_orphan(request, outcome)
