"""The proxy's own answers, as opposed to the upstream's: its JSON errors with the headers a
caller's client acts on, and its plain bodies (health, metrics).

:func:`send_plain` writes one whole response, dated (:func:`http_date`) and sized. The errors
(:class:`Answers`) have the body ``{"error": {"type", "message", "gate", "retry_after_s"}}``
and, as the case asks, ``Retry-After``, ``x-should-retry`` (the openai SDK's),
``x-fleetgate-gate`` and ``Connection: close``; each records its status and a note on the
exchange for the access log.
"""

from __future__ import annotations

import email.utils
import logging
import time
from typing import Any

import msgspec

from fleetgate.client import DeadlineExceeded, Overloaded
from fleetgate.errors import ConfigError, FleetgateError

from ._checks import too_large_message
from ._exchange import Exchange, Send
from ._inbound import BodyTooLarge, BuffersFull, ClientGone
from .config import ProxySettings
from .metrics import ProxyMetrics
from .policy import retry_after

log = logging.getLogger("fleetgate.proxy")

__all__ = ["CLIENT_CLOSED", "ENCODER", "Answers", "http_date", "send_plain"]

# the status logged and counted for a caller that went away (nginx's convention; never sent)
CLIENT_CLOSED = 499
ENCODER = msgspec.json.Encoder()

_date: tuple[int, bytes] = (0, b"")


def http_date() -> bytes:
    """The ``Date`` of the proxy's own answers (and of upstream answers without one): RFC 9110
    6.6.1; uvicorn's is off, it added a second ``Date`` to every upstream answer."""
    global _date
    now = int(time.time())
    if _date[0] != now:
        _date = (now, email.utils.formatdate(now, usegmt=True).encode("ascii"))
    return _date[1]


async def send_plain(
    send: Send,
    status: int,
    body: bytes,
    content_type: str,
    extra: list[tuple[bytes, bytes]] | None = None,
) -> None:
    """One whole response: ``Date``, ``Content-Type``, ``Content-Length``, then ``extra``."""
    headers = [
        (b"date", http_date()),
        (b"content-type", content_type.encode("latin-1")),
        (b"content-length", str(len(body)).encode()),
        *(extra or []),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class Answers:
    """The proxy's errors, with the settings their messages name and the metrics they count."""

    def __init__(self, settings: ProxySettings, metrics: ProxyMetrics) -> None:
        self.settings = settings
        self.metrics = metrics

    @staticmethod
    async def error(
        ex: Exchange,
        status: int,
        kind: str,
        message: str,
        *,
        gate: str | None = None,
        retry_after_s: int | None = None,
        retry: bool | None = None,
        close: bool = False,
    ) -> None:
        """A JSON error of the proxy's own: ``{"error": {"type", "message", "gate", ...}}``.

        ``retry=False`` says ``x-should-retry: false``: the header the openai SDK obeys before
        its status rules (it retries 408, 409, 429 and 5xx twice by default), for an overload
        rejection, which retrying deepens. ``close`` ends the connection after it.
        """
        error: dict[str, Any] = {"type": kind, "message": message}
        extra: list[tuple[bytes, bytes]] = []
        if retry is not None:
            extra.append((b"x-should-retry", b"true" if retry else b"false"))
        if close:
            extra.append((b"connection", b"close"))
        if gate is not None:
            error["gate"] = gate
            extra.append((b"x-fleetgate-gate", gate.encode("utf-8")))
        if retry_after_s is not None:
            error["retry_after_s"] = retry_after_s
            extra.append((b"retry-after", str(retry_after_s).encode()))
        body = ENCODER.encode({"error": error})
        ex.status = status
        ex.note = ex.note or kind
        await send_plain(ex.send, status, body, "application/json", extra)
        ex.sent = len(body)

    async def caller_failed(self, ex: Exchange, exc: Exception, phase: str) -> None:
        """The caller's side stopped the exchange (:meth:`Inbound.failure`) in ``phase`` (body,
        queued, upstream): gone (nothing to answer), a body past ``max_request_bytes`` (413),
        no room for it in ``max_buffered_bytes`` (503, :meth:`buffers_full`) or stalled (408).
        Each answer closes the connection: the rest of the body is not waited for."""
        if isinstance(exc, ClientGone):
            if phase != "body":  # the metric's phases: queued, upstream, response
                self.metrics.disconnects.labels(ex.label, phase).inc()
            notes = {"queued": "left the queue", "upstream": "gone while the upstream worked"}
            ex.status, ex.note = CLIENT_CLOSED, notes.get(phase, "gone before its body ended")
        elif isinstance(exc, BodyTooLarge):
            msg = too_large_message(self.settings)
            await self.error(ex, 413, "body_too_large", msg, close=True)
        elif isinstance(exc, BuffersFull):
            await self.buffers_full(ex)
        else:
            seconds = self.settings.body_timeout_s
            msg = f"no byte of the request body for {seconds:g} s (body_timeout_s)"
            await self.error(ex, 408, "body_timeout", msg, close=True)

    async def buffers_full(self, ex: Exchange) -> None:
        """503: buffering the request body would pass ``max_buffered_bytes``. An overload of
        this proxy (the bytes are bodies being read and requests queued with theirs), so not to
        be retried at once, as the 429: ``x-should-retry: false`` and ``Retry-After``; the
        connection closes (the body is not read)."""
        limit = self.settings.max_buffered_bytes
        msg = f"the proxy's request body buffers are full ({limit} bytes, max_buffered_bytes)"
        gate = ex.gate or None
        await self.error(
            ex, 503, "buffers_full", msg, gate=gate, retry_after_s=1, retry=False, close=True
        )

    @classmethod
    async def late(
        cls, ex: Exchange, deadline_ms: int, before: str, *, close: bool = False
    ) -> None:
        """504: the request's total deadline of ``deadline_ms`` (counted from its arrival)
        passed ``before`` the step named; ``close`` when the body was not read to its end."""
        where = f"gate {ex.gate!r}: " if ex.gate else ""
        msg = f"{where}total deadline of {deadline_ms} ms exceeded before {before}"
        await cls.error(ex, 504, "deadline_exceeded", msg, gate=ex.gate or None, close=close)

    @classmethod
    async def not_granted(cls, ex: Exchange, exc: FleetgateError) -> None:
        """The gate gave no permit: overloaded (429 with ``Retry-After``, not to be retried at
        once), the deadline passed while queued (504), a weight above the gate's ceiling (400),
        the gate unavailable (503)."""
        route = ex.route
        if isinstance(exc, Overloaded):
            # the gate's estimate when it made one (spread already), else the route's fixed value
            estimate = exc.retry_after
            seconds = retry_after(
                route.retry_after_s if estimate is None else min(estimate, route.max_retry_after_s)
            )
            await cls.error(
                ex,
                429,
                "overloaded",
                str(exc),
                gate=route.gate,
                retry_after_s=seconds,
                retry=False,
            )
        elif isinstance(exc, DeadlineExceeded):
            msg = (
                f"gate {route.gate!r}: the deadline of {exc.deadline_ms} ms passed while the "
                "request was queued for a permit; it was not forwarded"
            )
            await cls.error(ex, 504, "deadline_exceeded", msg, gate=route.gate, retry=False)
        elif isinstance(exc, ConfigError):
            await cls.error(ex, 400, "bad_header", str(exc), gate=route.gate)
        else:
            await cls.error(ex, 503, "unavailable", str(exc), gate=route.gate)

    @classmethod
    async def revoked(cls, ex: Exchange) -> None:
        """The gate asked for the request's permit back while its upstream call ran (a call
        of a higher priority waited past the gate's revoke_after): the call was cut. Before
        the answer began: 503, not to be retried at once (``x-should-retry: false``), with the
        route's ``Retry-After``; after (a stream under way; a 503 cannot follow a 200): the
        stream ends where it was, and the access log says why."""
        route = ex.route
        if ex.status:
            ex.note = "revoked: the stream was cut (a higher priority waited past revoke_after)"
            log.warning("route %s: %s", route.label, ex.note)
            return
        msg = (
            f"gate {route.gate!r}: the permit was revoked while the upstream call ran (a call of "
            "a higher priority waited past the gate's revoke_after); the call was cut"
        )
        await cls.error(
            ex,
            503,
            "revoked",
            msg,
            gate=route.gate,
            retry_after_s=retry_after(route.retry_after_s),
            retry=False,
        )

    @classmethod
    async def shutting_down(cls, ex: Exchange) -> None:
        """The drain ended before this request's answer: not an overload, another replica can
        serve it, so retryable (``Retry-After``), on a new connection (this one closes)."""
        msg = "the proxy is shutting down: the drain ended before this request's answer"
        await cls.error(
            ex,
            503,
            "shutting_down",
            msg,
            gate=ex.gate or None,
            retry_after_s=1,
            close=True,
        )
