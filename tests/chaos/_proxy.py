"""A small asyncio TCP proxy between clients and Redis that a test can cut and heal.

It runs its own event loop on a background thread, so a synchronous test (or one on another
loop) drives it with plain method calls::

    with TcpProxy("127.0.0.1", redis_port) as proxy:
        url = proxy.url            # give this to the clients instead of Redis' own address
        proxy.sever()              # every connection reset, new ones refused (ECONNREFUSED)
        proxy.sever("blackhole")   # connections stay open but nothing passes (timeouts)
        proxy.heal()               # new connections are forwarded again

Only loopback addresses are used: the proxy listens on 127.0.0.1 and forwards to the upstream
the test names (a Redis the test started).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from collections.abc import Coroutine
from typing import Any, Literal

__all__ = ["TcpProxy"]

Mode = Literal["reset", "blackhole"]


def _rst(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST (SO_LINGER 0), as a cut link or a killed peer looks."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.close()


class _Pair:
    def __init__(self, client: asyncio.StreamWriter, upstream: asyncio.StreamWriter) -> None:
        self.client = client
        self.upstream = upstream
        self.tasks: list[asyncio.Task[None]] = []
        self.blackholed = False

    def reset(self) -> None:
        for t in self.tasks:
            t.cancel()
        _rst(self.client)
        _rst(self.upstream)


class TcpProxy:
    """Forward 127.0.0.1:<port> to ``upstream_host:upstream_port`` until severed."""

    def __init__(self, upstream_host: str, upstream_port: int, port: int = 0) -> None:
        if upstream_host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError("the chaos proxy only forwards to loopback addresses")
        self.upstream = (upstream_host, upstream_port)
        # Bound here, so the port is known (and ours) before the loop starts.
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", port))
        self.port: int = self._sock.getsockname()[1]
        self.state: Literal["open", "reset", "blackhole"] = "open"
        self.accepted = 0
        self.severed = 0
        self._pairs: set[_Pair] = set()
        self._held: set[asyncio.StreamWriter] = set()  # blackholed newcomers
        self._server: asyncio.Server | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="chaos-proxy")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    # -- lifecycle (any thread) ----------------------------------------------------------------

    def start(self) -> TcpProxy:
        self._thread.start()
        self._call(self._listen(self._sock))
        return self

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        self._call(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- faults (any thread) -------------------------------------------------------------------

    def sever(self, mode: Mode = "reset") -> int:
        """Cut the link. ``reset``: every connection gets an RST and new ones are refused.
        ``blackhole``: connections stay open, bytes are dropped both ways, newcomers are
        accepted and left hanging (clients see timeouts). Returns the connections affected."""
        return self._call(self._sever(mode))

    def heal(self) -> None:
        """Forward again: blackholed connections are reset (their peers timed out anyway)."""
        self._call(self._heal())

    def kill_all(self) -> int:
        """Reset every current connection but keep accepting (a one-off connection storm)."""
        return self._call(self._kill_all())

    @property
    def active(self) -> int:
        return len(self._pairs)

    # -- the loop side -------------------------------------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _listen(self, sock: socket.socket | None = None) -> None:
        if sock is None:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", self.port))
        self._server = await asyncio.start_server(self._handle, sock=sock, backlog=512)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        if self.state == "blackhole":
            self._held.add(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            _rst(writer)
            return
        if self.state != "open":  # severed while we were connecting upstream
            _rst(writer)
            _rst(up_writer)
            return
        pair = _Pair(writer, up_writer)
        self._pairs.add(pair)
        pair.tasks = [
            asyncio.ensure_future(self._pump(reader, up_writer, pair)),
            asyncio.ensure_future(self._pump(up_reader, writer, pair)),
        ]

    async def _pump(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, pair: _Pair
    ) -> None:
        try:
            while True:
                data = await src.read(65536)
                if not data:
                    break
                if pair.blackholed:
                    continue  # dropped on the floor, like a partitioned link
                dst.write(data)
                await dst.drain()
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            if not pair.blackholed and pair in self._pairs:
                self._pairs.discard(pair)
                for t in pair.tasks:
                    if t is not asyncio.current_task():
                        t.cancel()
                for w in (pair.client, pair.upstream):
                    w.close()

    async def _stop_listening(self) -> None:
        # close() alone: from Python 3.12 on, wait_closed() also waits for every accepted
        # connection, which the caller resets itself.
        if self._server is not None:
            self._server.close()
            self._server = None

    async def _kill_all(self) -> int:
        pairs = list(self._pairs)
        self._pairs.clear()
        for p in pairs:
            p.reset()
        return len(pairs)

    async def _sever(self, mode: Mode) -> int:
        self.severed += 1
        if mode == "reset":
            self.state = "reset"  # a connection racing in is reset by _handle
            await self._stop_listening()  # new connections: ECONNREFUSED
            return await self._kill_all()
        self.state = "blackhole"
        for p in self._pairs:
            p.blackholed = True
        return len(self._pairs)

    async def _heal(self) -> None:
        for w in list(self._held):
            _rst(w)
        self._held.clear()
        for p in [p for p in self._pairs if p.blackholed]:
            self._pairs.discard(p)
            p.reset()
        self.state = "open"
        if self._server is None:
            await self._listen()

    async def _shutdown(self) -> None:
        await self._stop_listening()
        await self._kill_all()
        for w in list(self._held):
            _rst(w)
        self._held.clear()
        await asyncio.sleep(0)
