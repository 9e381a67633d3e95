"""Script calls as values: one gate's call with its KEYS, ARGV and reply decoder
(:class:`ScriptCall`), several gates' heartbeats in one call (:class:`ManyHeartbeats`), how
heartbeats are grouped into calls (:func:`heartbeat_chunks`) and calls into rounds of one
pipeline per node (:func:`heartbeat_rounds`). Each is a
:data:`fleetgate._redis.BatchCall`: issued alone, or batched with others."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, Generic, TypeVar

from fleetgate._redis import RedisMode
from fleetgate.keys import GateKeys

from ._argv import HeartbeatRequest, heartbeat_many_argv

_R = TypeVar("_R")


class ScriptCall(Generic[_R]):
    """One script call with its arguments encoded and its reply decoder: awaited alone by
    :class:`GateScripts`, or batched with others by :meth:`GateScripts.batch`."""

    __slots__ = ("args", "decode", "key_names", "keys", "script")

    def __init__(
        self,
        script: Any,
        keys: GateKeys,
        args: list[Any],
        decode: Callable[[Any], _R],
        key_names: list[str],
    ) -> None:
        self.script = script
        self.keys = keys
        self.args = args
        self.decode = decode
        #: the KEYS sent (RedisMode.script_keys)
        self.key_names = key_names

    def __call__(self, client: Any) -> Any:
        """Issue the call on ``client`` (a client, or a pipeline it queues itself on)."""
        return self.script(keys=self.key_names, args=self.args, client=client)


class ManyHeartbeats:
    """One heartbeat_many.lua call for several gates of one slot (a :data:`BatchCall`)."""

    __slots__ = ("args", "keys", "script")

    def __init__(self, script: Any, requests: Sequence[HeartbeatRequest], mode: RedisMode) -> None:
        self.script = script
        # The gates' base names first (the script reads gate j's at KEYS[j]), then, on Cluster,
        # every gate's declared keys (see RedisMode.script_keys). Declared keys laid end to end
        # put gate 2's name at KEYS[1 + 17], not KEYS[2]: gate 2 was renewed on keys derived
        # from gate 1's second key, its real lease expired while held.
        self.keys: list[str] = [req.keys.base for req in requests]
        if mode.cluster:
            for req in requests:
                self.keys += mode.script_keys(req.keys)
        self.args: list[Any] = heartbeat_many_argv(requests)

    def __call__(self, client: Any) -> Any:
        """Issue the call on ``client`` (a client, or a pipeline it queues itself on)."""
        return self.script(keys=self.keys, args=self.args, client=client)


def heartbeat_chunks(
    slots: Sequence[int], costs: Sequence[int], units: int
) -> tuple[list[list[int]], list[list[int]]]:
    """The heartbeats ``0 .. n-1`` (of slot group ``slots[i]``, weighing ``costs[i]``: see
    :meth:`HeartbeatRequest.units`) grouped into calls: the gates of one slot group in order,
    a new call whenever the next gate would take a call past ``units``. Returns the calls of one
    gate (plain heartbeat.lua calls) and the calls of several (heartbeat_many.lua)."""
    groups: dict[int, list[int]] = {}
    for i, slot in enumerate(slots):
        groups.setdefault(slot, []).append(i)
    chunks: list[list[int]] = []
    for members in groups.values():
        chunk: list[int] = []
        load = 0
        for i in members:
            if chunk and load + costs[i] > units:
                chunks.append(chunk)
                chunk, load = [], 0
            chunk.append(i)
            load += costs[i]
        chunks.append(chunk)
    return [c for c in chunks if len(c) == 1], [c for c in chunks if len(c) > 1]


def heartbeat_rounds(
    nodes: Sequence[Hashable], costs: Sequence[int], units: int
) -> list[list[int]]:
    """The calls ``0 .. n-1`` (to node ``nodes[i]``, weighing ``costs[i]`` units) grouped into
    rounds sent one after the other, each round one pipeline per node of at most ``units`` (a
    call heavier than that alone), in call order per node: Redis runs a pipeline's scripts back
    to back, so a node's pipeline keeps about one heartbeat_many call's server time and a
    hand-off arriving meanwhile waits no longer than behind one such call."""
    per_node: dict[Hashable, list[list[int]]] = {}
    loads: dict[Hashable, int] = {}
    for i, node in enumerate(nodes):
        chunks = per_node.setdefault(node, [[]])
        if chunks[-1] and loads[node] + costs[i] > units:
            chunks.append([])
            loads[node] = 0
        chunks[-1].append(i)
        loads[node] = loads.get(node, 0) + costs[i]
    depth = max((len(c) for c in per_node.values()), default=0)
    return [
        [i for chunks in per_node.values() if k < len(chunks) for i in chunks[k]]
        for k in range(depth)
    ]
