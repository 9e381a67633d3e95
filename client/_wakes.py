"""The wake listeners: how a parked caller's process learns of its grant in one round trip.

A script that hands a slot to a parked caller pushes the caller's id onto the owner pod's wake
list of that gate (``fg:{G}:wake:<pod_key>``). Each process pops its wake list of every gate it
has parked on, one blocking pop per gate on a connection of its own, and hands each id to the
gate's callback. Listeners know nothing of gates beyond a key and a callback.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from ._runtime import OUTAGE_ERRORS, Runtime

__all__ = ["WakeListeners"]

log = logging.getLogger("fleetgate.client")


class WakeListeners:
    """One wake listener per gate of the process, started on the gate's first park."""

    def __init__(self, runtime: Runtime, block: float) -> None:
        self.runtime = runtime
        #: seconds one blocking pop waits before it is sent again
        self.block = block
        self.tasks: dict[str, asyncio.Task[None]] = {}

    def ensure(self, gate: str, key: str, on_wake: Callable[[str], None]) -> None:
        """Listen on ``key`` for ``gate`` (if not already), passing every popped id to
        ``on_wake``."""
        task = self.tasks.get(gate)
        if task is None or task.done():
            self.tasks[gate] = asyncio.create_task(
                self._listen(gate, key, on_wake), name=f"fleetgate-wake-{gate}"
            )

    def cancel_all(self) -> list[asyncio.Task[None]]:
        """Cancel every listener; returns the tasks to wait for."""
        tasks = list(self.tasks.values())
        for t in tasks:
            t.cancel()
        self.tasks.clear()
        return tasks

    async def _listen(self, gate: str, key: str, on_wake: Callable[[str], None]) -> None:
        # A blocking pop must never be cancelled on a shared connection (redis-py would hand a
        # late reply to the next command), so each listener owns its connection and drops it
        # on exit. Lost wake-ups (connection killed, Redis restarted) are recovered by the
        # heartbeat, which reports granted waiters.
        rt = self.runtime
        conn = await rt.dedicated_connection(socket_timeout=self.block + 3.0)
        try:
            while not rt.closing:
                try:
                    item = await conn.blpop([key], timeout=self.block)
                except Exception as exc:  # never ends: the heartbeat covers the gap
                    if rt.closing:
                        break
                    if isinstance(exc, OUTAGE_ERRORS):
                        log.debug("gate %s: wake listener error %s; reconnecting", gate, exc)
                    else:
                        rt.background_error("wake listener", exc, gate)
                    await asyncio.sleep(min(1.0, rt.heartbeat_interval))
                    continue
                if item is not None:
                    on_wake(str(item[1]))
        finally:
            await conn.aclose()
