"""Small asyncio helpers shared by the client and the coordinator."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from typing import TypeVar

__all__ = ["within"]

T = TypeVar("T")


async def within(aw: Awaitable[T], seconds: float) -> T:
    """``await aw`` for at most ``seconds``, else raise ``TimeoutError``.

    Uses ``asyncio.timeout`` where available: ``asyncio.wait_for`` on Python 3.11 can swallow a
    cancellation that races its timeout, which keeps a cancelled loop running.
    """
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(seconds):
            return await aw
    return await asyncio.wait_for(aw, seconds)  # pragma: no cover - Python 3.10
