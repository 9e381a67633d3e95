"""A proxy in front of a real Redis that refuses commands of more than ``cap`` arguments, as
ElastiCache Serverless refuses requests of more than 3,999, and records the largest it saw.

It runs on the test's event loop. Each command is read whole (a RESP array of bulk strings, as
redis-py sends them); one within the cap is forwarded as it came, one beyond it is replaced by
a script that answers an error reply, so its reply keeps its place among a pipeline's::

    async with ArgCapProxy(redis_port, cap=3999) as proxy:
        ...  # clients use proxy.url
        assert proxy.largest <= 3999
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

__all__ = ["REFUSAL", "ArgCapProxy"]

REFUSAL = "ERR request has too many arguments"
_REFUSE = b'return redis.error_reply("' + REFUSAL.encode() + b'")'
_REFUSE_CMD = b"*3\r\n$4\r\nEVAL\r\n$%d\r\n%s\r\n$1\r\n0\r\n" % (len(_REFUSE), _REFUSE)


class ArgCapProxy:
    """Forwards to ``127.0.0.1:upstream_port``; ``largest``: the most arguments of one command
    seen (refused ones included); ``refused``: how many were refused."""

    def __init__(self, upstream_port: int, cap: int) -> None:
        self.upstream_port = upstream_port
        self.cap = cap
        self.largest = 0
        self.refused = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def url(self) -> str:
        assert self._server is not None
        port = self._server.sockets[0].getsockname()[1]
        return f"redis://127.0.0.1:{port}/0"

    async def __aenter__(self) -> ArgCapProxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        me = asyncio.current_task()
        assert me is not None
        self._tasks.add(me)
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        back = asyncio.create_task(self._pump(up_reader, writer))
        self._tasks.add(back)
        try:
            while True:
                command = await self._command(reader)
                if command is None:
                    break
                up_writer.write(command)
                await up_writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            back.cancel()
            self._tasks.discard(back)
            self._tasks.discard(me)
            for w in (up_writer, writer):
                w.close()
                with contextlib.suppress(ConnectionError):
                    await w.wait_closed()

    async def _command(self, reader: asyncio.StreamReader) -> bytes | None:
        """One command's bytes as forwarded (the refusal's for one beyond the cap)."""
        head = await reader.readline()
        if not head:
            return None
        assert head.startswith(b"*"), head  # redis-py sends every command as an array
        argc = int(head[1:])
        parts = [head]
        for _ in range(argc):
            size = await reader.readline()
            parts += (size, await reader.readexactly(int(size[1:]) + 2))
        self.largest = max(self.largest, argc)
        if argc > self.cap:
            self.refused += 1
            return _REFUSE_CMD
        return b"".join(parts)

    @staticmethod
    async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
