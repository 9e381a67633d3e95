"""A first-come-first-served bound on holders whose wait fails like a busy connection pool's."""

from __future__ import annotations

import asyncio
import collections

import redis.asyncio as aredis


class _Permits:
    """At most ``size`` holders at once, served in arrival order (a semaphore whose wait fails
    with ``ConnectionError`` after ``timeout`` seconds, as the standalone pool's wait does)."""

    __slots__ = ("_waiters", "free", "size", "timeout")

    def __init__(self, size: int, timeout: float) -> None:
        self.size = size
        self.free = size
        self.timeout = timeout
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    async def acquire(self) -> None:
        if self.free > 0 and not self._waiters:
            self.free -= 1
            return
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        self._waiters.append(waiter)
        timer = loop.call_later(self.timeout, self._expire, waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # handed over as the caller was cancelled: pass it on
            else:
                self._drop(waiter)
            raise
        finally:
            timer.cancel()

    def release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():  # a cancelled one may still be queued for a moment
                waiter.set_result(None)
                return
        self.free += 1

    def _expire(self, waiter: asyncio.Future[None]) -> None:
        if waiter.done():
            return
        self._drop(waiter)
        waiter.set_exception(
            aredis.ConnectionError(
                f"no free connection to the Redis Cluster within {self.timeout:g} s "
                f"({self.size} commands in flight)"
            )
        )

    def _drop(self, waiter: asyncio.Future[None]) -> None:
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass
