"""handoff's segment breakdown: where the time between a release and the woken caller's start goes.

:func:`install` is called in each worker process of the ``handoff`` benchmark, before its fleet
opens. It wraps points of the client, redis-py and asyncio at class level (nothing of the library
changes) and stamps them with ``time.monotonic_ns()`` (CLOCK_MONOTONIC is system-wide on Linux, so
stamps of different processes compare), by lease id:

* ``sent``: the releasing process hands the script call carrying the release to redis-py
  (``GateScripts.acquire_many`` / ``release_many`` entered: the gate's batch task runs);
* ``written``: that call's bytes go to the socket (``StreamWriter.writelines``);
* ``replied``: its reply is decoded in the releasing process;
* ``arrived``: the bytes of the ``BLMPOP`` reply carrying the wake reach the waiting process's
  stream (``StreamReader.feed_data``, as the event loop reads them);
* ``woken``: the waiting process hands the wake ``<id>=<token>`` to its gate (the ``on_wake``
  callback :meth:`WakeListeners.ensure` registers): popped, parsed, dispatched.

With the caller's own stamps (``release``: just before it leaves its block; ``start``: the
first line of the next holder's block) :func:`segments` splits each cross-process hand-off into
release → sent (the releasing loop and the gate's batcher), sent → written (encoding, redis-py,
the write), written → arrived (Redis: the script, the wake's delivery, both processes'
scheduling), arrived → woken (the listener's turn, parsing) and woken → start (the parked task
resumes, the lease is made, ``permit()`` yields); written → replied (the releaser's own round
trip) and replied → woken (≈ 0 when the waiting pod's pop was blocked when the script ran) are
given beside them.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ._common import percentiles

__all__ = ["SEGMENTS", "Stamps", "install", "segments"]

#: segment name -> (from stamp, to stamp); every name is reported as p50/p99 in µs
SEGMENTS: dict[str, tuple[str, str]] = {
    "release → sent": ("release", "sent"),
    "sent → written": ("sent", "written"),
    "written → arrived": ("written", "arrived"),
    "arrived → woken": ("arrived", "woken"),
    "woken → start": ("woken", "start"),
    "total": ("release", "start"),
    "(written → replied)": ("written", "replied"),
    "(replied → woken)": ("replied", "woken"),
}


class Stamps:
    """One process's stamps, by lease id (the first stamp of each kind wins)."""

    def __init__(self) -> None:
        self.sent: dict[str, int] = {}
        self.written: dict[str, int] = {}
        self.replied: dict[str, int] = {}
        self.arrived: dict[str, int] = {}
        self.woken: dict[str, int] = {}

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {k: getattr(self, k) for k in ("sent", "written", "replied", "arrived", "woken")}


# the lease ids whose release the current task's script call carries (seen by the write)
_RELEASING: contextvars.ContextVar[Sequence[str]] = contextvars.ContextVar(
    "fg_bench_releasing", default=()
)


def _stamp(into: dict[str, int], ids: Sequence[str]) -> None:
    t = time.monotonic_ns()
    for i in ids:
        into.setdefault(i, t)


def install() -> Stamps:
    """Wrap the client's release calls and wake dispatch in this process; the stamps."""
    from fleetgate.client._wakes import WakeListeners
    from fleetgate.scripts import GateScripts

    st = Stamps()
    acquire_many, release_many, ensure = (
        GateScripts.acquire_many,
        GateScripts.release_many,
        WakeListeners.ensure,
    )

    async def stamped_acquire(self: Any, *args: Any, **kw: Any) -> Any:
        releases = list(kw.get("releases", ()))
        _stamp(st.sent, releases)
        _RELEASING.set(releases)
        out = await acquire_many(self, *args, **kw)
        _RELEASING.set(())
        _stamp(st.replied, releases)
        return out

    async def stamped_release(self: Any, keys: Any, lease_ids: Any, *args: Any) -> Any:
        _stamp(st.sent, lease_ids)
        _RELEASING.set(list(lease_ids))
        out = await release_many(self, keys, lease_ids, *args)
        _RELEASING.set(())
        _stamp(st.replied, lease_ids)
        return out

    def stamped_ensure(
        self: Any, gate: str, key: str, on_wake: Callable[[str], None], *args: Any
    ) -> None:
        def woken(value: str) -> None:
            _stamp(st.woken, [value.rpartition("=")[0]])
            on_wake(value)

        ensure(self, gate, key, woken, *args)

    _install_socket_stamps(st)
    GateScripts.acquire_many = stamped_acquire  # type: ignore[method-assign]
    GateScripts.release_many = stamped_release  # type: ignore[method-assign,assignment]
    WakeListeners.ensure = stamped_ensure  # type: ignore[method-assign,assignment]
    return st


def _install_socket_stamps(st: Stamps) -> None:
    """``written``: the release's bytes go to the socket (``StreamWriter.writelines``);
    ``arrived``: the bytes of the reply carrying a wake reached the waiting process's stream
    (``StreamReader.feed_data``, called by the event loop as they are read; uvloop's transports
    feed asyncio's streams too)."""
    from redis.asyncio.connection import AbstractConnection

    write, read, feed = (
        asyncio.StreamWriter.writelines,
        AbstractConnection._read_response_from_parser,
        asyncio.StreamReader.feed_data,
    )

    def stamped_write(self: Any, data: Any) -> None:
        _stamp(st.written, _RELEASING.get())
        write(self, data)

    def stamped_feed(self: Any, data: Any) -> None:
        self._fg_fed = time.monotonic_ns()
        feed(self, data)

    async def stamped_read(self: Any, *args: Any, **kw: Any) -> Any:
        out = await read(self, *args, **kw)
        if isinstance(out, list) and len(out) == 2 and isinstance(out[1], list):
            fed = getattr(self._reader, "_fg_fed", 0)
            for v in out[1]:
                st.arrived.setdefault(str(v).rpartition("=")[0], fed)
        return out

    asyncio.StreamWriter.writelines = stamped_write  # type: ignore[method-assign]
    AbstractConnection._read_response_from_parser = stamped_read  # type: ignore[method-assign]
    asyncio.StreamReader.feed_data = stamped_feed  # type: ignore[method-assign]


def segments(handoffs: Sequence[dict[str, int]]) -> dict[str, dict[str, float]]:
    """p50/p99/mean (µs) of every segment over ``handoffs``, each a dict of stamp name -> ns
    (``release``, ``sent``, ``replied`` of the releasing hold; ``woken``, ``start`` of the
    next); a hand-off missing a stamp is left out of the segments that need it (``n`` says how
    many counted)."""
    out: dict[str, dict[str, float]] = {}
    for name, (a, b) in SEGMENTS.items():
        vals = [(h[b] - h[a]) / 1e3 for h in handoffs if a in h and b in h]
        out[name] = {**percentiles(vals, (50, 99)), "mean": float(np.mean(vals)) if vals else 0.0}
        out[name]["n"] = float(len(vals))
    return out
