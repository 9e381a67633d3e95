"""The proxy's ASGI app: one permit of the route's gate per forwarded request.

One exchange (:class:`~._exchange.Exchange`), in order (each step may answer instead of going
on; the answers are :mod:`._answers`'):

1. the request head (:func:`~._checks.refusal`: 431, 400, 501, 413, 508), a route for the
   path (404); a declared body with no room in ``max_buffered_bytes`` (503, nothing read);
2. the ``X-Fleetgate-*`` headers -> the permit asked for (:func:`~.policy.parse_ask`; 400);
3. the route by the JSON body's ``model`` when routes name models (the body is read first);
4. the whole body, unless the route streams its uploads (``stream_uploads``): a request joins
   the gate's queue only once it can be sent at once, so a permit always means the upstream is
   working (408 stalled, 413, 503 no room to buffer it, 504 past the deadline);
5. the permit: ``Overloaded`` -> 429 with ``Retry-After``; the deadline while queued -> 504; a
   caller that disconnects while queued leaves the wait list (no permit consumed);
6. the upstream call and the answer streamed back under the permit
   (:meth:`~._upstream.Relay.forward`): 504 past the deadline, 502 when the upstream cannot be
   reached; the permit freed the moment the upstream is done, whatever the caller's pace.

The deadline counts from the request's arrival: the body's read, the queue wait and the time
to the upstream's response headers are all in it.

The app never raises into the server: every failure becomes a response (or, once the response
has started, a cut connection). No header value, query string or URL credential is logged.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from fleetgate.client import Fleet, Gate, Lease
from fleetgate.errors import FleetgateError

from ._answers import CLIENT_CLOSED, ENCODER, Answers, send_plain
from ._checks import content_length, refusal
from ._exchange import Exchange, Permit, Receive, Scope, Send, log_access
from ._inbound import BodyBudget, CallerStopped, Inbound
from ._shared import WorkerContext, WorkerGauges
from ._tokens import Learnt, TokenPlan, load_tokenizer
from ._upstream import Relay
from .config import ProxyConfig, RouteConfig
from .metrics import ProxyMetrics
from .policy import TOKENS, BadHeader, deadline_ms_of, deadline_of, parse_ask

__all__ = ["ProxyApp"]

log = logging.getLogger("fleetgate.proxy")


class _Model(msgspec.Struct):
    model: str | None = None


def _single_tokens_header(ex: Exchange) -> bool:
    """Whether the request named its tokens (``X-Fleetgate-Tokens``): they win over the
    estimate."""
    return any(k == TOKENS for k, _ in ex.scope["headers"])


async def _give_back(lease: Lease) -> None:
    await lease.release()


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
        *,
        worker: WorkerContext | None = None,
    ) -> None:
        self.config = config
        self.fleet = fleet
        self.registry = registry
        self.metrics = ProxyMetrics.create(registry)
        self.answers = Answers(config.proxy, self.metrics)
        self.draining = False
        #: the request body bytes buffered across all connections (``max_buffered_bytes``)
        self.budget = BodyBudget(config.proxy.max_buffered_bytes)
        #: one worker of ``--workers N``: the metrics and health of all workers (``_shared``)
        self.worker = worker
        self.shared = None if worker is None else worker.shared()
        self.worker_gauges = None if worker is None else WorkerGauges.create(registry)
        if self.worker_gauges is None:
            self.metrics.buffered_bytes.set_function(lambda: self.budget.used)
        else:  # a function gauge is not written to the shared files: refresh() sets it
            self.worker_gauges.workers.set(1)
        self._gates: dict[str, Gate] = {}
        self._gauges: dict[str, Gauge] = {}
        self._children: dict[tuple[str, str], tuple[Counter, Histogram]] = {}
        self._answered = 0  # exchanges answered below 400, for access_log_sample
        #: this proxy's name in Via (RFC 9110 7.6.3, a pseudonym): a request naming it has
        #: come back (508); another fleetgate proxy's is a chain, not a loop
        via = f"fleetgate-{secrets.token_hex(4)}" if worker is None else worker.via_name
        self.via_name = via.encode("ascii")
        self.via = (b"via", b"1.1 " + self.via_name)
        self.relay = Relay(config, self.metrics, self.answers, self.via)
        self._learnt: dict[str, Learnt] = {}
        #: the token estimate of each route with ``tokens = "openai"``, by id(route)
        self.plans: dict[int, TokenPlan] = {}
        for route in config.routes:
            self.gate(route)  # registered now: live pod of the gate, defaults in Redis
            if route.tokens == "openai":
                learnt = self._learnt.get(route.gate)
                if learnt is None:
                    learnt = self._learnt[route.gate] = Learnt(self.gate(route))
                tokenizer = load_tokenizer(route.tokenizer)
                plan = TokenPlan(tokenizer, route.output_tokens, route.stream_usage, learnt)
                self.plans[id(route)] = plan

    def gate(self, route: RouteConfig) -> Gate:
        """The fleet's gate of ``route`` (one per gate name, with the route's defaults)."""
        found = self._gates.get(route.gate)
        if found is None:
            found = self.fleet.gate(route.gate, **route.gate_defaults)
            self._gates[route.gate] = found
        return found

    def refresh(self) -> None:
        """With ``--workers``: write this worker's buffered bytes and fallback state to the
        shared metric files (the server calls it 20 times a second); else nothing."""
        if self.worker_gauges is not None:
            self.metrics.buffered_bytes.set(self.budget.used)
            self.worker_gauges.in_fallback.set(1 if self.fleet.fallback_active else 0)

    async def aclose(self) -> None:
        """Close the upstream connection pools."""
        await asyncio.gather(*(learnt.aclose() for learnt in self._learnt.values()))
        await self.relay.aclose()

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
            await self._metrics(scope, send)
            return
        client = scope.get("client")
        inbound = Inbound(receive, settings.max_request_bytes, settings.body_timeout_s, self.budget)
        ex = Exchange(scope, send, inbound, scope["method"], path, client[0] if client else "-")
        ex.begun = asyncio.get_running_loop().time()
        try:
            await self._exchange(ex)
        except asyncio.CancelledError:
            # uvicorn cancels what still runs when the drain's time is up, and answers 500 to a
            # cancelled request that sent nothing: say what happened instead (the exchange has
            # left the wait list or released its permit on the way out)
            if not self.draining or ex.status != 0:
                raise
            await self.answers.shutting_down(ex)
        except Exception:
            # A bug of ours: log it (no header values), answer 502 if nothing was sent yet.
            log.exception("proxy: unexpected error on %s %s", ex.method, ex.path)
            if ex.status == 0:
                ex.status = 502
                await self.answers.error(ex, 502, "proxy_error", "the proxy failed on this request")
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
        # Never reached Redis: a wrong URL (or a Redis not up yet), not an outage: not ready.
        # An outage after Redis answered once stays ready (the fallback serves; "fallback").
        never = not self.fleet.reached_redis
        status = 503 if self.draining or never else 200
        body: dict[str, object] = {
            "status": "draining" if self.draining else "redis_never_reached" if never else "ok",
            "fallback": self.fleet.fallback_active,
            "routes": [r.describe() for r in self.config.routes],
        }
        if self.worker is not None and self.shared is not None:
            # every worker drains at once (the parent signals all): this one's state is the
            # proxy's; fallback and the count are all live workers'
            live, in_fallback = self.shared.status()
            body["fallback"] = self.fleet.fallback_active or in_fallback > 0
            body["workers"] = {"configured": self.worker.workers, "live": live}
        await send_plain(send, status, ENCODER.encode(body), "application/json")

    async def _metrics(self, scope: Scope, send: Send) -> None:
        if scope["method"] in ("GET", "HEAD"):
            shared = self.shared
            text = generate_latest(self.registry) if shared is None else shared.exposition()
            await send_plain(send, 200, text, CONTENT_TYPE_LATEST)
        else:
            body = ENCODER.encode(
                {"error": {"type": "method_not_allowed", "message": "GET or HEAD only"}}
            )
            await send_plain(send, 405, body, "application/json", [(b"allow", b"GET, HEAD")])

    # -- one exchange ------------------------------------------------------------------------

    async def _exchange(self, ex: Exchange) -> None:
        refused = refusal(ex.scope, self.config.proxy, self.via_name)
        if refused is not None:
            status, kind, msg, close = refused
            await self.answers.error(ex, status, kind, msg, close=close)
            return
        routes = [r for r in self.config.routes if r.matches_path(ex.path)]
        if not routes:
            await self.answers.error(ex, 404, "no_route", f"no route for path {ex.path!r}")
            return
        declared = content_length(ex.scope["headers"])  # one number: refusal checked it
        if declared and not routes[0].stream_uploads and not self.budget.fits(declared):
            await self.answers.buffers_full(ex)  # no room for a body read whole: none of it
            return
        pump = asyncio.ensure_future(ex.inbound.run())
        try:
            await self._routed(ex, routes)
        finally:
            pump.cancel()
            await asyncio.gather(pump, return_exceptions=True)
            ex.inbound.release()

    async def _routed(self, ex: Exchange, routes: list[RouteConfig]) -> None:
        """Parse the ask, route ``ex`` (the first of ``routes`` that takes its model), read its
        body unless the route streams uploads, then on to the gate; ``ex`` carries the route,
        the target and the ask from here."""
        # the asks of the routes the request may take: all when a model picks, else the first
        candidates = routes if routes[0].models else routes[:1]
        try:
            asks = {id(r): parse_ask(ex.scope["headers"], r) for r in candidates}
        except BadHeader as exc:  # the headers' form is every route's: the route cannot mend it
            await self.answers.error(ex, 400, "bad_header", str(exc))
            return
        route = await self._by_model(ex, routes, max(deadline_ms_of(a) for a in asks.values()))
        if route is None:
            return
        ex.route, ex.label, ex.gate, ex.ask = route, route.label, route.gate, asks[id(route)]
        target = route.upstream_path(ex.scope.get("raw_path") or ex.path.encode())
        if target is None:
            msg = f"route {route.label!r} strips {route.path!r}: it must not be percent-encoded"
            await self.answers.error(ex, 400, "bad_request", msg)
            return
        ex.target = target
        # the whole body first (a permit means the upstream is working) unless the route streams
        if not route.stream_uploads:
            body = await self._body(ex, deadline_ms_of(ex.ask))
            if body is None:
                return
            plan = self.plans.get(id(route))
            if plan is not None and ex.method == "POST":
                await self._estimate(ex, plan, body)
        gauge = self._gauges.get(route.label)
        if gauge is None:
            gauge = self._gauges[route.label] = self.metrics.in_flight.labels(route.label)
        gauge.inc()
        try:
            await self._gated(ex)
        finally:
            gauge.dec()

    async def _by_model(
        self, ex: Exchange, routes: list[RouteConfig], deadline_ms: int
    ) -> RouteConfig | None:
        """The route of ``ex``: the first of ``routes``, or when routes name models, the first
        that takes the JSON body's ``model`` (the body read within ``deadline_ms``, the longest
        deadline the request has on any of them); None when answered instead (404, the body)."""
        route = routes[0]
        if not route.models:
            return route
        body = await self._body(ex, deadline_ms)
        if body is None:
            return None
        try:
            model = msgspec.json.decode(body, type=_Model).model
        except msgspec.DecodeError:
            model = None
        found = next((r for r in routes if not r.models or model in r.models), None)
        if found is None:
            shown = "no model" if model is None else f"model {model[:100]!r}"
            msg = f"no route for path {ex.path!r} and {shown}"
            await self.answers.error(ex, 404, "no_route", msg)
        return found

    async def _estimate(self, ex: Exchange, plan: TokenPlan, body: bytes) -> None:
        """The tokens ``ex`` asks for on a route with ``tokens = "openai"``: its body's estimate
        (none when it is no OpenAI-compatible body), within the gate's token ceiling, unless an
        ``X-Fleetgate-Tokens`` header named them."""
        learnt = plan.learnt
        if not learnt.done:  # once per gate and process: the ceiling to clamp to
            await learnt.ready(0.5)
        learnt.read()  # a refresh in the background when the last is old
        path = ex.target.partition(b"?")[0].decode("latin-1")
        ask = ex.asked()
        estimate = plan.estimate(path, body, ask.tenant)
        if estimate is None:
            return
        ex.estimate = estimate
        if _single_tokens_header(ex):
            return
        ex.ask = dataclasses.replace(ask, tokens=plan.clamp(estimate.tokens))

    async def _body(self, ex: Exchange, deadline_ms: int) -> bytes | None:
        """The whole body of ``ex`` within what is left of its deadline of ``deadline_ms``
        (counted from its arrival), or None when answered instead: gone, 408 stalled, 413, 503
        no room to buffer it, 504 past the deadline (the connection closed)."""
        left = deadline_ms / 1000 - (asyncio.get_running_loop().time() - ex.begun)
        try:
            return await ex.inbound.read_all(max(left, 0.0))
        except CallerStopped as exc:
            await self.answers.caller_failed(ex, exc, "body")
        except TimeoutError:
            await self.answers.late(ex, deadline_ms, "the request body was complete", close=True)
        return None

    async def _gated(self, ex: Exchange) -> None:
        """Wait for the permit ``ex`` asks for, within the rest of its deadline, then forward
        under it."""
        ask = ex.asked()
        gate = self.gate(ex.route)
        loop = asyncio.get_running_loop()
        ex.asked_at = loop.time()
        left = deadline_of(ask) - (ex.asked_at - ex.begun)
        if left <= 0:  # the body's read took it all
            await self.answers.late(ex, deadline_ms_of(ask), "a permit was asked")
            return
        acquire = asyncio.ensure_future(gate.acquire(ask=dataclasses.replace(ask, deadline=left)))
        try:
            lease = await ex.inbound.race(acquire, discard=_give_back)
        except CallerStopped as exc:
            await self.answers.caller_failed(ex, exc, "queued")
            return
        except FleetgateError as exc:
            await self.answers.not_granted(ex, exc)
            return
        ex.wait_ms = (loop.time() - ex.asked_at) * 1000
        ex.permit = Permit(lease)
        # A revoked lease (a higher band waited past the gate's revoke_after) cuts the upstream
        # call: the heartbeat that learns it cancels the forwarding task.
        forward = asyncio.ensure_future(self.relay.forward(ex))
        cut: list[bool] = []

        def revoked() -> None:
            cut.append(True)
            forward.cancel()

        lease.when_revoked(revoked)
        try:
            try:
                await asyncio.wait({forward})  # (a cancellation of this task stops here)
            except asyncio.CancelledError:
                forward.cancel()
                await asyncio.gather(forward, return_exceptions=True)
                raise
            if cut and forward.cancelled():
                await self.answers.revoked(ex)
            else:
                forward.result()  # its error, if it failed
        finally:
            lease.when_revoked(None)
            await ex.permit.release()  # no-op when the upstream's end released it

    def _account(self, ex: Exchange) -> None:
        seconds = time.monotonic() - ex.started
        status = str(ex.status or CLIENT_CLOSED)
        # the labelled children, looked up once (prometheus-client takes a lock per lookup)
        key = (ex.label, status)
        children = self._children.get(key)
        if children is None:
            children = (
                self.metrics.requests.labels(ex.label, status),
                self.metrics.seconds.labels(ex.label, status),
            )
            self._children[key] = children
        children[0].inc()
        children[1].observe(seconds)
        if ex.used is not None and ex.ask is not None and ex.ask.tokens > 0:
            self.metrics.settled(ex.label, ex.ask.tokens, ex.used)
        if self.config.proxy.access_log and self._sampled(ex):
            log_access(ex, status, seconds)

    def _sampled(self, ex: Exchange) -> bool:
        """Whether ``ex`` has its access log line: with ``access_log_sample`` N, the first of
        every N exchanges answered below 400; every other exchange always."""
        every = self.config.proxy.access_log_sample
        if every == 1 or not 100 <= ex.status < 400:
            return True
        self._answered += 1
        return self._answered % every == 1
