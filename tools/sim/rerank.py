"""A NIM-like reranker stand-in: batch cost grows with passages, a bounded queue, a server timeout.

``POST /v1/ranking`` takes ``{"model", "query": {"text"}, "passages": [{"text"}, ...],
"truncate"}`` and answers ``{"rankings": [{"index", "logit"}, ...]}`` sorted by logit, highest
first (logits are a deterministic function of the texts). At most ``concurrency`` calls are served
at once, each for ``base_ms + per_passage_ms * len(passages)``; the rest wait in a FIFO queue of
``queue_size`` (full: 503 at once). A call that waits and runs longer than ``request_timeout_ms``
gets 504, so an ungated burst fails the way a real NIM does when its queue outgrows the timeout.

Run it with ``fleetgate sim rerank`` or ``python -m fleetgate.tools.sim.rerank --help``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, fields
from typing import Any, Literal

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from fleetgate.tools.sim._server import (
    FifoLimiter,
    QueueFull,
    add_server_args,
    common_routes,
    error_response,
    json_response,
    run_cli,
    run_unless_disconnected,
)

__all__ = [
    "RerankSim",
    "RerankSimConfig",
    "build_app",
    "build_parser",
    "config_from_args",
    "main",
    "score",
]

_OUTCOMES = ("ok", "bad_request", "rejected", "timeout", "aborted")
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass(frozen=True)
class RerankSimConfig:
    """Settings of one simulated reranker (see ``--help`` for each field's meaning)."""

    model: str = "nvidia/llama-3.2-nemoretriever-500m-rerank-v2"
    max_batch_size: int = 512
    concurrency: int = 4
    queue_size: int = 256
    request_timeout_ms: float = 10_000.0
    base_ms: float = 20.0
    per_passage_ms: float = 0.5

    def __post_init__(self) -> None:
        """Reject settings no server could have."""
        if self.max_batch_size < 1 or self.concurrency < 0 or self.queue_size < 0:
            raise ValueError("need max_batch_size >= 1, concurrency >= 0 and queue_size >= 0")
        if self.request_timeout_ms < 0 or self.base_ms < 0 or self.per_passage_ms < 0:
            raise ValueError("request_timeout_ms, base_ms and per_passage_ms must be >= 0")


class _Text(msgspec.Struct):
    text: str


class _RankingRequest(msgspec.Struct):
    query: _Text
    passages: list[_Text]
    model: str | None = None
    truncate: Literal["NONE", "END"] = "END"


_DECODER = msgspec.json.Decoder(_RankingRequest)


def score(query: str, passage: str) -> float:
    """The simulated logit: word overlap with the query plus a hash jitter, deterministic."""
    q_words = set(query.lower().split())
    overlap = len(q_words & set(passage.lower().split())) / len(q_words) if q_words else 0.0
    digest = hashlib.blake2b(f"{query}\x00{passage}".encode(), digest_size=8).digest()
    jitter = int.from_bytes(digest, "big") / 2**64
    return round(-8.0 + 12.0 * overlap + 2.0 * jitter, 6)


class _RerankMetrics:
    """The simulator's own Prometheus families on a private registry (``model`` label)."""

    def __init__(self, model: str) -> None:
        reg = self.registry = CollectorRegistry()
        self.model = model
        self.running = Gauge(
            "nim_rerank_requests_running",
            "Ranking calls being served now.",
            ["model"],
            registry=reg,
        )
        self.waiting = Gauge(
            "nim_rerank_requests_waiting",
            "Ranking calls waiting in the server's queue.",
            ["model"],
            registry=reg,
        )
        self.requests = Counter(
            "nim_rerank_requests",
            "Ranking calls by outcome: ok=200, bad_request=400/404, rejected=503 (queue full), "
            "timeout=504 (server-side request timeout), aborted=client went away.",
            ["model", "outcome"],
            registry=reg,
        )
        self.passages = Counter(
            "nim_rerank_passages", "Passages ranked in successful calls.", ["model"], registry=reg
        )
        self.latency = Histogram(
            "nim_rerank_request_latency_seconds",
            "Queue plus service time of successful calls.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.queue = Histogram(
            "nim_rerank_queue_time_seconds",
            "Time admitted calls waited in the queue.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        for outcome in _OUTCOMES:
            self.requests.labels(model, outcome)
        for metric in (self.running, self.waiting, self.passages, self.latency, self.queue):
            metric.labels(model)

    def render(self, limiter: FifoLimiter) -> bytes:
        """Set the gauges from ``limiter`` and return the text exposition."""
        self.running.labels(self.model).set(limiter.running)
        self.waiting.labels(self.model).set(limiter.waiting)
        return generate_latest(self.registry)


class RerankSim:
    """The simulated reranker: FIFO admission under ``concurrency``, queue bound, timeout."""

    def __init__(self, config: RerankSimConfig) -> None:
        """Build the server state for ``config`` (no event loop needed yet)."""
        self.config = config
        self.limiter = FifoLimiter(config.concurrency, config.queue_size)
        self.metrics = _RerankMetrics(config.model)
        self.counts = dict.fromkeys(_OUTCOMES, 0)

    def count(self, outcome: str) -> None:
        """Count one call's outcome (``ok``, ``bad_request``, ``rejected``, ...)."""
        self.counts[outcome] += 1
        self.metrics.requests.labels(self.config.model, outcome).inc()

    def service_seconds(self, passages: int) -> float:
        """``base_ms + per_passage_ms * passages``, in seconds."""
        return (self.config.base_ms + self.config.per_passage_ms * passages) / 1000.0

    async def rank(self, query: str, passages: list[str]) -> list[dict[str, Any]]:
        """Queue, serve and rank one call; raises QueueFull (503) or TimeoutError (504)."""
        loop = asyncio.get_running_loop()
        arrived = loop.time()

        async def _work() -> None:
            await self.limiter.acquire()
            try:
                self.metrics.queue.labels(self.config.model).observe(loop.time() - arrived)
                await asyncio.sleep(self.service_seconds(len(passages)))
            finally:
                self.limiter.release()

        timeout = self.config.request_timeout_ms / 1000.0 or None
        try:
            await asyncio.wait_for(_work(), timeout)
        except QueueFull:
            self.count("rejected")
            raise
        except asyncio.TimeoutError:
            self.count("timeout")
            raise
        except asyncio.CancelledError:
            self.count("aborted")
            raise
        self.count("ok")
        self.metrics.passages.labels(self.config.model).inc(len(passages))
        self.metrics.latency.labels(self.config.model).observe(loop.time() - arrived)
        ranked = [{"index": i, "logit": score(query, text)} for i, text in enumerate(passages)]
        ranked.sort(key=lambda r: (-r["logit"], r["index"]))
        return ranked

    def stats(self) -> dict[str, Any]:
        """The ``/admin/stats`` body (``capacity`` is the current concurrency)."""
        lim = self.limiter
        return {
            "model": self.config.model,
            "capacity": lim.capacity,
            "queue_size": lim.max_waiting,
            "running": lim.running,
            "waiting": lim.waiting,
            "in_flight": lim.in_flight,
            "peak_running": lim.peak_running,
            "peak_in_flight": lim.peak_in_flight,
            "served": self.counts["ok"],
            "rejected": self.counts["rejected"],
            "timed_out": self.counts["timeout"],
            "bad_request": self.counts["bad_request"],
            "aborted": self.counts["aborted"],
        }


def _refusal(body: _RankingRequest, cfg: RerankSimConfig) -> Response | None:
    """The 400 or 404 answer to a decoded request the server refuses, None when it is served."""
    if body.model is not None and body.model != cfg.model:
        return error_response(
            404,
            f"model {body.model!r} is not served here (this server serves {cfg.model!r})",
            "NotFoundError",
        )
    if not body.passages:
        return error_response(400, "passages must hold at least one passage", "BadRequestError")
    if len(body.passages) > cfg.max_batch_size:
        return error_response(
            400,
            f"{len(body.passages)} passages exceed max_batch_size "
            f"{cfg.max_batch_size}; split the call into batches of at most "
            f"{cfg.max_batch_size}",
            "BadRequestError",
        )
    return None


def _ranking(sim: RerankSim) -> Callable[[Request], Awaitable[Response]]:
    """The ``POST /v1/ranking`` handler: decode, check, wait for a slot and rank, answer."""
    cfg = sim.config

    async def ranking(request: Request) -> Response:
        try:
            body = _DECODER.decode(await request.body())
        except ClientDisconnect:  # the caller gave up before its body arrived: nobody to answer
            sim.count("aborted")
            return Response(status_code=499)
        except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
            sim.count("bad_request")
            return error_response(400, f"invalid ranking request: {exc}", "BadRequestError")
        refusal = _refusal(body, cfg)
        if refusal is not None:
            sim.count("bad_request")
            return refusal
        texts = [p.text for p in body.passages]
        try:
            finished, rankings = await run_unless_disconnected(
                request, sim.rank(body.query.text, texts)
            )
        except QueueFull as exc:
            return error_response(
                503, f"server busy, request queue full: {exc}", "ServiceUnavailableError"
            )
        except asyncio.TimeoutError:
            return error_response(
                504,
                f"request timed out after {cfg.request_timeout_ms:g} ms in the server "
                "(queue wait plus inference)",
                "GatewayTimeoutError",
            )
        if not finished:
            return Response(status_code=499)  # the client is gone; nobody reads this
        return json_response({"rankings": rankings})

    return ranking


def build_app(config: RerankSimConfig | None = None) -> Starlette:
    """Build the ASGI app; the server state is ``app.state.sim`` (a :class:`RerankSim`)."""
    cfg = config or RerankSimConfig()
    sim = RerankSim(cfg)
    app = Starlette(
        routes=[
            Route("/v1/ranking", _ranking(sim), methods=["POST"]),
            *common_routes(sim.limiter, sim.stats, lambda: sim.metrics.render(sim.limiter)),
        ]
    )
    app.state.sim = sim
    app.state.config = cfg
    return app


def build_parser() -> argparse.ArgumentParser:
    """The ``fleetgate sim rerank`` argument parser."""
    p = argparse.ArgumentParser(
        prog="fleetgate sim rerank",
        description="Simulated NIM reranker: POST /v1/ranking with a service time that grows "
        "with the passages, at most --concurrency calls at once, a bounded FIFO queue (503 when "
        "full) and a server-side request timeout (504), plus /metrics and /admin endpoints.",
    )
    add_server_args(p, default_port=8001)
    p.add_argument(
        "--model",
        default=RerankSimConfig.model,
        help="served model name; a request naming another model gets 404 (default: %(default)s)",
    )
    p.add_argument(
        "--max-batch-size",
        type=int,
        default=512,
        help="most passages one call may carry; more gets 400 (default: %(default)s)",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=4,
        metavar="C",
        help="calls served at once; changeable at run time with POST /admin/capacity "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--queue-size",
        type=int,
        default=256,
        metavar="Q",
        help="calls that may wait for a free slot; when full, 503 at once (default: %(default)s)",
    )
    p.add_argument(
        "--request-timeout-ms",
        type=float,
        default=10_000.0,
        metavar="T",
        help="a call that waits plus runs longer than T ms gets 504; 0 disables "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--base-ms",
        type=float,
        default=20.0,
        metavar="B",
        help="fixed service time per call in ms (default: %(default)s)",
    )
    p.add_argument(
        "--per-passage-ms",
        type=float,
        default=0.5,
        metavar="P",
        help="extra service time per passage in ms (default: %(default)s)",
    )
    return p


def config_from_args(ns: argparse.Namespace) -> RerankSimConfig:
    """Turn parsed arguments into a :class:`RerankSimConfig`."""
    names = {f.name for f in fields(RerankSimConfig)}
    return RerankSimConfig(**{k: v for k, v in vars(ns).items() if k in names})


def main(argv: list[str] | None = None) -> int:
    """Run the simulator until interrupted; returns the process exit code."""
    return run_cli(build_parser(), lambda ns: build_app(config_from_args(ns)), argv)


if __name__ == "__main__":
    raise SystemExit(main())
