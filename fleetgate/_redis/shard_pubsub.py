"""Shard channels of a Redis Cluster on one connection per node: :class:`ShardSubscriber`.

``SSUBSCRIBE`` (Redis 7) subscribes a connection to channels of one slot, on the node serving
that slot; ``SPUBLISH`` from a script in the slot reaches it. A subscriber here holds one plain
connection per node it has channels on (whatever the number of channels), routes each channel to
the node the cluster client's slot map names, and follows the slot: a ``MOVED`` reply to a
subscription, a ``sunsubscribe`` the server sends when the slot leaves the node (Redis drops
the shard channels of a migrated slot), a node that stops answering, or a slot map that now
names another node (checked on every idle tick) move the channel to its new owner.

Messages are fire-and-forget: none is replayed after a reconnect or a move. The caller is told
when a channel is subscribed (``on_subscribed``), every time, so it can catch up on what it
missed in the meantime (the wake-ups: each script that finds nobody subscribed pushes onto a
list of the same name, popped then; the heartbeat recovers the rest).

Why plain connections per node instead of redis-py's cluster pub/sub: redis-py's asyncio cluster
client gained shard channels only recently (``ClusterPubSub`` in 8.x: a pubsub object and reader
per node behind a shared lock, re-subscribing by itself), fleetgate supports ``redis>=5.0.1``,
and what is needed is small and easier to hold exact here: three commands on connections this
module owns, replies read by one task per node, and every lost-message case sent to one
callback. The connections are made with the cluster client's own node settings (TLS, user,
password, client name), so nothing is configured twice.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import MovedError, RedisClusterException, ResponseError

from fleetgate._redis.outage import error_text

__all__ = ["ShardSubscriber"]

log = logging.getLogger("fleetgate.redis")

# (channel, message) of every message received
OnMessage = Callable[[str, str], None]
# a channel is subscribed (again): messages published from now on reach on_message
OnSubscribed = Callable[[str], None]


class _NodeLink:
    """The connection to one node and the channels routed to it; one task reads its replies."""

    def __init__(self, owner: ShardSubscriber, name: str, host: str, port: int) -> None:
        self.owner = owner
        self.name = name
        self.host = host
        self.port = port
        #: channels routed to this node (wanted here)
        self.channels: set[str] = set()
        #: channels the server confirmed on the current connection
        self.live: set[str] = set()
        #: SSUBSCRIBE sent, reply not read yet (replies come in order)
        self.pending: deque[str] = deque()
        #: SUNSUBSCRIBE sent by us (a channel moving away): its reply is not a slot move
        self.leaving: set[str] = set()
        self.conn: Any = None
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(self._run(), name=f"fleetgate-shard-sub-{self.name}")

    def add(self, channel: str) -> None:
        self.channels.add(channel)
        self.start()
        if self.conn is not None:
            self._send("SSUBSCRIBE", channel)

    def drop(self, channel: str) -> None:
        """Stop routing ``channel`` here (it moves to another node)."""
        self.channels.discard(channel)
        if channel in self.live and self.conn is not None:
            self.live.discard(channel)
            self.leaving.add(channel)
            self._send("SUNSUBSCRIBE", channel)

    def _send(self, *args: str) -> None:
        conn = self.conn
        if args[0] == "SSUBSCRIBE":
            self.pending.append(args[1])
        try:
            # One command is written whole before the write's drain is awaited, so writes of
            # concurrent callers never interleave; a failed write fails the reader too.
            conn._writer.writelines(conn.pack_command(*args))
        except (AttributeError, OSError, RuntimeError) as exc:
            log.debug("shard channel %s on %s: write failed: %s", args, self.name, exc)

    async def _run(self) -> None:
        owner = self.owner
        while not owner.closed:
            conn = None
            try:
                conn = owner.new_connection(self.host, self.port)
                await conn.connect()
                self.conn = conn
                for channel in sorted(self.channels):
                    self._send("SSUBSCRIBE", channel)
                await self._read(conn)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not owner.closed:
                    log.debug("shard subscriber %s: %s; reconnecting", self.name, error_text(exc))
            finally:
                self.conn = None
                self.live.clear()
                self.pending.clear()
                self.leaving.clear()
                if conn is not None:
                    await conn.disconnect()
            if owner.closed:
                break
            await asyncio.sleep(owner.retry_after)
            owner.reroute(self)
            if not self.channels:  # a node nobody is routed to any more (failed over)
                if owner.links.get(self.name) is self:
                    del owner.links[self.name]
                return

    async def _read(self, conn: Any) -> None:
        owner = self.owner
        pinged = False
        while not owner.closed:
            try:
                reply = await conn.read_response(timeout=owner.ping_every, push_request=True)
            except ResponseError as exc:
                self._refused(exc)
                continue
            if reply is None:  # idle: is the node still there, is it still the owner?
                if pinged:
                    raise ConnectionError(f"no reply from {self.name} to PING")
                pinged = True
                conn._writer.writelines(conn.pack_command("PING"))
                owner.reroute(self)
                continue
            pinged = False
            self._reply(reply)

    def _reply(self, reply: Any) -> None:
        if not isinstance(reply, list) or len(reply) < 3:
            return  # a PONG
        kind, channel, data = (_text(x) for x in reply[:3])
        owner = self.owner
        if kind == "smessage":
            owner.on_message(channel, data)
        elif kind == "ssubscribe":
            if self.pending and self.pending[0] == channel:
                self.pending.popleft()
            if channel in self.channels:
                self.live.add(channel)
                owner.on_subscribed(channel)
            else:  # moved away while the subscription was on its way
                self.leaving.add(channel)
                self._send("SUNSUBSCRIBE", channel)
        elif kind == "sunsubscribe":
            self.live.discard(channel)
            if channel in self.leaving:
                self.leaving.discard(channel)
            elif channel in self.channels:
                # The server dropped it: its slot left this node. Ask again: the owner
                # answers, a stale map's node says MOVED.
                self.channels.discard(channel)
                owner.route(channel)

    def _refused(self, exc: ResponseError) -> None:
        """An error reply: to the oldest subscription in flight (the only command that fails)."""
        if not self.pending:
            log.debug("shard subscriber %s: %s", self.name, exc)
            return
        channel = self.pending.popleft()
        if channel not in self.channels:
            return
        self.channels.discard(channel)
        if isinstance(exc, MovedError):
            self.owner.route(channel, (exc.host, int(exc.port)))
        else:  # CLUSTERDOWN, NOPERM, ...: tried again after a pause
            log.warning("SSUBSCRIBE %s on %s refused: %s", channel, self.name, exc)
            self.owner.route_later(channel)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class ShardSubscriber:
    """Shard channels of a Redis Cluster over one connection per node (see the module)."""

    def __init__(
        self,
        client: Any,
        on_message: OnMessage,
        on_subscribed: OnSubscribed,
        *,
        ping_every: float,
        retry_after: float,
    ) -> None:
        #: the cluster client whose slot map and node settings are used
        self.client = client
        self.on_message = on_message
        self.on_subscribed = on_subscribed
        #: seconds without a reply before a PING (twice that without one: reconnect)
        self.ping_every = ping_every
        #: seconds between a failed connection and the next try
        self.retry_after = retry_after
        self.closed = False
        self.links: dict[str, _NodeLink] = {}
        self._later: set[asyncio.Task[None]] = set()

    def subscribe(self, channel: str) -> None:
        """Subscribe ``channel`` on the node serving its slot (if not already); returns at
        once, ``on_subscribed(channel)`` follows when the server confirms."""
        if not any(channel in link.channels for link in self.links.values()):
            self.route(channel)

    def route(self, channel: str, address: tuple[str, int] | None = None) -> None:
        """Send ``channel`` to ``address`` (a MOVED reply's), else to its slot's node as the
        cluster client's map has it (no map yet: tried again later)."""
        if self.closed:
            return
        if address is None:
            address = self._owner(channel)
            if address is None:
                self.route_later(channel)
                return
        host, port = address
        name = f"{host}:{port}"
        link = self.links.get(name)
        if link is None:
            link = self.links[name] = _NodeLink(self, name, host, port)
        link.add(channel)

    def route_later(self, channel: str) -> None:
        async def later() -> None:
            await asyncio.sleep(self.retry_after)
            self.route(channel)

        task = asyncio.create_task(later())
        self._later.add(task)
        task.add_done_callback(self._later.discard)

    def reroute(self, link: _NodeLink) -> None:
        """Move the channels of ``link`` whose slot the cluster client's map gives another node."""
        for channel in list(link.channels):
            address = self._owner(channel)
            if address is not None and f"{address[0]}:{address[1]}" != link.name:
                link.drop(channel)
                self.route(channel, address)

    def _owner(self, channel: str) -> tuple[str, int] | None:
        try:
            node = self.client.get_node_from_key(channel)
        except (RedisClusterException, AttributeError, KeyError, IndexError):
            return None
        return None if node is None else (node.host, int(node.port))

    def new_connection(self, host: str, port: int) -> Any:
        """A connection to ``host:port`` with the cluster client's node settings, no retries
        and no read timeout (a subscriber waits; :meth:`_NodeLink._read` pings)."""
        nodes = self.client.get_nodes()
        if not nodes:
            raise ConnectionError("no Redis Cluster node known yet")
        node = nodes[0]
        kwargs = {
            **node.connection_kwargs,
            "host": host,
            "port": port,
            "retry": Retry(NoBackoff(), 0),
            "socket_timeout": None,
        }
        return node.connection_class(**kwargs)

    def channels_by_node(self) -> dict[str, set[str]]:
        """The channels confirmed on each node's connection (for tests and status)."""
        return {name: set(link.live) for name, link in self.links.items() if link.live}

    @property
    def tasks(self) -> list[asyncio.Task[None]]:
        """The running reader tasks, one per node."""
        return [link.task for link in self.links.values() if link.task and not link.task.done()]

    def close(self) -> list[asyncio.Task[None]]:
        """Stop every reader (each closes its connection); returns the tasks to wait for."""
        self.closed = True
        tasks = [*self.tasks, *self._later]
        for task in tasks:
            task.cancel()
        self.links.clear()
        return tasks
