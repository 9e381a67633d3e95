"""What the proxy decides about one request and one response, as pure functions (no I/O).

* :func:`parse_ask`: the ``X-Fleetgate-*`` headers -> the permit to ask for (the core
  :class:`~fleetgate.ask.Ask`, carried as it is to the gate),
  validated (a malformed value is a :class:`BadHeader`: 400) and clamped to what the route
  allows (a caller never gets above ``max_priority``, a tenant the route does not list, a weight
  above ``max_weight`` or a deadline above ``max_deadline_ms``);
* :func:`forward_request_headers` / :func:`forward_response_headers`: RFC 9110 section 7.6.1 --
  ``Connection`` and every header it names, ``Proxy-Connection``, ``Keep-Alive``, ``TE``,
  ``Transfer-Encoding``, ``Upgrade`` are hop-by-hop and never forwarded; the ``X-Fleetgate-*``
  headers are the proxy's and stop here; ``Via`` is added (section 7.6.3); the caller's
  forwarding headers (``Forwarded``, ``X-Forwarded-*``, ``X-Real-IP``) pass only from a trusted
  proxy (:func:`peer_trusted`, the one place that decides); ``Trailer`` is dropped with the
  trailers it announces;
* :func:`classify`: a response status or an error -> the outcome reported for the
  client-observed signal (``ok``, ``overloaded``, ``timeout``, ``error``);
* :func:`retry_after`: the ``Retry-After`` value of a 429 (integer seconds, at least 1).

Header names arrive as ASGI gives them: lower-case bytes.
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Iterable, Sequence
from typing import Final, Literal

from fleetgate.admission import MAX_PRIORITY, MAX_TOKENS, MIN_PRIORITY
from fleetgate.ask import Ask
from fleetgate.keys import name_problem
from fleetgate.observed import OVERLOADED_STATUSES, TIMEOUT_STATUSES

from .config import RouteConfig

__all__ = [
    "FLEETGATE_HEADERS",
    "HOP_BY_HOP",
    "Ask",
    "BadHeader",
    "Outcome",
    "classify",
    "deadline_ms_of",
    "deadline_of",
    "forward_request_headers",
    "forward_response_headers",
    "parse_ask",
    "peer_trusted",
    "retry_after",
]

Headers = Sequence[tuple[bytes, bytes]]
Outcome = Literal["ok", "overloaded", "timeout", "error"]

PRIORITY: Final = b"x-fleetgate-priority"
TENANT: Final = b"x-fleetgate-tenant"
WEIGHT: Final = b"x-fleetgate-weight"
DEADLINE: Final = b"x-fleetgate-deadline-ms"
TOKENS: Final = b"x-fleetgate-tokens"
FLEETGATE_HEADERS: Final = frozenset({PRIORITY, TENANT, WEIGHT, DEADLINE, TOKENS})

#: RFC 9110 7.6.1 (plus Proxy-Authorization/-Authenticate: meant for this hop, never forwarded)
HOP_BY_HOP: Final = frozenset(
    {
        b"connection",
        b"proxy-connection",
        b"keep-alive",
        b"te",
        b"transfer-encoding",
        b"upgrade",
        b"proxy-authorization",
        b"proxy-authenticate",
    }
)
VIA: Final = (b"via", b"1.1 fleetgate")
#: what a caller says about where its request came from: believed only from a trusted proxy
FORWARDING: Final = frozenset(
    {
        b"forwarded",
        b"x-forwarded-for",
        b"x-forwarded-host",
        b"x-forwarded-proto",
        b"x-forwarded-port",
        b"x-real-ip",
    }
)
Networks = Sequence[ipaddress.IPv4Network | ipaddress.IPv6Network]
#: the longest deadline a header may name (a day), and the longest number we parse
MAX_DEADLINE_MS: Final = 86_400_000
_MAX_DIGITS: Final = 12


class BadHeader(ValueError):
    """A malformed ``X-Fleetgate-*`` header: the message names it and says what is expected."""

    def __init__(self, header: bytes, problem: str) -> None:
        self.header = header.decode("latin-1").title()
        super().__init__(f"{self.header}: {problem}")


def deadline_of(ask: Ask) -> float:
    """The total deadline of a request's :class:`~fleetgate.ask.Ask`, in seconds (every ask
    :func:`parse_ask` makes has one: the route's default when the header is absent)."""
    assert ask.deadline is not None
    return ask.deadline


def deadline_ms_of(ask: Ask) -> int:
    """:func:`deadline_of` in whole milliseconds, as the header and the 504 name it."""
    return round(deadline_of(ask) * 1000)


def _single(headers: Headers, name: bytes) -> str | None:
    found: str | None = None
    for key, value in headers:
        if key == name:
            if found is not None:
                raise BadHeader(name, "given more than once")
            found = value.decode("latin-1").strip(" \t")
    return found


def _int(name: bytes, text: str, what: str) -> int:
    body = text[1:] if text[:1] in ("-", "+") else text
    if not body or len(body) > _MAX_DIGITS or not (body.isascii() and body.isdigit()):
        shown = text if len(text) <= 40 else text[:37] + "..."
        raise BadHeader(name, f"expected {what}, got {shown!r}")
    return int(text)


def parse_ask(headers: Headers, route: RouteConfig) -> Ask:
    """The :class:`Ask` of a request to ``route`` (absent headers take the route's defaults).

    Malformed values (not an integer, a priority outside [-100, 100], a weight < 1, a deadline
    <= 0 or above a day, tokens < 0, a tenant that is no valid name, a header given twice) raise
    :class:`BadHeader`. Well-formed values beyond the route's allowance are clamped: priority
    to [min_priority, max_priority], weight to [1, max_weight], the deadline to
    max_deadline_ms, and a tenant the route does not allow becomes the route's tenant.
    """
    priority = route.priority
    text = _single(headers, PRIORITY)
    if text is not None:
        asked = _int(PRIORITY, text, f"an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}]")
        if not MIN_PRIORITY <= asked <= MAX_PRIORITY:
            raise BadHeader(PRIORITY, f"expected an integer in [-100, 100], got {asked}")
        lo, hi = route.priority_range
        priority = min(max(asked, lo), hi)

    weight = route.weight
    text = _single(headers, WEIGHT)
    if text is not None:
        asked = _int(WEIGHT, text, "an integer >= 1")
        if asked < 1:
            raise BadHeader(WEIGHT, f"expected an integer >= 1, got {asked}")
        weight = min(asked, route.weight_cap)

    deadline = route.deadline_ms
    text = _single(headers, DEADLINE)
    if text is not None:
        asked = _int(DEADLINE, text, f"milliseconds in [1, {MAX_DEADLINE_MS}]")
        if not 1 <= asked <= MAX_DEADLINE_MS:
            expected = f"expected milliseconds in [1, {MAX_DEADLINE_MS}], got {asked}"
            raise BadHeader(DEADLINE, expected)
        deadline = min(asked, route.deadline_cap_ms)

    tokens = 0
    text = _single(headers, TOKENS)
    if text is not None:
        tokens = _int(TOKENS, text, f"an integer in [0, {MAX_TOKENS}]")
        if not 0 <= tokens <= MAX_TOKENS:
            raise BadHeader(TOKENS, f"expected an integer in [0, {MAX_TOKENS}], got {tokens}")

    tenant: str | None = route.tenant or None
    text = _single(headers, TENANT)
    if text is not None:
        problem = name_problem(text, "tenant")
        if problem:
            raise BadHeader(TENANT, problem)
        if route.any_tenant or text in route.tenants:
            tenant = text
    return Ask(
        weight=weight, priority=priority, tenant=tenant, deadline=deadline / 1000, tokens=tokens
    )


def _connection_tokens(headers: Headers) -> set[bytes]:
    names: set[bytes] = set()
    for key, value in headers:
        if key == b"connection":
            names.update(t.strip().lower() for t in value.split(b",") if t.strip())
    return names


def peer_trusted(peer: str | None, networks: Networks) -> bool:
    """Whether the peer at address ``peer`` is one of the proxy's ``trusted_proxies``: the one
    place that decides whose forwarding headers are believed."""
    if not peer or not networks:
        return False
    try:
        address = ipaddress.ip_address(peer)
    except ValueError:  # a Unix socket's path, "-"
        return False
    return any(address in network for network in networks)


def forward_request_headers(
    headers: Headers,
    *,
    client_ip: str | None = None,
    trusted: bool = False,
    via: tuple[bytes, bytes] = VIA,
) -> list[tuple[bytes, bytes]]:
    """The headers to send upstream: hop-by-hop, ``Host`` (the upstream's is set by the HTTP
    client), ``Trailer`` (trailers are not forwarded) and ``X-Fleetgate-*`` removed; ``via``
    appended to the caller's ``Via``. The forwarding headers pass only from a ``trusted`` peer
    (its ``X-Forwarded-For`` with the peer's address, ``client_ip``, appended); from any other,
    they are dropped and ``X-Forwarded-For`` is ``client_ip`` alone."""
    drop = HOP_BY_HOP | FLEETGATE_HEADERS | _connection_tokens(headers) | {b"host", b"trailer"}
    if not trusted:
        drop = drop | FORWARDING
    out = [(k, v) for k, v in headers if k not in drop]
    if client_ip:
        prior = [v for k, v in out if k == b"x-forwarded-for"]
        out = [(k, v) for k, v in out if k != b"x-forwarded-for"]
        chain = b", ".join([*prior, client_ip.encode("latin-1")])
        out.append((b"x-forwarded-for", chain))
    prior_via = [v for k, v in out if k == b"via"]
    if prior_via:
        out = [(k, v) for k, v in out if k != b"via"]
        via = (b"via", b", ".join([*prior_via, via[1]]))
    out.append(via)
    return out


def forward_response_headers(
    headers: Iterable[tuple[bytes, bytes]], status: int = 200, via: tuple[bytes, bytes] = VIA
) -> list[tuple[bytes, bytes]]:
    """The upstream's response headers for the caller: hop-by-hop removed (the server framing
    the response to the caller sets its own ``Transfer-Encoding``), ``Via`` added. The body is
    forwarded byte for byte, so ``Content-Length`` and ``Content-Encoding`` stay true -- but
    for two cases where it does not frame what is sent: beside ``Transfer-Encoding`` (RFC 9112
    6.3: the chunked framing wins and a proxy removes the length) and on a 204 or 304, which
    have no body whatever length they name (the server to the caller would wait for it)."""
    items = [(k.lower(), v) for k, v in headers]
    drop = HOP_BY_HOP | _connection_tokens(items)
    if status in (204, 304) or any(k == b"transfer-encoding" for k, _ in items):
        drop = drop | {b"content-length"}
    return [*((k, v) for k, v in items if k not in drop), via]


def classify(status: int | None, *, timed_out: bool = False) -> Outcome:
    """The outcome of one forwarded call for the client-observed signal.

    ``status`` None means no response (a connection or protocol error): ``error``, or
    ``timeout`` when the call ran out of time. 429, 503 and 529 are the server saying it is
    overloaded; 408 and 504 are time-outs; other 5xx are errors. Everything else -- 2xx, 3xx
    and the caller's own 4xx -- is ``ok``: the server served it, and a bad request says nothing
    about its load.
    """
    if timed_out:
        return "timeout"
    if status is None:
        return "error"
    if status in OVERLOADED_STATUSES:
        return "overloaded"
    if status in TIMEOUT_STATUSES:
        return "timeout"
    return "error" if status >= 500 else "ok"  # unlike gate.map's, the caller's own 4xx is ok


def retry_after(seconds: float) -> int:
    """``Retry-After`` in integer seconds (RFC 9110 10.2.3), rounded up, at least 1."""
    if not seconds > 0 or math.isinf(seconds):
        return 1
    return max(1, math.ceil(seconds))
