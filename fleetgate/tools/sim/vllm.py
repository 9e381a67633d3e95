"""A vLLM stand-in: OpenAI-compatible endpoints with a hard ``max_num_seqs`` and vLLM's /metrics.

``--flavor`` makes the same engine expose another server's metrics instead (SGLang, TGI, TEI,
llama.cpp, TensorRT-LLM, NIM: :mod:`fleetgate.tools.sim.flavors`) at that server's path, with its
overload behaviour (TGI and TEI answer 429 beyond ``--max-concurrent-requests``);
``--no-metrics`` serves none.

Each request waits in FIFO order for one of ``capacity`` slots (vLLM's ``max_num_seqs``), holds it
for a sampled service time, and answers in OpenAI shape. ``/metrics`` uses vLLM's exact family
names, HELP/TYPE lines and ``model_name``/``engine`` labels, so the coordinator's scraper can be
tested against it. ``/admin/*`` changes capacity at run time and exposes counters and peaks, so a
test can act as an invariant checker (peak running never above the fleet-wide limit, ...).

Run it with ``fleetgate sim vllm --capacity 8`` or ``python -m fleetgate.tools.sim.vllm --help``.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, fields
from typing import Any, Literal

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from fleetgate.tools.sim._server import (
    TEXT_PLAIN,
    FifoLimiter,
    QueueFull,
    add_server_args,
    common_routes,
    error_response,
    json_response,
    read_json_object,
    run_cli,
    run_unless_disconnected,
)
from fleetgate.tools.sim.flavors import FLAVORS, METRICS_PATHS, TrtllmExposition, make_exposition

__all__ = [
    "ServiceDist",
    "VllmSim",
    "VllmSimConfig",
    "build_app",
    "build_parser",
    "config_from_args",
    "main",
]

ServiceDist = Literal["fixed", "exp", "lognormal"]
_LOGNORMAL_SIGMA = 0.5
_DEFAULT_GEN_TOKENS = 16
# vLLM's request_latency_buckets (v1/metrics/loggers.py), used for e2e and queue time.
_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
_FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
_LEGACY_FINISH_REASONS = ("stop", "length", "abort")
_VOCAB = (
    "the",
    "model",
    "server",
    "token",
    "batch",
    "queue",
    "fleet",
    "gate",
    "simulated",
    "reply",
    "of",
    "and",
    "a",
    "to",
    "in",
    "is",
)


@dataclass(frozen=True)
class VllmSimConfig:
    """Settings of one simulated vLLM server (see ``--help`` for each field's meaning)."""

    model: str = "sim-model"
    capacity: int = 8
    engines: int = 1
    service_ms: float = 50.0
    service_dist: ServiceDist = "fixed"
    occupancy_slowdown: float = 0.0
    max_waiting: int | None = None
    legacy_metrics: bool = False
    seed: int | None = None
    embedding_dim: int = 16
    max_model_len: int = 8192
    flavor: str = "vllm"
    metrics: bool = True
    #: TGI/TEI's ``--max-concurrent-requests`` (None: the server's default, 128 / 512)
    max_concurrent_requests: int | None = None
    #: the status of a request refused past ``max_waiting`` (503, or 429 as API gateways do)
    overload_status: int = 503

    @property
    def concurrency_limit(self) -> int | None:
        """Requests admitted at once (running + queued) before a 429, or None (no such limit)."""
        if self.max_concurrent_requests is not None:
            return self.max_concurrent_requests
        return {"tgi": 128, "tei": 512}.get(self.flavor)

    @property
    def metrics_path(self) -> str | None:
        """Where this flavour serves its Prometheus text (None with ``--no-metrics``)."""
        return METRICS_PATHS[self.flavor] if self.metrics else None

    def __post_init__(self) -> None:
        """Reject settings no server could have."""
        if self.flavor not in FLAVORS:
            raise ValueError(f"unknown flavor {self.flavor!r} (known: {', '.join(FLAVORS)})")
        if self.max_concurrent_requests is not None and (
            self.flavor not in ("tgi", "tei") or self.max_concurrent_requests < 1
        ):
            raise ValueError("max_concurrent_requests is TGI's and TEI's, and must be >= 1")
        if self.capacity < 0 or self.engines < 1 or self.service_ms < 0:
            raise ValueError("need capacity >= 0, engines >= 1 and service_ms >= 0")
        if self.service_dist not in ("fixed", "exp", "lognormal"):
            raise ValueError(f"unknown service_dist {self.service_dist!r}")
        if self.occupancy_slowdown < 0 or (self.max_waiting is not None and self.max_waiting < 0):
            raise ValueError("occupancy_slowdown and max_waiting must be >= 0")
        if self.embedding_dim < 1:
            raise ValueError("embedding_dim must be >= 1")
        if self.overload_status not in (429, 503):
            raise ValueError("overload_status must be 429 or 503")


def _split(total: int, parts: int) -> list[int]:
    """Spread ``total`` over ``parts`` deterministically, lower indexes first."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


_HELP_BY_REASON = (
    "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling "
    "capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked "
    "status). Sum of all reasons equals vllm:num_requests_waiting."
)


class _VllmMetrics:
    """vLLM's Prometheus families on a private registry; gauges are filled at scrape time."""

    content_type = TEXT_PLAIN

    def __init__(self, config: VllmSimConfig) -> None:
        reg = self.registry = CollectorRegistry()
        lbl = ["model_name", "engine"]
        self.engines = [str(i) for i in range(config.engines)]
        self.model = config.model
        legacy = config.legacy_metrics
        kw: dict[str, Any] = {"labelnames": lbl, "registry": reg}
        hist: dict[str, Any] = {**kw, "buckets": _LATENCY_BUCKETS}
        # Registration order is exposition order; names and HELP strings are vLLM's own.
        self.running = Gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", **kw
        )
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", **kw
        )
        self.by_reason = (
            None
            if legacy
            else Gauge(
                "vllm:num_requests_waiting_by_reason",
                _HELP_BY_REASON,
                [*lbl, "reason"],
                registry=reg,
            )
        )
        if legacy:
            self.kv = Gauge(
                "vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.", **kw
            )
        else:
            self.kv = Gauge(
                "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", **kw
            )
        self.preemptions = Counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.", **kw
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", **kw
        )
        self.gen_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", **kw
        )
        self.success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*lbl, "finished_reason"],
            registry=reg,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            **hist,
        )
        self.queue = Histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            **hist,
        )
        for eng in self.engines:  # every series exists from the start, as in vLLM
            for metric in (
                self.running,
                self.waiting,
                self.kv,
                self.preemptions,
                self.prompt_tokens,
                self.gen_tokens,
                self.e2e,
                self.queue,
            ):
                metric.labels(self.model, eng)
            for reason in _LEGACY_FINISH_REASONS if legacy else _FINISH_REASONS:
                self.success.labels(self.model, eng, reason)
            if self.by_reason is not None:
                self.by_reason.labels(self.model, eng, "capacity")
                self.by_reason.labels(self.model, eng, "deferred")

    def finished(
        self, engine: int, prompt: int, generated: int, reason: str, e2e_s: float, queue_s: float
    ) -> None:
        """Record one finished request on ``engine``."""
        eng = self.engines[engine]
        self.prompt_tokens.labels(self.model, eng).inc(prompt)
        self.gen_tokens.labels(self.model, eng).inc(generated)
        self.success.labels(self.model, eng, reason).inc()
        self.e2e.labels(self.model, eng).observe(e2e_s)
        self.queue.labels(self.model, eng).observe(queue_s)

    def aborted(self, engine: int) -> None:
        """Record one request the client abandoned."""
        self.success.labels(self.model, self.engines[engine], "abort").inc()

    def rejected(self) -> None:
        """vLLM refuses nothing as overloaded; the simulator's 503s are not counted."""

    def arrived(self) -> None:
        """vLLM's gauges exist from the start."""

    def render(self, limiter: FifoLimiter) -> bytes:
        """Set the scheduler gauges from ``limiter`` and return the text exposition."""
        k = len(self.engines)
        runs, waits = _split(limiter.running, k), _split(limiter.waiting, k)
        caps = _split(limiter.capacity, k)
        for i, eng in enumerate(self.engines):
            self.running.labels(self.model, eng).set(runs[i])
            self.waiting.labels(self.model, eng).set(waits[i])
            usage = min(1.0, runs[i] / caps[i]) if caps[i] else (1.0 if runs[i] else 0.0)
            self.kv.labels(self.model, eng).set(usage)
            if self.by_reason is not None:
                self.by_reason.labels(self.model, eng, "capacity").set(waits[i])
                self.by_reason.labels(self.model, eng, "deferred").set(0)
        return generate_latest(self.registry)


class VllmSim:
    """The simulated engine: FIFO admission under ``capacity``, service time, counters."""

    def __init__(self, config: VllmSimConfig) -> None:
        """Build the engine state for ``config`` (no event loop needed yet)."""
        self.config = config
        self.limiter = FifoLimiter(config.capacity, config.max_waiting)
        self.metrics = (
            _VllmMetrics(config)
            if config.flavor == "vllm"
            else make_exposition(config.flavor, config.model, config.engines, config.capacity)
        )
        self.rng = random.Random(config.seed)
        self.served = 0
        self.rejected = 0
        self.aborted = 0
        self.created = int(time.time())
        self._next_engine = 0

    def service_seconds(self) -> float:
        """Sample one service time, stretched by batch occupancy if configured."""
        mean = self.config.service_ms / 1000.0
        if mean <= 0:
            return 0.0
        if self.config.service_dist == "exp":
            base = self.rng.expovariate(1.0 / mean)
        elif self.config.service_dist == "lognormal":
            mu = math.log(mean) - _LOGNORMAL_SIGMA**2 / 2  # keeps the mean at service_ms
            base = self.rng.lognormvariate(mu, _LOGNORMAL_SIGMA)
        else:
            base = mean
        occupancy = self.limiter.running / max(self.limiter.capacity, 1)
        return base * (1.0 + self.config.occupancy_slowdown * occupancy)

    async def execute(self, prompt_tokens: int, gen_tokens: int, reason: str) -> None:
        """Wait for a slot (FIFO), hold it for a service time, record the outcome.

        Raises :class:`QueueFull` when the waiting cap is exceeded (the caller answers 503) and
        :class:`Overloaded` when TGI/TEI's concurrency limit is reached (the caller answers 429).
        """
        self.metrics.arrived()
        limit = self.config.concurrency_limit
        if limit is not None and self.limiter.in_flight >= limit:
            self.rejected += 1
            self.metrics.rejected()
            raise Overloaded(f"{limit} requests already in flight")
        engine = self._next_engine
        self._next_engine = (engine + 1) % self.config.engines
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        admitted = None
        try:
            await self.limiter.acquire()
            admitted = loop.time()
            await asyncio.sleep(self.service_seconds())
        except QueueFull:
            self.rejected += 1
            raise
        except asyncio.CancelledError:  # the client went away (or the server is stopping)
            self.aborted += 1
            self.metrics.aborted(engine)
            raise
        finally:
            if admitted is not None:
                self.limiter.release()
        self.served += 1
        assert admitted is not None
        self.metrics.finished(
            engine, prompt_tokens, gen_tokens, reason, loop.time() - arrived, admitted - arrived
        )

    def stats(self) -> dict[str, Any]:
        """The ``/admin/stats`` body."""
        lim = self.limiter
        return {
            "model": self.config.model,
            "flavor": self.config.flavor,
            "capacity": lim.capacity,
            "engines": self.config.engines,
            "running": lim.running,
            "waiting": lim.waiting,
            "in_flight": lim.in_flight,
            "peak_running": lim.peak_running,
            "peak_in_flight": lim.peak_in_flight,
            "served": self.served,
            "rejected": self.rejected,
            "aborted": self.aborted,
            "max_waiting": lim.max_waiting,
        }


class _BadRequest(Exception):
    pass


class Overloaded(Exception):
    """TGI/TEI's concurrency limit is reached: the request is refused with 429."""


def _overloaded(flavor: str) -> Response:
    """The 429 body of TGI (``ErrorResponse``) or TEI's OpenAI route (``OpenAICompatError``)."""
    if flavor == "tei":
        body: dict[str, Any] = {"message": "Model is overloaded", "code": 429, "type": "Overloaded"}
    else:
        body = {"error": "Model is overloaded", "error_type": "overloaded"}
    return json_response(body, 429)


def _count_tokens(value: Any) -> int:
    """A rough token count: 4 characters a token for text, one per id for token-id lists."""
    if isinstance(value, str):
        return max(1, (len(value) + 3) // 4)
    if isinstance(value, list):
        if value and all(isinstance(v, int) for v in value):
            return len(value)
        return sum(_count_tokens(v) for v in value)
    if isinstance(value, dict):
        return _count_tokens(value.get("text") or value.get("content") or "")
    return 0


def _words(seed: str, n: int) -> str:
    return " ".join(random.Random(seed).choices(_VOCAB, k=min(n, 256)))  # text is capped


def _embedding(seed: str, dim: int) -> list[float]:
    rng = random.Random(seed)
    vec = [rng.gauss(0.0, 1.0) for _ in range(dim)]
    norm = math.sqrt(sum(v * v for v in vec)) or 1.0
    return [v / norm for v in vec]


_FIELDS = {"chat": "messages", "completion": "prompt", "embedding": "input"}


def _parse(kind: str, body: dict[str, Any], cfg: VllmSimConfig) -> tuple[int, int, str]:
    """Validate a request body; return (prompt tokens, generation tokens, finish reason)."""
    if body.get("model") not in (None, cfg.model):
        raise LookupError(f"The model `{body['model']}` does not exist.")
    if body.get("stream"):
        raise _BadRequest("stream=true is not supported by the simulator")
    field = _FIELDS[kind]
    value = body.get(field)
    if not isinstance(value, list if kind == "chat" else (str, list)) or not value:
        raise _BadRequest(f"{field} must be a non-empty {'list' if kind == 'chat' else 'value'}")
    if kind == "embedding":
        return _count_tokens(value), 0, "stop"
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    if limit is None:
        return _count_tokens(value), _DEFAULT_GEN_TOKENS, "stop"
    if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= cfg.max_model_len:
        raise _BadRequest(f"max_tokens must be an integer in [1, {cfg.max_model_len}]")
    return _count_tokens(value), limit, "length"


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def build_app(config: VllmSimConfig | None = None) -> Starlette:
    """Build the ASGI app; the engine state is ``app.state.sim`` (a :class:`VllmSim`)."""
    cfg = config or VllmSimConfig()
    sim = VllmSim(cfg)

    def endpoint(kind: str) -> Callable[[Request], Awaitable[Response]]:
        async def handle(request: Request) -> Response:
            body = await read_json_object(request)
            try:
                if body is None:
                    raise _BadRequest("request body must be a JSON object")
                prompt, gen, reason = _parse(kind, body, cfg)
            except _BadRequest as exc:
                return error_response(400, str(exc), "BadRequestError")
            except LookupError as exc:
                return error_response(404, str(exc), "NotFoundError")
            try:
                finished, _ = await run_unless_disconnected(
                    request, sim.execute(prompt, gen, reason)
                )
            except QueueFull as exc:
                if cfg.overload_status == 429:
                    return error_response(429, f"server overloaded: {exc}", "RateLimitError")
                return error_response(503, f"server overloaded: {exc}", "ServiceUnavailableError")
            except Overloaded:
                return _overloaded(cfg.flavor)
            if not finished:
                return Response(status_code=499)  # the client is gone; nobody reads this
            return json_response(_openai_body(kind, cfg, body, prompt, gen, reason))

        return handle

    async def models(request: Request) -> Response:
        card = {
            "id": cfg.model,
            "object": "model",
            "created": sim.created,
            "owned_by": "vllm",
            "root": cfg.model,
            "parent": None,
            "max_model_len": cfg.max_model_len,
            "permission": [],
        }
        return json_response({"object": "list", "data": [card]})

    extra: list[Route] = []
    if isinstance(sim.metrics, TrtllmExposition):  # trtllm-serve's /metrics is JSON

        async def iteration_stats(request: Request) -> Response:
            assert isinstance(sim.metrics, TrtllmExposition)
            body = sim.metrics.iteration_stats(sim.limiter)
            return Response(body, media_type="application/json")

        extra.append(Route("/metrics", iteration_stats, methods=["GET"]))

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", endpoint("chat"), methods=["POST"]),
            Route("/v1/completions", endpoint("completion"), methods=["POST"]),
            Route("/v1/embeddings", endpoint("embedding"), methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            *extra,
            *common_routes(
                sim.limiter,
                sim.stats,
                lambda: sim.metrics.render(sim.limiter),
                metrics_path=cfg.metrics_path,
                metrics_type=sim.metrics.content_type,
            ),
        ]
    )
    app.state.sim = sim
    app.state.config = cfg
    return app


def _openai_body(
    kind: str, cfg: VllmSimConfig, body: dict[str, Any], prompt: int, gen: int, reason: str
) -> dict[str, Any]:
    created, seed = int(time.time()), msgspec.json.encode(body).decode()
    if kind == "chat":
        message = {"role": "assistant", "content": _words(seed, gen)}
        choices: list[dict[str, Any]] = [
            {"index": 0, "message": message, "logprobs": None, "finish_reason": reason}
        ]
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": created,
            "model": cfg.model,
            "choices": choices,
            "usage": _usage(prompt, gen),
        }
    if kind == "completion":
        prompts = body["prompt"]
        many = isinstance(prompts, list) and not all(isinstance(p, int) for p in prompts)
        n = len(prompts) if many else 1
        choices = [
            {
                "index": i,
                "text": _words(f"{seed}:{i}", gen),
                "logprobs": None,
                "finish_reason": reason,
            }
            for i in range(n)
        ]
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": created,
            "model": cfg.model,
            "choices": choices,
            "usage": _usage(prompt, gen * n),
        }
    inputs = body["input"]
    many = isinstance(inputs, list) and not all(isinstance(p, int) for p in inputs)
    items: list[Any] = inputs if many else [inputs]
    data = [
        {
            "index": i,
            "object": "embedding",
            "embedding": _embedding(f"{cfg.model}:{item}", cfg.embedding_dim),
        }
        for i, item in enumerate(items)
    ]
    return {
        "id": f"embd-{uuid.uuid4().hex}",
        "object": "list",
        "created": created,
        "model": cfg.model,
        "data": data,
        "usage": _usage(prompt, 0),
    }


def build_parser() -> argparse.ArgumentParser:
    """The ``fleetgate sim vllm`` argument parser."""
    p = argparse.ArgumentParser(
        prog="fleetgate sim vllm",
        description="Simulated vLLM server: OpenAI-compatible endpoints that take time, a hard "
        "max_num_seqs capacity (excess requests wait in FIFO), vLLM's /metrics exposition and "
        "/admin endpoints to change capacity at run time and read counters and peaks.",
    )
    add_server_args(p, default_port=8000)
    p.add_argument(
        "--model",
        default="sim-model",
        help="served model name: the model_name label and the accepted 'model' field "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--capacity",
        "--max-num-seqs",
        type=int,
        default=8,
        help="max_num_seqs: requests running at once; the rest wait in FIFO (default: %(default)s)",
    )
    p.add_argument(
        "--engines",
        type=int,
        default=1,
        help="engines (data-parallel ranks) to spread running/waiting over in "
        "/metrics, engine label '0'..'K-1' (default: %(default)s)",
    )
    p.add_argument(
        "--service-ms",
        type=float,
        default=50.0,
        help="mean service time of one request in ms (default: %(default)s)",
    )
    p.add_argument(
        "--service-dist",
        choices=["fixed", "exp", "lognormal"],
        default="fixed",
        help="service time distribution around the mean; lognormal uses sigma "
        f"{_LOGNORMAL_SIGMA} (default: %(default)s)",
    )
    p.add_argument(
        "--occupancy-slowdown",
        type=float,
        default=0.0,
        metavar="F",
        help="service time x (1 + F * running/capacity) at admission, as a fuller "
        "batch runs slower (default: %(default)s)",
    )
    p.add_argument(
        "--max-waiting",
        type=int,
        default=None,
        metavar="W",
        help="answer 503 (or --overload-status) when W requests already wait (default: "
        "unbounded)",
    )
    p.add_argument(
        "--overload-status",
        type=int,
        choices=[429, 503],
        default=503,
        help="the status past --max-waiting: 503, or 429 as a hosted API answers "
        "(default: %(default)s). With --no-metrics: the client-observed case, latency grows "
        "with the queue beyond --capacity and calls are refused past the queue bound",
    )
    p.add_argument(
        "--legacy-metrics",
        action="store_true",
        help="emit the pre-2026 set: no vllm:num_requests_waiting_by_reason and "
        "vllm:gpu_cache_usage_perc instead of vllm:kv_cache_usage_perc",
    )
    p.add_argument(
        "--flavor",
        choices=list(FLAVORS),
        default="vllm",
        help="whose /metrics to expose, at that server's path: vllm (/metrics), sglang, tgi, tei, "
        "llamacpp (/metrics), trtllm (/prometheus/metrics; /metrics is JSON), nim (/v1/metrics) "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--no-metrics",
        dest="metrics",
        action="store_false",
        help="serve no Prometheus metrics (as a server started without them: 404)",
    )
    p.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=None,
        metavar="N",
        help="tgi/tei only: answer 429 once N requests are in flight, running or queued "
        "(default: the server's, 128 for tgi, 512 for tei)",
    )
    p.add_argument(
        "--seed", type=int, default=None, help="seed of the service time sampler (default: random)"
    )
    p.add_argument(
        "--embedding-dim",
        type=int,
        default=16,
        help="length of the vectors /v1/embeddings returns (default: %(default)s)",
    )
    return p


def config_from_args(ns: argparse.Namespace) -> VllmSimConfig:
    """Turn parsed arguments into a :class:`VllmSimConfig`."""
    names = {f.name for f in fields(VllmSimConfig)}
    return VllmSimConfig(**{k: v for k, v in vars(ns).items() if k in names})


def main(argv: list[str] | None = None) -> int:
    """Run the simulator until interrupted; returns the process exit code."""
    return run_cli(build_parser(), lambda ns: build_app(config_from_args(ns)), argv)


if __name__ == "__main__":
    raise SystemExit(main())
