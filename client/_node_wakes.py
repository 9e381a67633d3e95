"""The wake listener on Redis Cluster: one pub/sub connection per node, whatever the gates.

On Cluster a blocking pop covers the lists of one slot only (a command's keys share a slot), so
:class:`~._wakes.WakeListeners` would hold one connection per gate in use. Here instead the
process subscribes (``SSUBSCRIBE``) to the shard channel named like each wake list
(``fg:{G}:wake:<pod_key>``, in the gate's slot), on one connection per node
(:class:`fleetgate._redis.shard_pubsub.ShardSubscriber`, which follows slot moves and failovers),
and a granting script ``SPUBLISH``-es the ids it hands this pod there, one message per call
(``lua/lib_wakes.lua``).

Lost-message safety: a script that finds nobody subscribed to the channel pushes onto the list
instead, so every wake sent while this process was not subscribed (before its first
subscription to the gate, between a slot move or a reconnect and the subscription again) waits
in the list, which is popped each time the channel is (re)subscribed. A wake published while
subscribed but lost on the way (the connection dropped with it in flight) is recovered by the
heartbeat, which reports granted waiters, within one renewal period: the bound of a killed wake
connection on standalone (``docs/failure-modes.md``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from fleetgate._redis import error_text
from fleetgate._redis.shard_pubsub import ShardSubscriber

from ._runtime import OUTAGE_ERRORS, Runtime

__all__ = ["NodeWakes"]

log = logging.getLogger("fleetgate.client")

# Ids popped at once from a wake list that filled while this process was not subscribed.
DRAIN_COUNT = 256


class NodeWakes:
    """Wake-ups by shard channel, one connection per Cluster node (see the module)."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        #: wake list (= its channel) -> callback of every id it brings
        self.keys: dict[str, Callable[[str], None]] = {}
        self.subscriber: ShardSubscriber | None = None

    @classmethod
    def on_cluster(cls, runtime: Runtime, block: float) -> NodeWakes | None:
        """The listener if ``runtime`` talks to a Redis Cluster, else None (lists and blocking
        pops, :class:`~._wakes.WakeListeners`). ``block``: seconds of silence on a node's
        connection before it is pinged."""
        wakes = cls(runtime)
        wakes.subscriber = runtime.scripts.redis.shard_subscriber(
            wakes.on_message,
            wakes.on_subscribed,
            ping_every=block,
            retry_after=min(1.0, runtime.heartbeat_interval),
        )
        return wakes if wakes.subscriber is not None else None

    def ensure(self, key: str, on_wake: Callable[[str], None]) -> None:
        """Listen on ``key`` (if not already), passing every id it brings to ``on_wake``."""
        known = key in self.keys
        self.keys[key] = on_wake
        if not known and self.subscriber is not None:
            self.subscriber.subscribe(key)

    def on_message(self, channel: str, data: str) -> None:
        """A granting script's message: the ids of one call, newline-separated."""
        on_wake = self.keys.get(channel)
        if on_wake is not None:
            for value in data.split("\n"):
                on_wake(value)

    def on_subscribed(self, channel: str) -> None:
        """Subscribed (again): wakes sent meanwhile went to the list; pop them."""
        self.runtime.spawn(self._drain(channel))

    async def _drain(self, key: str) -> None:
        rt = self.runtime
        try:
            while not rt.closing:
                values = await rt.redis.lpop(key, DRAIN_COUNT)
                on_wake = self.keys.get(key)
                if not values or on_wake is None:
                    return
                for value in values:
                    on_wake(str(value))
                if len(values) < DRAIN_COUNT:
                    return
        except OUTAGE_ERRORS as exc:
            # The heartbeat reports the grants among them; the next subscription pops again.
            log.debug("wake list %s not popped: %s", key, error_text(exc))
        except Exception as exc:
            rt.background_error("wake list pop", exc)

    def cancel_all(self) -> list[asyncio.Task[None]]:
        """Stop listening; returns the tasks to wait for."""
        self.keys.clear()
        return self.subscriber.close() if self.subscriber is not None else []
