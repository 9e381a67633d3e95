"""The time a connection has to send a request's head (``head_timeout_s``).

uvicorn bounds none of it: its ``timeout_keep_alive`` starts only after a response (a fresh
connection that sends nothing stays open for ever) and stops at the first byte (a head
trickled a byte at a time stays open as long as the bytes come), on both parsers; neither h11
nor httptools has a time option. So each connection has a :class:`HeadClock`: started when the
connection opens and when an answer ends on a kept-alive one, stopped when a head is complete.
When it runs out, a connection that sent part of a head gets 408 (RFC 9110 15.5.9, with
``Connection: close``) and one line in the log; one that sent nothing is closed without an
answer (there is no request to answer), logged once if it never sent a request at all (an
idle kept-alive connection closing is routine: not logged). Both parsers' protocols get the
clock from one mixin, :class:`HeadTimed`: :class:`GuardedH11` here, and
:class:`~._httptools.GuardedHttpTools`.

The body's time (``body_timeout_s``) is the app's (:class:`~._inbound.Inbound`): it can answer
408 with the exchange's JSON error in whatever phase the request is.
"""

from __future__ import annotations

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["GuardedH11", "HeadClock", "HeadTimed", "with_head_timeout"]

log = logging.getLogger("fleetgate.proxy")

_BODY = b'{"error":{"type":"head_timeout","message":"the request head did not arrive in time"}}'
ANSWER_408 = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"content-length: " + str(len(_BODY)).encode() + b"\r\n\r\n" + _BODY
)


class HeadClock:
    """One connection's time to send a request's head (see the module's docstring)."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, transport: asyncio.Transport, seconds: float
    ) -> None:
        self.loop = loop
        self.transport = transport
        self.seconds = seconds
        self.seen = 0  # bytes received since the clock started
        self.served = False  # a request was read on this connection
        self._timer: asyncio.TimerHandle | None = None

    @property
    def running(self) -> bool:
        return self._timer is not None

    def start(self) -> None:
        self.stop()
        self.seen = 0
        if not self.transport.is_closing():
            self._timer = self.loop.call_later(self.seconds, self._expired)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def head_complete(self) -> None:
        self.stop()
        self.served = True

    def _expired(self) -> None:
        self._timer = None
        transport = self.transport
        if transport.is_closing():
            return
        peer = transport.get_extra_info("peername")
        who = peer[0] if isinstance(peer, tuple) and peer else "-"
        if self.seen:
            log.info(
                "proxy: %s: no complete request head within %g s (head_timeout_s): 408, "
                "connection closed",
                who,
                self.seconds,
            )
            transport.write(ANSWER_408)
        elif not self.served:
            log.info(
                "proxy: %s: no request within %g s of connecting (head_timeout_s): "
                "connection closed",
                who,
                self.seconds,
            )
        transport.close()


class HeadTimed(asyncio.Protocol):
    """The :class:`HeadClock` of a uvicorn HTTP protocol (mixed in before it): made and
    started when the connection opens, stopped when it is lost. The protocol says when a head
    is awaited (:meth:`_start_clock`), arrives (:meth:`_count_head`) and is complete
    (:meth:`_head_complete`)."""

    head_timeout_s = 30.0
    _clock: HeadClock | None = None
    loop: asyncio.AbstractEventLoop  # the protocol's

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._clock = HeadClock(self.loop, transport, self.head_timeout_s)
        self._clock.start()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_clock()
        super().connection_lost(exc)

    def _start_clock(self) -> None:
        if self._clock is not None:
            self._clock.start()

    def _stop_clock(self) -> None:
        if self._clock is not None:
            self._clock.stop()

    def _count_head(self, data: bytes) -> None:
        """``data`` came while the clock runs: part of a head (408 if it expires now)."""
        clock = self._clock
        if clock is not None and clock.running:
            clock.seen += len(data)

    def _head_complete(self) -> None:
        if self._clock is not None:
            self._clock.head_complete()


class GuardedH11(HeadTimed, H11Protocol):
    """uvicorn's h11 protocol with a :class:`HeadClock`: running while h11 waits for a
    request (its peer's state IDLE)."""

    def data_received(self, data: bytes) -> None:
        self._count_head(data)
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()

    def _follow(self) -> None:
        """Run the clock exactly while h11 waits for a request's head."""
        clock = self._clock
        if clock is None:
            return
        waiting = self.conn.their_state is h11.IDLE and self.conn.our_state is h11.IDLE
        if waiting and not clock.running:
            clock.start()
        elif not waiting and clock.running:
            clock.head_complete()


def with_head_timeout(protocol: type[asyncio.Protocol] | str, seconds: float) -> type:
    """The protocol class to serve with: ``protocol`` (uvicorn's ``"h11"`` or a class with a
    ``head_timeout_s``) with ``head_timeout_s = seconds``."""
    base = GuardedH11 if protocol == "h11" else protocol
    assert isinstance(base, type) and hasattr(base, "head_timeout_s"), base
    return type(base.__name__, (base,), {"head_timeout_s": seconds})
