"""A total deadline for a block of async code, raising :class:`DeadlineExceeded` when it fires.

The deadline cancels whatever the block is awaiting (queue wait, a call, a retry back-off), so
cleanup in ``finally`` blocks runs (leaving the queue, releasing the lease) before the error
reaches the caller. Built on ``asyncio.timeout_at`` (Python 3.11+), with a small equivalent for
3.10.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from types import TracebackType
from typing import Any

from fleetgate.errors import DeadlineExceeded

__all__ = ["Deadline"]


class Deadline:
    """``async with Deadline(gate, seconds):`` — ``seconds=None`` means no deadline.

    ``seconds`` is a checked deadline (:func:`~fleetgate.ask.check_deadline`: an
    :class:`~fleetgate.ask.Ask`'s, or ``gate.map``'s), not checked again here."""

    def __init__(
        self,
        gate: str,
        seconds: float | None,
        *,
        where: str = "",
        on_expire: Callable[[], None] | None = None,
    ) -> None:
        self.gate = gate
        self.seconds = seconds
        self.where = where
        self.on_expire = on_expire
        self.when: float | None = None
        self._cm: Any = None  # asyncio.Timeout on 3.11+
        self._handle: asyncio.TimerHandle | None = None
        self._fired = False

    @property
    def ms(self) -> int:
        return round((self.seconds or 0) * 1000)

    def remaining(self) -> float | None:
        """Seconds left, or None without a deadline."""
        if self.when is None:
            return None
        return self.when - asyncio.get_running_loop().time()

    def expired(self) -> DeadlineExceeded:
        """The error for this deadline (counted by ``on_expire``)."""
        if self.on_expire is not None:
            self.on_expire()
        return DeadlineExceeded(self.gate, self.ms, where=self.where)

    async def __aenter__(self) -> Deadline:
        if self.seconds is None:
            return self
        loop = asyncio.get_running_loop()
        self.when = loop.time() + self.seconds
        if sys.version_info >= (3, 11):
            self._cm = asyncio.timeout_at(self.when)
            await self._cm.__aenter__()
        else:  # pragma: no cover - exercised on Python 3.10 only
            task = asyncio.current_task()
            assert task is not None

            def fire() -> None:
                self._fired = True
                task.cancel()

            self._handle = loop.call_at(self.when, fire)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.seconds is None:
            return
        if self._cm is not None:
            try:
                await self._cm.__aexit__(exc_type, exc, tb)
            except TimeoutError as err:
                if isinstance(err, DeadlineExceeded):
                    raise
                raise self.expired() from err
            return
        if self._handle is not None:  # pragma: no cover - Python 3.10
            self._handle.cancel()
            if self._fired and exc_type is asyncio.CancelledError:
                raise self.expired() from exc
