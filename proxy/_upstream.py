"""The upstream side of an exchange: the request sent under the permit, the answer streamed back.

:class:`Relay` does it for every route (:meth:`Relay.forward`): the rest of the deadline to the
upstream's response headers (504 past it; 502 when the upstream cannot be reached); its status
and headers passed through unchanged (hop-by-hop headers aside), errors included; then the body
chunk by chunk. A reader task takes it from the upstream as fast as the upstream sends and frees
the permit the moment the upstream is done, while the caller's side drains at the caller's pace:
a slow reader never holds a permit. A caller that disconnects mid-response cancels the upstream
call, which frees the permit.

:class:`Upstream` is one route's connection pools; :class:`Answer` one response of it.
"""

from __future__ import annotations

import asyncio
import functools
import sys
from collections.abc import Coroutine
from typing import Any
from urllib.parse import urlsplit

import httpx

from ._answers import Answers, http_date
from ._coalesce import install
from ._exchange import Exchange
from ._inbound import CallerStopped
from ._tokens import Settle
from .config import ProxyConfig, RouteConfig
from .metrics import ProxyMetrics
from .policy import (
    classify,
    deadline_ms_of,
    deadline_of,
    forward_request_headers,
    forward_response_headers,
    peer_trusted,
)

__all__ = ["POOLS_PER_ROUTE", "Answer", "Relay", "Upstream"]

_END = object()  # the upstream finished sending

# httpcore's pool spends time proportional to (requests in flight x connections) on every
# request it assigns; spread over a few pools, each stays small. A request goes to the pool
# with the fewest in flight (the first on a tie): sequential traffic keeps one connection.
POOLS_PER_ROUTE = 8


class _TooLarge(Exception):
    """The upstream's response is larger than ``max_response_bytes``."""


class Upstream:
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
        if not route.stream_uploads:  # bodies whole: each request in one write (_coalesce.py)
            for transport in self.transports:
                install(transport)
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

    async def send(self, request: httpx.Request) -> Answer:
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
        return Answer(self, shard, response)

    async def aclose(self) -> None:
        """Close the connection pools."""
        await asyncio.gather(*(t.aclose() for t in self.transports))


class Answer:
    """The upstream's response; always :meth:`aclose` it (pools the connection after a
    complete exchange, else closes it)."""

    def __init__(self, upstream: Upstream, shard: int, response: httpx.Response) -> None:
        self.upstream = upstream
        self.shard = shard
        self.response = response
        self.closed = False

    async def aclose(self, *, complete: bool = False) -> None:
        """Close the response: httpcore pools the connection after a complete exchange, else
        closes it. After a ``complete`` one whose connection holds bytes past the answer
        (:func:`poisoned`), the connection is closed first, while no other request can have it:
        httpcore then drops it instead of pooling it (a closed socket reads as readable)."""
        if self.closed:
            return
        self.closed = True
        response = self.response
        try:
            if complete and poisoned(response):
                stream = response.extensions.get("network_stream")
                if stream is not None:
                    await stream.aclose()
            await response.aclose()
        finally:
            self.upstream.busy[self.shard] -= 1


def poisoned(response: httpx.Response) -> bool:
    """Whether the upstream sent bytes past the end of this complete answer: an answer nobody
    asked for, e.g. a forged second response written behind the first. httpcore keeps such bytes
    in the connection's h11 parser and pools the connection, where they would answer the next
    request sent on it, another caller's (it drops a socket that is readable while idle, but
    never looks at bytes already read). No public API tells: this reads httpcore's state
    (httpx 0.28, httpcore 1.0) and says True -- close, never pool -- if that state moved (the
    reuse test in tests/proxy/test_forwarding.py fails then, the framing test if it lies)."""
    try:
        stream: Any = response.stream  # httpx's, over httpcore's pool's, over the connection's
        connection = stream._httpcore_stream._stream._connection
        return bool(connection._h11_state.trailing_data[0])
    except AttributeError:
        return True


async def _within(work: Coroutine[Any, Any, None], seconds: float) -> None:
    """``await work`` within ``seconds`` (TimeoutError past them): on Python 3.11+ in this
    task, without the task ``wait_for`` makes for it (one per request)."""
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(seconds):
            await work
    else:  # pragma: no cover
        await asyncio.wait_for(work, seconds)


async def _close(answer: Answer) -> None:
    await answer.aclose()


def _cancel(task: asyncio.Future[Any]) -> None:
    task.cancel()


_HEADERS = "the upstream's response headers"


class Relay:
    """Every route's :class:`Upstream`, and the forwarding of an exchange to its route's."""

    def __init__(
        self,
        config: ProxyConfig,
        metrics: ProxyMetrics,
        answers: Answers,
        via: tuple[bytes, bytes],
    ) -> None:
        self.upstreams = {id(route): Upstream(route) for route in config.routes}
        self.max_response_bytes = config.proxy.max_response_bytes
        self.metrics = metrics
        self.answers = answers
        self.via = via
        self._trusted = config.proxy.trusted_networks()

    async def aclose(self) -> None:
        """Close every upstream's connection pools."""
        await asyncio.gather(*(u.aclose() for u in self.upstreams.values()))

    async def forward(self, ex: Exchange) -> None:
        """Forward ``ex`` to its route's upstream under its held permit, within the rest of its
        deadline, and pass the answer back."""
        loop = asyncio.get_running_loop()
        ask = ex.asked()
        remaining = deadline_of(ask) - (loop.time() - ex.begun)
        if remaining <= 0:
            await ex.permit.release()
            await self.answers.late(ex, deadline_ms_of(ask), _HEADERS)
            return
        inbound = ex.inbound
        if inbound.stop.is_set():  # the body passed its limit or stalled as the grant came
            await ex.permit.release()
            await self.answers.caller_failed(ex, inbound.failure(), "queued")
            return
        upstream = self.upstreams[id(ex.route)]
        request = await self._request(ex, upstream)
        if request is None:
            await ex.permit.release()
            await self.answers.error(ex, 400, "bad_request", "the request target is not valid")
            return
        ex.sent_at = loop.time()
        try:
            answer = await inbound.race(
                asyncio.ensure_future(upstream.send(request)), remaining, discard=_close
            )
        except CallerStopped as exc:
            await ex.permit.release()
            await self.answers.caller_failed(ex, exc, "upstream")
            return
        except (TimeoutError, httpx.TransportError) as exc:
            await self._unanswered(ex, exc)
            return
        await self._respond(ex, answer)

    async def _request(self, ex: Exchange, upstream: Upstream) -> httpx.Request | None:
        """The request for the upstream: the caller's forwarded headers and ``Host``, the body
        as one buffer when it is all here (its length the framing), else streamed (chunked
        unless the caller gave its length). None when the target is no URL's path and query."""
        scope, inbound = ex.scope, ex.inbound
        target = ex.target
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
            estimate = ex.estimate
            if estimate is not None and estimate.body is not None:
                content = estimate.body  # with stream_options.include_usage (_tokens)
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
            return upstream.request(ex.method, target, headers, content)
        except (httpx.InvalidURL, UnicodeDecodeError):  # not a URL's path and query
            return None

    async def _unanswered(self, ex: Exchange, exc: Exception) -> None:
        """No answer came: past the deadline (504), no connection in time (504), the upstream
        unreachable or failing (502). The outcome is reported with the permit's release."""
        route, errors = ex.route, self.metrics.upstream_errors
        if isinstance(exc, TimeoutError):
            await ex.permit.release("timeout")
            errors.labels(ex.label, "timeout").inc()
            await self.answers.late(ex, deadline_ms_of(ex.asked()), _HEADERS)
        elif isinstance(exc, (httpx.ConnectTimeout, httpx.PoolTimeout)):
            await ex.permit.release("timeout")
            errors.labels(ex.label, "connect").inc()
            msg = f"upstream {route.upstream} did not accept a connection in time"
            await self.answers.error(ex, 504, "upstream_timeout", msg, gate=route.gate)
        else:  # cannot connect, reset, closed early, bad HTTP
            await ex.permit.release("error")
            kind = "connect" if isinstance(exc, httpx.ConnectError) else "protocol"
            errors.labels(ex.label, kind).inc()
            msg = f"upstream {route.upstream} failed: {type(exc).__name__}"
            await self.answers.error(ex, 502, "upstream_error", msg, gate=route.gate)

    async def _respond(self, ex: Exchange, answer: Answer) -> None:
        """Pass the upstream's answer to the caller: its head, then its body as the reader task
        (:meth:`_read`) takes it from the upstream."""
        if await self._refused(ex, answer):
            return
        queue: asyncio.Queue[object] = asyncio.Queue()
        settle = None
        if ex.estimate is not None and 200 <= answer.response.status_code < 300:
            kind = answer.response.headers.get("content-type", "")
            settle = Settle(kind.lower(), ex.estimate.added_usage)
        reader = asyncio.ensure_future(self._read(ex, answer, queue, settle))
        ex.inbound.on_gone(functools.partial(_cancel, reader))
        response = answer.response
        status = response.status_code
        headers = forward_response_headers(response.headers.raw, status, self.via)
        if not any(k == b"date" for k, _ in headers):
            headers.append((b"date", http_date()))
        send = ex.send
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

    async def _refused(self, ex: Exchange, answer: Answer) -> bool:
        """Whether the upstream's answer is not passed on -- a status that is no HTTP status, a
        declared length above ``max_response_bytes`` -- and a 502 went instead."""
        limit = self.max_response_bytes
        response = answer.response
        status = response.status_code
        route = ex.route
        if not 100 <= status <= 599:  # h11 reads 100-999; the server to the caller sends <= 599
            await answer.aclose()
            await ex.permit.release("error")
            self.metrics.upstream_errors.labels(ex.label, "protocol").inc()
            msg = f"upstream {route.upstream} answered status {status}, not an HTTP status"
            await self.answers.error(ex, 502, "upstream_error", msg, gate=route.gate)
            return True
        declared = response.headers.get("content-length", "")
        bodiless = ex.method == "HEAD" or status in (204, 304)  # the length names no body here
        if declared.isdigit() and int(declared) > limit and not bodiless:
            await answer.aclose()
            await ex.permit.release("ok", asyncio.get_running_loop().time() - ex.sent_at)
            self.metrics.upstream_errors.labels(ex.label, "too_large").inc()
            msg = f"the upstream's response ({declared} bytes) exceeds {limit} bytes"
            await self.answers.error(ex, 502, "response_too_large", msg, gate=route.gate)
            return True
        return False

    async def _read(
        self, ex: Exchange, answer: Answer, queue: asyncio.Queue[object], settle: Settle | None
    ) -> None:
        """Take the body from the upstream as fast as it comes into ``queue`` (then ``_END``,
        or None when cut short); free the permit when it ends, with the tokens the answer
        said it used when ``settle`` reads them (what it returns is what the caller gets)."""
        limit = self.max_response_bytes
        loop = asyncio.get_running_loop()
        route = ex.route
        outcome: str | None = None
        response = answer.response
        complete = False

        async def pull() -> None:
            total = 0
            # the stream itself: aiter_raw() would pool the connection at its end, before
            # Answer.aclose looked at it
            stream = response.stream
            assert isinstance(stream, httpx.AsyncByteStream)  # the async transport's
            if settle is None:
                async for chunk in stream:
                    total += len(chunk)
                    if total > limit:
                        raise _TooLarge
                    queue.put_nowait(chunk)
                return
            async for chunk in stream:
                total += len(chunk)
                if total > limit:
                    raise _TooLarge
                out = settle.feed(chunk)
                if out:
                    queue.put_nowait(out)
            rest = settle.end()
            if rest:
                queue.put_nowait(rest)

        errors = self.metrics.upstream_errors
        try:
            await _within(pull(), route.stream_timeout_s)
        except asyncio.CancelledError:
            self.metrics.disconnects.labels(ex.label, "response").inc()
            ex.note = "gone mid-response"
            queue.put_nowait(None)
            raise
        except (TimeoutError, asyncio.TimeoutError):
            outcome, ex.note = "timeout", f"stream cut after {route.stream_timeout_s:g} s"
            errors.labels(ex.label, "timeout").inc()
            queue.put_nowait(None)
        except _TooLarge:
            outcome, ex.note = "ok", f"response cut at {limit} bytes"
            errors.labels(ex.label, "too_large").inc()
            queue.put_nowait(None)
        except httpx.TransportError as exc:
            outcome, ex.note = "error", f"upstream failed mid-response: {type(exc).__name__}"
            errors.labels(ex.label, "protocol").inc()
            queue.put_nowait(None)
        else:
            outcome, complete = classify(response.status_code), True
            queue.put_nowait(_END)
        finally:
            await answer.aclose(complete=complete)
            used = None
            if settle is not None and complete:
                used = ex.used = settle.used
            if used is not None and ex.asked().tokens <= 0:
                used = None  # nothing asked to count it against (the ratio would skew)
            await ex.permit.release(outcome, loop.time() - ex.sent_at, used)
