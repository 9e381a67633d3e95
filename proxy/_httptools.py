"""uvicorn's httptools protocol as the proxy serves with it (:class:`GuardedHttpTools`).

httptools is the ``fast`` extra's (its C parser costs a fraction of h11's per request): this
module imports it, so only :func:`~.server._http_protocol` imports this one, once httptools is
known to be installed.
"""

from __future__ import annotations

from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ._timeouts import HeadTimed, with_head_timeout

__all__ = ["GuardedHttpTools"]

_TOO_LARGE = b'{"error":{"type":"headers_too_large","message":"request head too large"}}'


class GuardedHttpTools(HeadTimed, HttpToolsProtocol):
    """uvicorn's httptools protocol, mended:

    * httptools has no limit on a request's head: one that grows past
      ``h11_max_incomplete_event_size`` before its end gets 431 and the connection closes
      (h11 would answer 400). Heads within it reach the app, which answers 431 above
      ``max_header_bytes`` with its JSON body.
    * A :class:`~._timeouts.HeadClock` bounds the time to a complete head
      (``head_timeout_s``; uvicorn bounds none of it).
    * After a head asking to upgrade (``Connection: upgrade``, ``Upgrade: h2c``, as
      ``curl --http2`` sends), httptools hands every following byte to the new protocol:
      the request's body was dropped. The proxy upgrades nothing, so such a connection is
      handed to uvicorn's h11 protocol, head and all, which serves it as plain HTTP/1.1 (the
      app drops the Upgrade headers).
    * Trailer fields of a chunked body are dropped, and every request cycle of a connection
      learns that its caller has gone (see :meth:`on_header`, :meth:`on_headers_complete`).
    """

    _head = 0
    _in_head = True
    _cycles: tuple[Any, ...] = ()  # the request cycles not yet answered (per connection)
    _upgrade = False
    _too_large = False

    def data_received(self, data: bytes) -> None:
        if self._too_large:
            return
        if self._in_head:
            self._head += len(data)
            self._count_head(data)
        # HttpToolsProtocol.data_received, but for the upgrade
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:  # the head asked to upgrade
            if self._upgrade:
                self._to_h11(data[exc.args[0] :] if exc.args else b"")
            return
        except httptools.HttpParserError:
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self.send_400_response(msg)
            return
        # checked once the parser has seen the bytes: a head that ended within them (its
        # body following in the same read) is no head too large
        limit = self.config.h11_max_incomplete_event_size or 1 << 20
        if self._in_head and self._head > limit:
            self._too_large = True
            self.transport.write(
                b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                b"content-type: application/json\r\nconnection: close\r\n"
                b"content-length: " + str(len(_TOO_LARGE)).encode() + b"\r\n\r\n" + _TOO_LARGE
            )
            self.transport.close()

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._in_head:
            super().on_header(name, value)
        # else a trailer field of a chunked body: uvicorn appended it to the request's
        # headers, which the app reads (and forwards) after the body; RFC 9110 6.5.1 says
        # trailers are not merged into the header section. The proxy drops them.

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_complete()
        if self.parser.should_upgrade():
            self._upgrade = True  # no cycle, no app: h11 starts over with this head
            return
        super().on_headers_complete()
        # uvicorn keeps only the newest cycle: a request pipelined behind one still running
        # replaced it, and on connection_lost only the newest learnt the caller had gone
        # (the first kept its permit and its upstream call until the upstream answered)
        open_cycles = (c for c in self._cycles if not c.response_complete)
        self._cycles = (*open_cycles, self.cycle)

    def connection_lost(self, exc: Exception | None) -> None:
        for cycle in self._cycles:
            if cycle is not self.cycle and not cycle.response_complete:
                cycle.disconnected = True
                cycle.message_event.set()
        self._cycles = ()
        super().connection_lost(exc)

    def on_body(self, body: bytes) -> None:
        if not self._upgrade:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._upgrade:
            return
        super().on_message_complete()
        self._in_head, self._head = True, 0
        if self.cycle.response_complete:  # answered before its body ended: a head is next
            self._wait_for_head()

    def on_response_complete(self) -> None:
        pipelined = bool(self.pipeline)  # super() starts the next one
        super().on_response_complete()
        if self._in_head and not pipelined:
            self._wait_for_head()

    def _wait_for_head(self) -> None:
        """Start the head's clock unless a pipelined request is already waiting."""
        if not self.pipeline:
            self._start_clock()

    def _to_h11(self, after_head: bytes) -> None:
        self._stop_clock()
        h11_class = with_head_timeout("h11", self.head_timeout_s)
        h11_protocol = h11_class(
            config=self.config, server_state=self.server_state, app_state=self.app_state
        )
        self.connections.discard(self)
        self._unset_keepalive_if_required()
        h11_protocol.connection_made(self.transport)
        self.transport.set_protocol(h11_protocol)
        # the head again (it follows a complete exchange, or none), then what came after it
        version = self.parser.get_http_version().encode("ascii")
        head = [self.parser.get_method(), b" ", self.url, b" HTTP/", version, b"\r\n"]
        for name, value in self.headers:
            head += [name, b": ", value, b"\r\n"]
        head.append(b"\r\n")
        h11_protocol.data_received(b"".join(head) + after_head)
