"""The proxy's ASGI app: one permit of the route's gate per forwarded request.

One exchange, in order (each step may answer instead of going on):

1. the request head (:func:`~._checks.refusal`: 431, 400, 501, 413, 508), a route for the
   path (404);
2. the route by the JSON body's ``model`` when routes name models (the body is read first);
3. the ``X-Fleetgate-*`` headers -> the permit asked for (:func:`~.policy.parse_ask`; 400);
4. the permit: ``Overloaded`` -> 429 with ``Retry-After``; the deadline while queued -> 504; a
   caller that disconnects while queued leaves the wait list (no permit consumed);
5. the upstream call with the rest of the deadline to its response headers (504 past it; 502
   when it cannot be reached); its status and headers are passed through unchanged (hop-by-hop
   headers aside), errors included;
6. the body, streamed chunk by chunk. A reader task takes it from the upstream as fast as the
   upstream sends and frees the permit the moment the upstream is done, while the caller's side
   drains at the caller's pace: a slow reader never holds a permit. A caller that disconnects
   mid-response cancels the upstream call, which frees the permit.

The app never raises into the server: every failure becomes a response (or, once the response
has started, a cut connection). No header value, query string or URL credential is logged.
"""

from __future__ import annotations

import asyncio
import email.utils
import functools
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpx
import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from fleetgate.client import DeadlineExceeded, Fleet, Gate, Lease, Overloaded
from fleetgate.errors import ConfigError, FleetgateError

from ._checks import refusal, too_large_message
from ._inbound import BodyStalled, BodyTooLarge, ClientGone, Inbound
from .config import ProxyConfig, RouteConfig
from .metrics import ProxyMetrics
from .policy import (
    Ask,
    BadHeader,
    classify,
    forward_request_headers,
    forward_response_headers,
    parse_ask,
    peer_trusted,
    retry_after,
)

__all__ = ["ProxyApp"]

log = logging.getLogger("fleetgate.proxy")
access_log = logging.getLogger("fleetgate.proxy.access")

T = TypeVar("T")
Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# the status logged and counted for a caller that went away (nginx's convention; never sent)
CLIENT_CLOSED = 499
_JSON = (b"content-type", b"application/json")
_ENCODER = msgspec.json.Encoder()
_END = object()  # the upstream finished sending


class _Model(msgspec.Struct):
    model: str | None = None


class _TooLarge(Exception):
    """The upstream's response is larger than ``max_response_bytes``."""


# httpcore's pool spends time proportional to (requests in flight x connections) on every
# request it assigns; spread over a few pools, each stays small. A request goes to the pool
# with the fewest in flight (the first on a tie): sequential traffic keeps one connection.
POOLS_PER_ROUTE = 8


class _Upstream:
    """One route's upstream: httpx's transport (``httpx.AsyncHTTPTransport``, httpcore's
    keep-alive pools), not its ``AsyncClient``: no cookie jar shared by every caller (one
    caller's ``Set-Cookie`` went upstream with the others' requests), no INFO log line of each
    URL with its query string, no default headers of httpx's added (an ``Accept-Encoding`` the
    caller did not send would get it a compressed body), no redirects followed, no proxy from
    the environment. The caller's headers go through as they are: nothing is added but
    ``Host``, the framing and ``Via``/``X-Forwarded-For``."""

    def __init__(self, route: RouteConfig) -> None:
        parts = urlsplit(route.upstream)
        assert parts.hostname is not None  # validate_upstream
        self.scheme = parts.scheme
        self.host = parts.hostname
        self.port = parts.port
        self.authority = parts.netloc.encode("idna")
        self.base = parts.path.encode("ascii")  # no trailing slash (validate_upstream)
        # connect within the route's time; the rest is the proxy's own deadline and stream cap
        self.extensions = {
            "timeout": {"connect": route.connect_timeout_s, "read": None, "write": None}
        }
        # idle connections closed before an upstream on uvicorn's default keep-alive (5 s)
        # closes them: reusing one as it closes would fail a caller's request
        limits = httpx.Limits(
            max_connections=None, max_keepalive_connections=64, keepalive_expiry=4.0
        )
        self.transports = [
            httpx.AsyncHTTPTransport(limits=limits, retries=0) for _ in range(POOLS_PER_ROUTE)
        ]
        self.busy = [0] * POOLS_PER_ROUTE

    def request(
        self, method: str, target: bytes, headers: list[tuple[bytes, bytes]], content: Any
    ) -> httpx.Request:
        """The request to the upstream; ``target`` is the caller's path (starting with ``/``,
        checked) and query, appended to the upstream's base path: the host is the route's."""
        url = httpx.URL(
            scheme=self.scheme,
            host=self.host,
            port=self.port,
            raw_path=self.base + target,
        )
        return httpx.Request(
            method, url, headers=headers, content=content, extensions=self.extensions
        )

    async def send(self, request: httpx.Request) -> _Answer:
        """The upstream's answer (status and headers; the body streams). Cancelling it closes
        the connection."""
        busy = self.busy
        shard = busy.index(min(busy))
        busy[shard] += 1
        try:
            response = await self.transports[shard].handle_async_request(request)
        except BaseException:
            busy[shard] -= 1
            raise
        return _Answer(self, shard, response)

    async def aclose(self) -> None:
        await asyncio.gather(*(t.aclose() for t in self.transports))


class _Answer:
    """The upstream's response; always :meth:`aclose` it (pools the connection after a
    complete exchange, else closes it)."""

    def __init__(self, upstream: _Upstream, shard: int, response: httpx.Response) -> None:
        self.upstream = upstream
        self.shard = shard
        self.response = response
        self.closed = False

    async def aclose(self, *, complete: bool = False) -> None:
        """Close the response: httpcore pools the connection after a complete exchange, else
        closes it. After a ``complete`` one whose connection holds bytes past the answer
        (:func:`_poisoned`), the connection is closed first, while no other request can have it:
        httpcore then drops it instead of pooling it (a closed socket reads as readable)."""
        if self.closed:
            return
        self.closed = True
        response = self.response
        try:
            if complete and _poisoned(response):
                stream = response.extensions.get("network_stream")
                if stream is not None:
                    await stream.aclose()
            await response.aclose()
        finally:
            self.upstream.busy[self.shard] -= 1


def _poisoned(response: httpx.Response) -> bool:
    """Whether the upstream sent bytes past the end of this complete answer: an answer nobody
    asked for, e.g. a forged second response written behind the first. httpcore keeps such bytes
    in the connection's h11 parser and pools the connection, where they would answer the next
    request sent on it, another caller's (it drops a socket that is readable while idle, but
    never looks at bytes already read). No public API tells: this reads httpcore's state
    (httpx 0.28, httpcore 1.0) and says True -- close, never pool -- if that state moved (the
    reuse test in tests/test_proxy_review.py fails then, the framing test if it lies)."""
    try:
        stream: Any = response.stream  # httpx's, over httpcore's pool's, over the connection's
        connection = stream._httpcore_stream._stream._connection
        return bool(connection._h11_state.trailing_data[0])
    except AttributeError:
        return True


@dataclass
class _Exchange:
    """What the access log and the metrics say about one request."""

    method: str
    path: str
    client: str
    started: float = field(default_factory=time.monotonic)
    route: str = ""
    gate: str = ""
    status: int = 0
    sent: int = 0
    wait_ms: float | None = None
    ask: Ask | None = None
    note: str = ""


class _Permit:
    """A granted lease, released once, with the call's outcome reported first
    (``lease.report``: the client-observed signal; it leaves with the release)."""

    def __init__(self, lease: Lease) -> None:
        self.lease = lease
        self.done = False

    async def release(self, outcome: str | None = None, latency: float | None = None) -> None:
        """Release; with ``outcome``, report it first -- its latency only when ``ok``, as
        ``gate.map`` does (the latency of a failure says nothing of the server's speed)."""
        if self.done:
            return
        self.done = True
        try:
            if outcome is not None:
                self.lease.report(outcome, latency if outcome == "ok" else None)
        finally:
            await self.lease.release()


async def _race(
    task: asyncio.Future[T],
    inbound: Inbound,
    timeout: float | None = None,
    discard: Callable[[T], Awaitable[None]] | None = None,
) -> T:
    """``task``'s result, unless the caller's side stops the exchange first (gone, a body too
    large or stalled: :meth:`Inbound.failure` is raised) or ``timeout`` passes
    (:class:`TimeoutError`): then ``task`` is cancelled and a result it produced anyway is
    handed to ``discard`` (a lease to release, a response to close)."""
    stop = inbound.stop
    waiter: asyncio.Future[Any] = asyncio.ensure_future(stop.wait())
    pending: set[asyncio.Future[Any]] = {task, waiter}
    try:
        await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this exchange is cancelled itself (the server's shutdown)
        task.cancel()
        if discard is not None:
            task.add_done_callback(functools.partial(_discard_later, discard))
        raise
    finally:
        waiter.cancel()
    if task.done() and not stop.is_set():
        return task.result()
    task.cancel()
    try:
        result = await task
    except asyncio.CancelledError:
        pass
    except Exception:
        pass  # the task failed as it was abandoned: nothing to clean
    else:
        if discard is not None:
            await discard(result)
    if stop.is_set():
        raise inbound.failure()
    raise TimeoutError


# cleanups started from callbacks, kept referenced until they finish
_cleanups: set[asyncio.Future[None]] = set()


def _discard_later(discard: Callable[[Any], Awaitable[None]], task: asyncio.Future[Any]) -> None:
    if task.cancelled() or task.exception() is not None:
        return
    cleanup = asyncio.ensure_future(discard(task.result()))
    _cleanups.add(cleanup)
    cleanup.add_done_callback(_cleanups.discard)


def _cancel(task: asyncio.Future[Any]) -> None:
    task.cancel()


_date: tuple[int, bytes] = (0, b"")


def _http_date() -> bytes:
    """The ``Date`` of the proxy's own answers (and of upstream answers without one): RFC 9110
    6.6.1; uvicorn's is off, it added a second ``Date`` to every upstream answer."""
    global _date
    now = int(time.time())
    if _date[0] != now:
        _date = (now, email.utils.formatdate(now, usegmt=True).encode("ascii"))
    return _date[1]


class ProxyApp:
    """The ASGI app of ``fleetgate proxy`` over a started :class:`~fleetgate.client.Fleet`.

    ``registry`` holds the fleet's client metrics and the proxy's own (served at the config's
    ``metrics_path``). Call :meth:`aclose` after the server stopped (closes the upstream
    connection pools).
    """

    def __init__(
        self,
        config: ProxyConfig,
        fleet: Fleet,
        registry: CollectorRegistry,
    ) -> None:
        self.config = config
        self.fleet = fleet
        self.registry = registry
        self.metrics = ProxyMetrics.create(registry)
        self.draining = False
        self._gates: dict[str, Gate] = {}
        self._upstreams = {id(route): _Upstream(route) for route in config.routes}
        self._gauges: dict[str, Gauge] = {}
        self._children: dict[tuple[str, str], tuple[Counter, Histogram]] = {}
        self._trusted = config.proxy.trusted_networks()
        #: this proxy's name in Via (RFC 9110 7.6.3, a pseudonym): a request naming it has
        #: come back (508); another fleetgate proxy's is a chain, not a loop
        self.via_name = f"fleetgate-{secrets.token_hex(4)}".encode("ascii")
        self.via = (b"via", b"1.1 " + self.via_name)
        for route in config.routes:
            self.gate(route)  # registered now: live pod of the gate, defaults in Redis

    def gate(self, route: RouteConfig) -> Gate:
        found = self._gates.get(route.gate)
        if found is None:
            found = self.fleet.gate(route.gate, **route.gate_defaults)
            self._gates[route.gate] = found
        return found

    async def aclose(self) -> None:
        await asyncio.gather(*(u.aclose() for u in self._upstreams.values()))

    # -- ASGI --------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path: str = scope["path"]
        settings = self.config.proxy
        if path == settings.health_path:
            await self._health(send)
            return
        if path == settings.metrics_path:  # the proxy's own: never forwarded
            if scope["method"] in ("GET", "HEAD"):
                await self._send(send, 200, generate_latest(self.registry), CONTENT_TYPE_LATEST)
            else:
                body = _ENCODER.encode(
                    {"error": {"type": "method_not_allowed", "message": "GET or HEAD only"}}
                )
                await self._send(send, 405, body, "application/json", [(b"allow", b"GET, HEAD")])
            return
        client = scope.get("client")
        ex = _Exchange(scope["method"], path, client[0] if client else "-")
        try:
            await self._exchange(scope, receive, send, ex)
        except asyncio.CancelledError:
            # uvicorn cancels what still runs when the drain's time is up, and answers 500 to a
            # cancelled request that sent nothing: say what happened instead (the exchange has
            # left the wait list or released its permit on the way out)
            if not self.draining or ex.status != 0:
                raise
            # not an overload: another replica can serve it, so retryable (Retry-After), on a
            # new connection (this one closes)
            msg = "the proxy is shutting down: the drain ended before this request's answer"
            await self._error(
                send,
                503,
                "shutting_down",
                msg,
                ex,
                gate=ex.gate or None,
                retry_after_s=1,
                close=True,
            )
        except Exception:
            # A bug of ours: log it (no header values), answer 502 if nothing was sent yet.
            log.exception("proxy: unexpected error on %s %s", ex.method, ex.path)
            if ex.status == 0:
                ex.status = 502
                await self._error(send, 502, "proxy_error", "the proxy failed on this request", ex)
        finally:
            self._account(ex)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _health(self, send: Send) -> None:
        status = 503 if self.draining else 200
        body = {
            "status": "draining" if self.draining else "ok",
            "fallback": self.fleet.fallback_active,
            "routes": [r.describe() for r in self.config.routes],
        }
        await self._send(send, status, _ENCODER.encode(body), "application/json")

    # -- one exchange ------------------------------------------------------------------------

    async def _exchange(self, scope: Scope, receive: Receive, send: Send, ex: _Exchange) -> None:
        settings = self.config.proxy
        refused = refusal(scope, settings, self.via_name)
        if refused is not None:
            status, kind, msg, close = refused
            await self._error(send, status, kind, msg, ex, close=close)
            return
        routes = [r for r in self.config.routes if r.matches_path(ex.path)]
        if not routes:
            await self._error(send, 404, "no_route", f"no route for path {ex.path!r}", ex)
            return
        inbound = Inbound(receive, settings.max_request_bytes, settings.body_timeout_s)
        pump = asyncio.ensure_future(inbound.run())
        try:
            await self._routed(scope, send, ex, routes, inbound)
        finally:
            pump.cancel()
            await asyncio.gather(pump, return_exceptions=True)

    async def _routed(
        self,
        scope: Scope,
        send: Send,
        ex: _Exchange,
        routes: list[RouteConfig],
        inbound: Inbound,
    ) -> None:
        route = routes[0]
        if route.models:
            try:
                body = await inbound.read_all()
            except (BodyTooLarge, BodyStalled, ClientGone) as exc:
                await self._caller_failed(send, ex, routes[0], exc, "body")
                return
            try:
                model = msgspec.json.decode(body, type=_Model).model
            except msgspec.DecodeError:
                model = None
            found = next((r for r in routes if not r.models or model in r.models), None)
            if found is None:
                shown = "no model" if model is None else f"model {model[:100]!r}"
                msg = f"no route for path {ex.path!r} and {shown}"
                await self._error(send, 404, "no_route", msg, ex)
                return
            route = found
        ex.route, ex.gate = route.label, route.gate
        target = route.upstream_path(scope.get("raw_path") or scope["path"].encode())
        if target is None:
            msg = f"route {route.label!r} strips {route.path!r}: it must not be percent-encoded"
            await self._error(send, 400, "bad_request", msg, ex)
            return
        try:
            ask = parse_ask(scope["headers"], route)
        except BadHeader as exc:
            await self._error(send, 400, "bad_header", str(exc), ex)
            return
        ex.ask = ask
        gauge = self._gauges.get(route.label)
        if gauge is None:
            gauge = self._gauges[route.label] = self.metrics.in_flight.labels(route.label)
        gauge.inc()
        try:
            await self._gated(scope, send, ex, route, ask, inbound, target)
        finally:
            gauge.dec()

    async def _gated(
        self,
        scope: Scope,
        send: Send,
        ex: _Exchange,
        route: RouteConfig,
        ask: Ask,
        inbound: Inbound,
        target: bytes,
    ) -> None:
        gate = self.gate(route)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        acquire = asyncio.ensure_future(
            gate.acquire(
                ask.deadline_s, weight=ask.weight, priority=ask.priority, tenant=ask.tenant
            )
        )

        async def give_back(lease: Lease) -> None:
            await lease.release()

        try:
            lease = await _race(acquire, inbound, discard=give_back)
        except (BodyTooLarge, BodyStalled, ClientGone) as exc:
            await self._caller_failed(send, ex, route, exc, "queued")
            return
        except Overloaded as exc:
            seconds = retry_after(route.retry_after_s)
            await self._error(
                send,
                429,
                "overloaded",
                str(exc),
                ex,
                gate=route.gate,
                retry_after_s=seconds,
                retry=False,
            )
            return
        except DeadlineExceeded as exc:
            msg = f"{exc} (expired while queued for a permit)"
            await self._error(send, 504, "deadline_exceeded", msg, ex, gate=route.gate, retry=False)
            return
        except ConfigError as exc:  # a weight above the gate's ceiling
            await self._error(send, 400, "bad_header", str(exc), ex, gate=route.gate)
            return
        except FleetgateError as exc:
            await self._error(send, 503, "unavailable", str(exc), ex, gate=route.gate)
            return
        ex.wait_ms = (loop.time() - t0) * 1000
        permit = _Permit(lease)
        try:
            await self._forward(scope, send, ex, route, ask, inbound, permit, t0, target)
        finally:
            await permit.release()  # no-op when the upstream's end released it

    async def _forward(
        self,
        scope: Scope,
        send: Send,
        ex: _Exchange,
        route: RouteConfig,
        ask: Ask,
        inbound: Inbound,
        permit: _Permit,
        t0: float,
        target: bytes,
    ) -> None:
        """Forward to the route's upstream (``target``: the path to send, see
        :meth:`RouteConfig.upstream_path`) under the held ``permit``."""
        loop = asyncio.get_running_loop()
        remaining = ask.deadline_s - (loop.time() - t0)
        gate = route.gate
        deadline_msg = (
            f"gate {gate!r}: total deadline of {ask.deadline_ms} ms exceeded before the "
            "upstream's response headers"
        )
        if remaining <= 0:
            await permit.release()
            await self._error(send, 504, "deadline_exceeded", deadline_msg, ex, gate=gate)
            return
        if inbound.stop.is_set():  # the body passed its limit or stalled as the grant came
            await permit.release()
            await self._caller_failed(send, ex, route, inbound.failure(), "queued")
            return
        upstream = self._upstreams[id(route)]
        query: bytes = scope.get("query_string") or b""
        if query:
            target += b"?" + query
        headers = forward_request_headers(
            scope["headers"],
            client_ip=ex.client,
            trusted=peer_trusted(ex.client, self._trusted),
            via=self.via,
        )
        content: Any
        if inbound.complete and not inbound.too_large:
            content = await inbound.read_all()
            # the body is all here: its length is the framing (the caller's Content-Length,
            # checked to be one number, said the same or the body was chunked)
            headers = [(k, v) for k, v in headers if k != b"content-length"]
            if content or any(k == b"content-length" for k, _ in scope["headers"]):
                headers.append((b"content-length", str(len(content)).encode()))
        else:
            content = inbound.body()
            if not any(k == b"content-length" for k, _ in headers):
                headers.append((b"transfer-encoding", b"chunked"))
        headers.insert(0, (b"host", upstream.authority))
        try:
            request = upstream.request(scope["method"], target, headers, content)
        except (httpx.InvalidURL, UnicodeDecodeError):  # not a URL's path and query
            await permit.release()
            await self._error(send, 400, "bad_request", "the request target is not valid", ex)
            return
        sent_at = loop.time()

        async def close(answer: _Answer) -> None:
            await answer.aclose()

        try:
            answer = await _race(
                asyncio.ensure_future(upstream.send(request)),
                inbound,
                remaining,
                discard=close,
            )
        except (BodyTooLarge, BodyStalled, ClientGone) as exc:
            await permit.release()
            await self._caller_failed(send, ex, route, exc, "upstream")
            return
        except TimeoutError:
            await permit.release("timeout")
            self.metrics.upstream_errors.labels(route.label, "timeout").inc()
            await self._error(send, 504, "deadline_exceeded", deadline_msg, ex, gate=gate)
            return
        except (httpx.ConnectTimeout, httpx.PoolTimeout):
            await permit.release("timeout")
            self.metrics.upstream_errors.labels(route.label, "connect").inc()
            msg = f"upstream {route.upstream} did not accept a connection in time"
            await self._error(send, 504, "upstream_timeout", msg, ex, gate=gate)
            return
        except httpx.TransportError as exc:  # cannot connect, reset, closed early, bad HTTP
            await permit.release("error")
            kind = "connect" if isinstance(exc, httpx.ConnectError) else "protocol"
            self.metrics.upstream_errors.labels(route.label, kind).inc()
            msg = f"upstream {route.upstream} failed: {type(exc).__name__}"
            await self._error(send, 502, "upstream_error", msg, ex, gate=gate)
            return
        await self._respond(send, ex, route, inbound, permit, answer, sent_at)

    async def _respond(
        self,
        send: Send,
        ex: _Exchange,
        route: RouteConfig,
        inbound: Inbound,
        permit: _Permit,
        answer: _Answer,
        sent_at: float,
    ) -> None:
        limit = self.config.proxy.max_response_bytes
        response = answer.response
        status = response.status_code
        if not 100 <= status <= 599:  # h11 reads 100-999; the server to the caller sends <= 599
            await answer.aclose()
            await permit.release("error")
            self.metrics.upstream_errors.labels(route.label, "protocol").inc()
            msg = f"upstream {route.upstream} answered status {status}, not an HTTP status"
            await self._error(send, 502, "upstream_error", msg, ex, gate=route.gate)
            return
        declared = response.headers.get("content-length", "")
        bodiless = ex.method == "HEAD" or status in (204, 304)  # the length names no body here
        if declared.isdigit() and int(declared) > limit and not bodiless:
            await answer.aclose()
            await permit.release("ok", asyncio.get_running_loop().time() - sent_at)
            self.metrics.upstream_errors.labels(route.label, "too_large").inc()
            msg = f"the upstream's response ({declared} bytes) exceeds {limit} bytes"
            await self._error(send, 502, "response_too_large", msg, ex, gate=route.gate)
            return
        queue: asyncio.Queue[object] = asyncio.Queue()
        reader = asyncio.ensure_future(
            self._read_upstream(answer, queue, permit, route, sent_at, ex)
        )
        inbound.on_gone(functools.partial(_cancel, reader))
        headers = forward_response_headers(response.headers.raw, status, self.via)
        if not any(k == b"date" for k, _ in headers):
            headers.append((b"date", _http_date()))
        ended = False  # the reader is done with the upstream (it closes and releases now)
        try:
            # Inside the try: should sending fail, the reader is cancelled and awaited, and
            # only its end (the upstream's response closed) releases the permit. Outside, the
            # permit was released at once while the orphaned reader still drew the body.
            await send({"type": "http.response.start", "status": status, "headers": headers})
            ex.status = status
            while True:
                item = await queue.get()
                if item is _END:
                    ended = True
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                    return
                if not isinstance(item, bytes):
                    # cut short (the upstream failed or the caller left): the response stays
                    # incomplete, which the caller's HTTP client sees as a truncated body
                    ended = True
                    return
                await send({"type": "http.response.body", "body": item, "more_body": True})
                ex.sent += len(item)
        finally:
            # Never cancel a reader that is closing the response and releasing the permit: a
            # cancel there dropped the connection instead of pooling it and lost the outcome.
            if not ended and not reader.done():
                reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    async def _read_upstream(
        self,
        answer: _Answer,
        queue: asyncio.Queue[object],
        permit: _Permit,
        route: RouteConfig,
        sent_at: float,
        ex: _Exchange,
    ) -> None:
        """Take the body from the upstream as fast as it comes; free the permit when it ends."""
        limit = self.config.proxy.max_response_bytes
        loop = asyncio.get_running_loop()
        outcome: str | None = None
        response = answer.response
        complete = False

        async def pull() -> None:
            total = 0
            # the stream itself: aiter_raw() would pool the connection at its end, before
            # _Answer.aclose looked at it
            stream = response.stream
            assert isinstance(stream, httpx.AsyncByteStream)  # the async transport's
            async for chunk in stream:
                total += len(chunk)
                if total > limit:
                    raise _TooLarge
                queue.put_nowait(chunk)

        try:
            await asyncio.wait_for(pull(), route.stream_timeout_s)
        except asyncio.CancelledError:
            self.metrics.disconnects.labels(route.label, "response").inc()
            ex.note = "gone mid-response"
            queue.put_nowait(None)
            raise
        except (TimeoutError, asyncio.TimeoutError):
            outcome, ex.note = "timeout", f"stream cut after {route.stream_timeout_s:g} s"
            self.metrics.upstream_errors.labels(route.label, "timeout").inc()
            queue.put_nowait(None)
        except _TooLarge:
            outcome, ex.note = "ok", f"response cut at {limit} bytes"
            self.metrics.upstream_errors.labels(route.label, "too_large").inc()
            queue.put_nowait(None)
        except httpx.TransportError as exc:
            outcome, ex.note = "error", f"upstream failed mid-response: {type(exc).__name__}"
            self.metrics.upstream_errors.labels(route.label, "protocol").inc()
            queue.put_nowait(None)
        else:
            outcome, complete = classify(response.status_code), True
            queue.put_nowait(_END)
        finally:
            await answer.aclose(complete=complete)
            await permit.release(outcome, loop.time() - sent_at)

    # -- answers -----------------------------------------------------------------------------

    @staticmethod
    async def _send(
        send: Send,
        status: int,
        body: bytes,
        content_type: str,
        extra: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        headers = [
            (b"date", _http_date()),
            (b"content-type", content_type.encode("latin-1")),
            (b"content-length", str(len(body)).encode()),
            *(extra or []),
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _error(
        self,
        send: Send,
        status: int,
        kind: str,
        message: str,
        ex: _Exchange,
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
        body = _ENCODER.encode({"error": error})
        ex.status = status
        ex.note = ex.note or kind
        await self._send(send, status, body, "application/json", extra)

    async def _caller_failed(
        self, send: Send, ex: _Exchange, route: RouteConfig, exc: Exception, phase: str
    ) -> None:
        """The caller's side stopped the exchange (:meth:`Inbound.failure`): gone (nothing to
        answer), a body past ``max_request_bytes`` (413) or stalled (408). Both answers close
        the connection: the rest of the body is not waited for."""
        if isinstance(exc, ClientGone):
            if phase != "body":  # the metric's phases: queued, upstream, response
                self.metrics.disconnects.labels(route.label, phase).inc()
            notes = {"queued": "left the queue", "upstream": "gone while the upstream worked"}
            ex.status, ex.note = CLIENT_CLOSED, notes.get(phase, "gone before its body ended")
        elif isinstance(exc, BodyTooLarge):
            msg = too_large_message(self.config.proxy)
            await self._error(send, 413, "body_too_large", msg, ex, close=True)
        else:
            seconds = self.config.proxy.body_timeout_s
            msg = f"no byte of the request body for {seconds:g} s (body_timeout_s)"
            await self._error(send, 408, "body_timeout", msg, ex, close=True)

    def _account(self, ex: _Exchange) -> None:
        seconds = time.monotonic() - ex.started
        status = str(ex.status or CLIENT_CLOSED)
        # the labelled children, looked up once (prometheus-client takes a lock per lookup)
        key = (ex.route, status)
        children = self._children.get(key)
        if children is None:
            children = (
                self.metrics.requests.labels(ex.route, status),
                self.metrics.seconds.labels(ex.route, status),
            )
            self._children[key] = children
        children[0].inc()
        children[1].observe(seconds)
        if not self.config.proxy.access_log or not access_log.isEnabledFor(logging.INFO):
            return
        ask = ex.ask
        wait = "-" if ex.wait_ms is None else f"{ex.wait_ms:.1f}ms"
        cls = (
            f" priority={ask.priority} tenant={ask.tenant or '-'} weight={ask.weight}"
            if ask is not None
            else ""
        )
        # The path only: a query string may carry a key. Header values are never logged.
        access_log.info(
            '%s "%s %s" %s %dB %.1fms route=%s gate=%s wait=%s%s%s',
            ex.client,
            ex.method,
            ex.path[:200].encode("unicode_escape").decode("ascii"),
            status,
            ex.sent,
            seconds * 1000,
            ex.route or "-",
            ex.gate or "-",
            wait,
            cls,
            f" ({ex.note})" if ex.note else "",
        )
