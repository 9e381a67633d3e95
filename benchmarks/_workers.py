"""Worker processes: spawned together, started at one instant, each with a warmed-up fleet.

:class:`Workers` runs ``fn(sync, *args)`` in spawned processes and collects their results in
order; inside a worker, :func:`worker_fleet` opens the fleet, waits for the common start and
counts the client's warnings; :func:`cpu_during` measures the worker's CPU over a window.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import queue
import resource
import sys
import time
import traceback
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from fleetgate.client import Fleet

from ._common import Flavor, log, open_fleet


def cpu_seconds() -> float:
    """CPU time (user + system) used by this process so far."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


async def cancel_until_done(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel ``tasks`` and wait until every one has ended, cancelling again each second: on
    Python 3.11 a cancellation racing redis-py's internal wait_for can be lost (callers also
    stop their loops by a flag first)."""
    pending: set[asyncio.Task[None]] = set(tasks)
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=1.0)


class _EventCounter(logging.Handler):
    """Counts the client's warnings that mean a run left the steady state."""

    PATTERNS: ClassVar[dict[str, str]] = {
        "fallback": "unreachable",
        "requeue": "expired; parking again",
        "lease_lost": "not renewed in time",
    }

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts = dict.fromkeys(self.PATTERNS, 0)

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        for kind, pattern in self.PATTERNS.items():
            if pattern in msg:
                self.counts[kind] += 1


@dataclass
class WorkerRun:
    fleet: Fleet
    start: int  # common start, monotonic ns
    events: dict[str, int]  # fallback / requeue / lease_lost warnings seen by this worker


@contextlib.asynccontextmanager
async def worker_fleet(
    sync: Sync, url: str, flavor: Flavor, *, connections: int, overdue_s: float
) -> AsyncIterator[WorkerRun]:
    """A worker's fleet, ready for the common start.

    Up to ``connections`` pool connections (at most the pool's size) are opened one by one
    beforehand, so the measured window is the steady state and not a connect storm: dozens of
    connects at once under CPU load can exceed fleetgate's 1 s connect timeout, which it takes
    for an outage (see README, library notes)."""
    counter = _EventCounter()
    logging.getLogger("fleetgate.client").addHandler(counter)
    async with open_fleet(url, flavor) as fleet:
        # A cluster client has a pool per node, opened on demand (and no connection_pool).
        pool = getattr(fleet.redis, "connection_pool", None)
        if pool is not None:
            n = min(connections, getattr(pool, "max_connections", connections))
            conns = [await pool.get_connection() for _ in range(n)]
            for c in conns:
                await pool.release(c)
        start = await sync.aready()
        dog = asyncio.create_task(_watchdog(start + int(overdue_s * 1e9), fleet))
        try:
            yield WorkerRun(fleet, start, counter.counts)
        finally:
            dog.cancel()


async def _watchdog(at_ns: int, fleet: Fleet) -> None:
    """Report to stderr what a worker is stuck on if it is still running at ``at_ns``."""
    await asyncio.sleep(max(0.0, (at_ns - time.monotonic_ns()) / 1e9))
    while True:
        gates = ", ".join(
            f"{g.name}: {len(g.waiters)} parked"
            f" ({sum(not w.future.done() for w in g.waiters.values())} pending),"
            f" {len(g.leases)} held"
            for g in fleet._gates.values()
        )
        tasks = asyncio.all_tasks()
        log(
            f"worker {os.getpid()} overdue: fallback={fleet.fallback_active} {gates}; "
            f"{len(tasks)} tasks; listeners {[t.done() for t in fleet._wakes.tasks.values()]}"
        )
        for t in list(tasks)[:3]:
            t.print_stack(limit=4, file=sys.stderr)
        await asyncio.sleep(10)


async def cpu_during(lo_ns: int, hi_ns: int) -> float:
    """CPU seconds this process uses between two monotonic instants (run it as a task)."""
    await asyncio.sleep(max(0.0, (lo_ns - time.monotonic_ns()) / 1e9))
    before = cpu_seconds()
    await asyncio.sleep(max(0.0, (hi_ns - time.monotonic_ns()) / 1e9))
    return cpu_seconds() - before


# -- worker processes ---------------------------------------------------------------------------


class Sync:
    """Handed to each worker: report ready, wait for the common start, publish the result."""

    def __init__(self, ctx: Any) -> None:
        self._ready = ctx.Queue()
        self._go = ctx.Event()
        self._start = ctx.Value("q", 0)
        self._out = ctx.Queue()
        self.idx = -1  # set in the worker
        self.published = False

    def ready(self) -> int:
        """Block until every worker is ready; return the common start (monotonic ns)."""
        self._ready.put(os.getpid())
        self._go.wait()
        return int(self._start.value)

    async def aready(self) -> int:
        return await asyncio.to_thread(self.ready)

    def publish(self, value: Any) -> None:
        """Hand the result to the parent now, before the fleet closes. (fleetgate's
        ``Fleet.close()`` can hang on Python 3.11: see README, library notes.)"""
        self._out.put((self.idx, True, value))
        self.published = True


def _entry(fn: Callable[..., Any], idx: int, sync: Sync, args: tuple[Any, ...]) -> None:
    sync.idx = idx
    try:
        value = fn(sync, *args)
        if not sync.published:
            sync._out.put((idx, True, value))
    except BaseException:
        sync._out.put((idx, False, traceback.format_exc()))


class Workers:
    """Spawned processes running ``fn(sync, *args)``; started together, results in order.

    Workers still running 10 s after the results are in (stuck closing their fleet) are
    terminated and listed in :attr:`stuck`."""

    def __init__(self, fn: Callable[..., Any], args_list: Sequence[tuple[Any, ...]]) -> None:
        ctx = mp.get_context("spawn")
        self.sync = Sync(ctx)
        self._out = self.sync._out
        self.stuck: list[int] = []
        self.procs = [
            ctx.Process(target=_entry, args=(fn, i, self.sync, a), daemon=True)
            for i, a in enumerate(args_list)
        ]

    def __enter__(self) -> Workers:
        for p in self.procs:
            p.start()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        end = time.monotonic() + (10.0 if exc_type is None else 0.0)
        for i, p in enumerate(self.procs):
            p.join(max(0.0, end - time.monotonic()))
            if p.is_alive():
                if exc_type is None:
                    self.stuck.append(i)
                    log(
                        f"worker {i} (pid {p.pid}) still running 10 s after its result: "
                        "stuck in Fleet.close() (see README, library notes); terminated"
                    )
                p.terminate()
                p.join(5)

    def go(self, timeout: float = 60.0, lead_ms: int = 50) -> int:
        """Wait until all workers are ready, then start them; return the start (monotonic ns)."""
        for _ in self.procs:
            self.sync._ready.get(timeout=timeout)
        start = time.monotonic_ns() + lead_ms * 1_000_000
        self.sync._start.value = start
        self.sync._go.set()
        return start

    def results(self, timeout: float) -> list[Any]:
        got: dict[int, Any] = {}
        end = time.monotonic() + timeout
        grace = 0  # a worker that just exited may still have its result in the pipe
        while len(got) < len(self.procs):
            try:
                idx, ok, value = self._out.get(timeout=1.0)
            except queue.Empty:
                dead = [i for i, p in enumerate(self.procs) if i not in got and not p.is_alive()]
                grace = grace + 1 if dead else 0
                if grace > 3 or time.monotonic() > end:
                    missing = [i for i in range(len(self.procs)) if i not in got]
                    codes = {i: self.procs[i].exitcode for i in missing}
                    raise RuntimeError(
                        f"workers {missing} gave no result (exit codes {codes}; None = still "
                        f"running after {timeout}s)"
                    ) from None
                continue
            if not ok:
                raise RuntimeError(f"worker {idx} failed:\n{value}")
            got[idx] = value
        return [got[i] for i in range(len(self.procs))]
