"""The caller's side of one exchange: its request body and whether it is still there.

One task (:meth:`Inbound.run`) owns the ASGI ``receive`` for the whole exchange: it buffers the
body as it arrives (at most ``limit`` bytes: beyond, :attr:`Inbound.too_large`) and, once the
body is complete, keeps listening for ``http.disconnect``. So a caller that goes away is seen at
once in every phase -- queued for a permit, waiting for the upstream, streaming the response --
and the callbacks given to :meth:`Inbound.on_gone` run (they cancel what the exchange is doing).

While the request waits for a permit its body is buffered (bounded by ``limit``); once granted,
:meth:`Inbound.body` hands the buffer and then the rest, as it arrives, to the upstream.

A body that goes ``idle_s`` without a byte before it is complete is :attr:`Inbound.stalled`.
:attr:`Inbound.stop` is set the moment the exchange cannot go on because of the caller -- gone,
body too large, body stalled -- whatever phase it is in (queued, at the upstream), and
:meth:`Inbound.failure` says which.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

__all__ = ["BodyStalled", "BodyTooLarge", "ClientGone", "Inbound"]

Receive = Callable[[], Awaitable[dict[str, Any]]]


class ClientGone(Exception):
    """The caller disconnected."""


class BodyTooLarge(Exception):
    """The request body is larger than the proxy's ``max_request_bytes``."""


class BodyStalled(Exception):
    """No byte of the request body came for the proxy's ``body_timeout_s``."""


class Inbound:
    def __init__(self, receive: Receive, limit: int, idle_s: float = 30.0) -> None:
        self._receive = receive
        self.limit = limit
        self.idle_s = idle_s
        self.received = 0
        self.complete = False
        self.too_large = False
        self.stalled = False
        self.gone = asyncio.Event()
        self.stop = asyncio.Event()  # gone, too large or stalled: the exchange cannot go on
        self._chunks: deque[bytes] = deque()
        self._news = asyncio.Event()
        self._callbacks: list[Callable[[], None]] = []
        self._idle: asyncio.TimerHandle | None = None

    async def run(self) -> None:
        """Read the body, then wait for the disconnect (cancelled when the exchange ends)."""
        loop = asyncio.get_running_loop()
        self._idle = loop.call_later(self.idle_s, self._stall)
        try:
            while True:
                message = await self._receive()
                kind = message.get("type")
                if kind == "http.disconnect":
                    self._set_gone()
                    return
                if kind != "http.request" or self.complete or self.stop.is_set():
                    continue
                self._idle.cancel()
                self._take(message)
                if not (self.complete or self.stop.is_set()):  # the body's idle time anew
                    self._idle = loop.call_later(self.idle_s, self._stall)
                self._news.set()
        finally:
            self._idle.cancel()

    def _take(self, message: dict[str, Any]) -> None:
        chunk = message.get("body", b"")
        if chunk:
            self.received += len(chunk)
            if self.received > self.limit:
                self.too_large = True
                self._chunks.clear()
                self.stop.set()
            else:
                self._chunks.append(chunk)
        if not message.get("more_body", False):
            self.complete = True

    def _stall(self) -> None:
        if not (self.complete or self.stop.is_set()):
            self.stalled = True
            self.stop.set()
            self._news.set()

    def failure(self) -> Exception:
        """Why :attr:`stop` is set: :class:`ClientGone`, :class:`BodyTooLarge` or
        :class:`BodyStalled`."""
        if self.gone.is_set():
            return ClientGone()
        if self.too_large:
            return BodyTooLarge()
        return BodyStalled()

    def on_gone(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when the caller disconnects (at once if it has)."""
        if self.gone.is_set():
            callback()
        else:
            self._callbacks.append(callback)

    def _set_gone(self) -> None:
        self.gone.set()
        self.stop.set()
        self._news.set()
        callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb()

    async def read_all(self) -> bytes:
        """The whole body (for routing by the JSON ``model``); :class:`BodyTooLarge` or
        :class:`ClientGone` if it cannot be had. The bytes stay buffered for :meth:`body`."""
        while not (self.complete or self.stop.is_set()):
            self._news.clear()
            await self._news.wait()
        self._check()
        if len(self._chunks) > 1:
            whole = b"".join(self._chunks)
            self._chunks.clear()
            self._chunks.append(whole)
        return self._chunks[0] if self._chunks else b""

    def _check(self) -> None:
        if self.too_large:
            raise BodyTooLarge
        if self.stalled:
            raise BodyStalled
        if self.gone.is_set() and not self.complete:
            raise ClientGone

    async def body(self) -> AsyncIterator[bytes]:
        """The body for the upstream: what is buffered, then the rest as it arrives."""
        while True:
            self._check()
            while self._chunks:
                yield self._chunks.popleft()
                self._check()
            if self.complete:
                return
            self._news.clear()
            if not (self._chunks or self.complete or self.stop.is_set()):
                await self._news.wait()
