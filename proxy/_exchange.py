"""One request's state as it goes through the proxy (:class:`Exchange`), the permit it holds
(:class:`Permit`) and its line in the access log (:func:`log_access`).

An :class:`Exchange` is made when a request arrives, with what it is: its ASGI scope and send
and the caller's side (:class:`~._inbound.Inbound`). Each step of the app sets on it what it
found -- the routing its route, target and ask, the gate its permit -- and the steps after read
it there. What the access log and the metrics say about the request (status, bytes sent, wait,
note) is recorded on it as it goes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fleetgate.ask import Ask
from fleetgate.client import Lease

from ._inbound import Inbound
from ._tokens import Estimate
from .config import RouteConfig

__all__ = ["Exchange", "Message", "Permit", "Receive", "Scope", "Send", "log_access"]

access_log = logging.getLogger("fleetgate.proxy.access")

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class Permit:
    """A granted lease, released once, with the call's outcome reported first
    (``lease.report``: the client-observed signal; it leaves with the release)."""

    def __init__(self, lease: Lease) -> None:
        self.lease = lease
        self.done = False

    async def release(
        self, outcome: str | None = None, latency: float | None = None, tokens: int | None = None
    ) -> None:
        """Release; with ``outcome``, report it first -- its latency only when ``ok``, as
        ``gate.map`` does (the latency of a failure says nothing of the server's speed), and
        ``tokens``, what the call used, when the answer said so."""
        if self.done:
            return
        self.done = True
        try:
            if outcome is not None:
                held = latency if outcome == "ok" else None
                if tokens is None:
                    self.lease.report(outcome, held)
                else:
                    self.lease.report(outcome, held, tokens=tokens)
        finally:
            await self.lease.release()


@dataclass(eq=False)
class Exchange:
    """One request, from its arrival to its line in the access log."""

    scope: Scope
    send: Send
    inbound: Inbound
    method: str
    path: str
    client: str
    started: float = field(default_factory=time.monotonic)

    # what the access log and the metrics say
    label: str = ""  # the route's label, once routed
    gate: str = ""  # the route's gate, once routed
    status: int = 0  # the status sent; 0 while none is
    sent: int = 0  # body bytes handed to the caller: the upstream's answer, or the proxy's own
    wait_ms: float | None = None  # the wait for the permit, once granted
    ask: Ask | None = None  # the permit asked for, once the headers are parsed
    note: str = ""
    estimate: Estimate | None = None  # the body's token estimate, on a route with tokens
    used: int | None = None  # the tokens the answer's usage said the call used

    # set by the step named, read by the steps after it
    begun: float = field(init=False)  # the app: the loop's time at arrival (the deadline's start)
    route: RouteConfig = field(init=False)  # routing
    target: bytes = field(init=False)  # routing: the path to send (RouteConfig.upstream_path)
    asked_at: float = field(init=False)  # the gate: the loop's time when the permit was asked
    permit: Permit = field(init=False)  # the gate
    sent_at: float = field(init=False)  # the upstream: the loop's time when the request went

    def asked(self) -> Ask:
        """The permit asked for; only after the routing parsed it."""
        assert self.ask is not None, "read before the routing parsed the ask"
        return self.ask


def log_access(ex: Exchange, status: str, seconds: float) -> None:
    """The exchange's line in the access log (``fleetgate.proxy.access``, INFO): the path only,
    as a query string may carry a key; header values are never logged."""
    if not access_log.isEnabledFor(logging.INFO):
        return
    ask = ex.ask
    wait = "-" if ex.wait_ms is None else f"{ex.wait_ms:.1f}ms"
    cls = (
        f" priority={ask.priority} tenant={ask.tenant or '-'} weight={ask.weight}"
        if ask is not None
        else ""
    )
    if ask is not None and (ask.tokens or ex.used is not None):
        cls += f" tokens={ask.tokens}"
        if ex.used is not None:
            cls += f" used={ex.used}"
            if ex.used > 0 and ask.tokens > 0:
                cls += f" err={abs(ask.tokens - ex.used) / ex.used:.2f}"
    access_log.info(
        '%s "%s %s" %s %dB %.1fms route=%s gate=%s wait=%s%s%s',
        ex.client,
        ex.method,
        ex.path[:200].encode("unicode_escape").decode("ascii"),
        status,
        ex.sent,
        seconds * 1000,
        ex.label or "-",
        ex.gate or "-",
        wait,
        cls,
        f" ({ex.note})" if ex.note else "",
    )
