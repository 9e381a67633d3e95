"""The wake listeners: how a parked caller's process learns of its grant in one round trip.

A script that hands a slot to a parked caller pushes the caller's id onto the owner pod's wake
list of that gate (``fg:{G}:wake:<pod_key>``). Each process pops all its wake lists that one
blocking command can cover together -- every one of them on a standalone Redis (or Sentinel), the
ones of one slot on Cluster (:meth:`fleetgate._redis.RedisMode.slot_group`) -- with ONE blocking
``BLMPOP`` per group on a connection of its own, and hands each id to the callback of its list.
So a standalone pod has one wake connection whatever the number of gates.

A list added while the pop is blocked is covered from the next pop on: :meth:`ensure` pushes a
token onto the group's re-arm list (``fg:{G}:rearm:<pod_key>`` of the group's first gate, in the
group's slot), which is one of the popped keys, so the blocked pop returns at once and is sent
again with the new list. A wake pushed before that is not lost: the list keeps it until popped.
Listeners know nothing of gates beyond keys and callbacks.

On Redis Cluster a pop covers one slot's lists, so the wake-ups come by shard channel instead,
on one connection per node (:class:`~._node_wakes.NodeWakes`): :meth:`WakeListeners.ensure`
hands them over there.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from fleetgate._redis import error_text, prepare

from ._node_wakes import NodeWakes
from ._runtime import OUTAGE_ERRORS, Runtime

__all__ = ["WakeListeners"]

log = logging.getLogger("fleetgate.client")

# The re-arm list outlives a dead pod by this much at most (a live pod pops it at once).
REARM_TTL_MS = 60_000
# Wake lists per blocking pop: a pop is sent again after every wake, and costs O(lists) in the
# client (encoding) and the server (blocking on each key). 1,000 lists in one pop put ~4 ms on
# every hand-off (benchmarks/pod_cost.py, 1,000 gates); 64 keep it small, at one connection per
# 64 gates in use.
KEYS_PER_POP = 64
# Ids one pop takes from a wake list at most (a hand-off wakes at most 256 at once).
WAKES_PER_POP = 256


class _Group:
    """The wake lists one blocking pop covers, and its listener task."""

    def __init__(self, rearm_key: str) -> None:
        self.rearm_key = rearm_key
        #: wake list -> callback (insertion order; the pop rotates through it)
        self.keys: dict[str, Callable[[str], None]] = {}
        self.task: asyncio.Task[None] | None = None


class WakeListeners:
    """One wake listener per pop group of the process (standalone: one), started on the first
    park."""

    def __init__(self, runtime: Runtime, block: float) -> None:
        self.runtime = runtime
        #: seconds one blocking pop waits before it is sent again
        self.block = block
        self.groups: dict[tuple[int, int], _Group] = {}
        #: gate -> the wake list it listens on (what ensure() was asked for)
        self.gates: dict[str, str] = {}
        # wake list -> its group, for ensure()'s fast path (every park asks again)
        self._group_by_key: dict[str, _Group] = {}
        # Cluster: the wake-ups by shard channel (None: lists; see _node_wakes), once known
        self._nodes: NodeWakes | None = None
        self._mode_known = False

    @property
    def tasks(self) -> dict[tuple[int, int], asyncio.Task[None]]:
        """The running listener tasks, by pop group."""
        return {k: g.task for k, g in self.groups.items() if g.task is not None}

    def ensure(self, gate: str, key: str, on_wake: Callable[[str], None], rearm_key: str) -> None:
        """Listen on ``key`` for ``gate`` (if not already), passing every popped id to
        ``on_wake``. ``rearm_key`` is the re-arm list in ``key``'s slot, used if ``key`` starts
        a new group."""
        nodes = self._node_wakes()
        if nodes is not None:
            nodes.ensure(key, on_wake)
            self.gates[gate] = key
            return
        group = self._group_by_key.get(key)
        if group is not None and group.task is not None and not group.task.done():
            group.keys[key] = on_wake  # listened on already
            self.gates[gate] = key
            return
        group_id = self._group_of(key)
        group = self.groups.get(group_id)
        if group is None:
            group = self.groups[group_id] = _Group(rearm_key)
        added = key not in group.keys
        group.keys[key] = on_wake
        self._group_by_key[key] = group
        self.gates[gate] = key
        if group.task is None or group.task.done():
            group.task = asyncio.create_task(
                self._listen(group), name=f"fleetgate-wake-{group_id[0]}-{group_id[1]}"
            )
        elif added:
            self.runtime.spawn(self._rearm(group))

    def _node_wakes(self) -> NodeWakes | None:
        if not self._mode_known:
            self._nodes = NodeWakes.on_cluster(self.runtime, self.block)
            self._mode_known = True
        return self._nodes

    def _group_of(self, key: str) -> tuple[int, int]:
        """The pop group of ``key``: its slot group, then a listener of at most
        :data:`KEYS_PER_POP` lists (the one it is in, else the first with room)."""
        slot = self.runtime.scripts.redis.slot_group(key)
        n = 0
        while True:
            group = self.groups.get((slot, n))
            if group is None or key in group.keys or len(group.keys) < KEYS_PER_POP:
                return (slot, n)
            n += 1

    def cancel_all(self) -> list[asyncio.Task[None]]:
        """Cancel every listener; returns the tasks to wait for."""
        tasks = [g.task for g in self.groups.values() if g.task is not None]
        for t in tasks:
            t.cancel()
        if self._nodes is not None:
            tasks += self._nodes.cancel_all()
        self._nodes, self._mode_known = None, False
        self.groups.clear()
        self.gates.clear()
        self._group_by_key.clear()
        return tasks

    async def _rearm(self, group: _Group) -> None:
        """Make the group's blocked pop return so it is sent again with the new list."""
        rt = self.runtime
        try:
            async with rt.redis.pipeline(transaction=False) as pipe:
                pipe.rpush(group.rearm_key, "1")
                pipe.pexpire(group.rearm_key, REARM_TTL_MS)
                await pipe.execute()
        except OUTAGE_ERRORS as exc:
            # The listener itself meets the outage, reconnects and pops with every key; the
            # heartbeat recovers grants meanwhile.
            log.debug("wake re-arm failed: %s", error_text(exc))
        except Exception as exc:
            rt.background_error("wake re-arm", exc)

    async def _listen(self, group: _Group) -> None:
        # A blocking pop must never be cancelled on a shared connection (redis-py would hand a
        # late reply to the next command), so each listener owns its connection and drops it
        # on exit. Lost wake-ups (connection killed, Redis restarted) are recovered by the
        # heartbeat, which reports granted waiters.
        rt = self.runtime
        conn = rt.dedicated_client(socket_timeout=self.block + 3.0)
        turn = 0
        try:
            await prepare(conn)
            while not rt.closing:
                keys = list(group.keys)
                # The pop serves the first non-empty key: start at a different one each time so
                # a busy gate cannot starve the others' wake-ups.
                turn = (turn + 1) % len(keys)
                order = keys[turn:] + keys[:turn] + [group.rearm_key]
                try:
                    # BLMPOP (Redis >= 7.0): every id waiting in the first non-empty list, in one
                    # reply, so a hand-off of several of this pod's waiters wakes them together.
                    item = await conn.blmpop(
                        self.block, len(order), *order, direction="LEFT", count=WAKES_PER_POP
                    )
                except Exception as exc:  # never ends: the heartbeat covers the gap
                    if rt.closing:
                        break
                    if isinstance(exc, OUTAGE_ERRORS):
                        log.debug("wake listener error %s; reconnecting", error_text(exc))
                    else:
                        rt.background_error("wake listener", exc)
                    await asyncio.sleep(min(1.0, rt.heartbeat_interval))
                    continue
                if item is None:
                    continue
                key, values = str(item[0]), item[1]
                on_wake = group.keys.get(key)
                if on_wake is not None:
                    for value in values:
                        on_wake(str(value))
                    # Let the woken caller run before the pop over every list is sent again
                    # (encoding n keys is on no caller's path then).
                    await asyncio.sleep(0)
        finally:
            await conn.aclose()
