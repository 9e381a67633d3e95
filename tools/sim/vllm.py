"""A vLLM stand-in: OpenAI-compatible endpoints with a hard ``max_num_seqs`` and vLLM's /metrics.

``--flavor`` makes the same engine expose another server's metrics instead (SGLang, TGI, TEI,
llama.cpp, TensorRT-LLM, NIM: :mod:`fleetgate.tools.sim.flavors`) at that server's path, with its
overload behaviour (TGI and TEI answer 429 beyond ``--max-concurrent-requests``);
``--no-metrics`` serves none.

Each request waits in FIFO order for one of ``capacity`` slots (vLLM's ``max_num_seqs``), holds it
for ``--prefill-ms`` and a sampled service time, and answers in OpenAI shape; ``"stream": true``
answers chat and completions as server-sent events, the first token after the queue and the
prefill and the rest at an even rate over the service time (``_stream.py``). ``/metrics`` uses
vLLM's exact family names, HELP/TYPE lines and ``model_name``/``engine`` labels, so the
coordinator's scraper can be tested against it. ``/admin/*`` changes capacity at run time and
exposes counters and peaks, so a test can act as an invariant checker (peak running never above
the fleet-wide limit, ...).

This module is the HTTP app and the command line. The engine is ``_vllm_engine.py``, its
settings ``_vllm_config.py``, vLLM's exposition ``_vllm_metrics.py`` and the OpenAI request and
reply shapes ``_openai.py``.

Run it with ``fleetgate sim vllm --capacity 8`` or ``python -m fleetgate.tools.sim.vllm --help``.
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import fields
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from fleetgate.tools.sim._openai import BadRequest, openai_body, parse_request, stream_mode
from fleetgate.tools.sim._server import (
    QueueFull,
    add_server_args,
    common_routes,
    error_response,
    json_response,
    read_json_object,
    run_cli,
    run_unless_disconnected,
)
from fleetgate.tools.sim._stream import EventStream, StreamReply
from fleetgate.tools.sim._vllm_config import LOGNORMAL_SIGMA, ServiceDist, VllmSimConfig
from fleetgate.tools.sim._vllm_engine import Overloaded, VllmSim
from fleetgate.tools.sim.flavors import FLAVORS, TrtllmExposition

__all__ = [
    "Overloaded",
    "ServiceDist",
    "VllmSim",
    "VllmSimConfig",
    "build_app",
    "build_parser",
    "config_from_args",
    "main",
]


def _gone() -> Response:
    """The answer to a client gone before its reply (nobody reads it)."""
    return Response(status_code=499)


def _overloaded(flavor: str) -> Response:
    """The 429 body of TGI (``ErrorResponse``) or TEI's OpenAI route (``OpenAICompatError``)."""
    if flavor == "tei":
        body: dict[str, Any] = {"message": "Model is overloaded", "code": 429, "type": "Overloaded"}
    else:
        body = {"error": "Model is overloaded", "error_type": "overloaded"}
    return json_response(body, 429)


def _parse(
    kind: str, body: dict[str, Any] | None, cfg: VllmSimConfig
) -> tuple[tuple[int, int, str], StreamReply | None] | Response:
    """(prompt tokens, generated tokens, finish reason) of a request and its streamed reply
    (None: not streamed), or the 400 or 404 answer of a request the server refuses."""
    try:
        if body is None:
            raise BadRequest("request body must be a JSON object")
        tokens = parse_request(kind, body, cfg)
        streamed, include_usage = stream_mode(body) if kind != "embedding" else (False, False)
    except BadRequest as exc:
        return error_response(400, str(exc), "BadRequestError")
    except LookupError as exc:
        return error_response(404, str(exc), "NotFoundError")
    return tokens, StreamReply(kind, cfg, body, tokens, include_usage) if streamed else None


async def _events(
    reply: StreamReply, first: int, ticks: AsyncIterator[int]
) -> AsyncIterator[bytes]:
    """The events of ``reply`` as the engine makes its pieces (``first`` is already made)."""
    yield reply.opening() + reply.piece(first)
    async for i in ticks:
        yield reply.piece(i)
    yield reply.closing()


def _endpoint(kind: str, sim: VllmSim) -> Callable[[Request], Awaitable[Response]]:
    """The handler of one OpenAI route: parse, wait for a slot and serve, answer.

    A streamed request answers once its first piece is made (so a refusal is still a status),
    and its events then come as the engine makes them."""
    cfg = sim.config

    async def handle(request: Request) -> Response:
        body = await read_json_object(request)
        parsed = _parse(kind, body, cfg)
        if isinstance(parsed, Response):
            return parsed
        (prompt, gen, reason), reply = parsed
        try:
            if reply is None:
                done, _ = await run_unless_disconnected(request, sim.execute(prompt, gen, reason))
                if not done or body is None:
                    return _gone()
                return json_response(openai_body(kind, cfg, body, prompt, gen, reason))
            ticks = sim.stream(prompt, gen, reason, reply.pieces)
            done, first = await run_unless_disconnected(request, anext(ticks))
            if not done or first is None:
                return _gone()
            return EventStream(_events(reply, first, ticks), ticks.aclose)
        except QueueFull as exc:
            if cfg.overload_status == 429:
                return error_response(429, f"server overloaded: {exc}", "RateLimitError")
            return error_response(503, f"server overloaded: {exc}", "ServiceUnavailableError")
        except Overloaded:
            return _overloaded(cfg.flavor)
        except ValueError as exc:  # larger than the KV cache can ever hold
            return error_response(400, str(exc), "BadRequestError")

    return handle


def _models(sim: VllmSim) -> Callable[[Request], Awaitable[Response]]:
    """``GET /v1/models``: the one served model's card."""
    cfg = sim.config

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

    return models


def _flavor_routes(sim: VllmSim) -> list[Route]:
    """Routes of the flavour's own: trtllm-serve's ``/metrics`` is JSON iteration stats;
    llama-server states its slots in ``/props`` (``total_slots``, here the capacity)."""
    metrics = sim.metrics
    if sim.config.flavor == "llamacpp":

        async def props(request: Request) -> Response:
            body = {"total_slots": sim.limiter.capacity, "model_path": sim.config.model}
            return JSONResponse(body)

        return [Route("/props", props, methods=["GET"])]
    if not isinstance(metrics, TrtllmExposition):
        return []

    async def iteration_stats(request: Request) -> Response:
        body = metrics.iteration_stats(sim.limiter)
        return Response(body, media_type="application/json")

    return [Route("/metrics", iteration_stats, methods=["GET"])]


def build_app(config: VllmSimConfig | None = None) -> Starlette:
    """Build the ASGI app; the engine state is ``app.state.sim`` (a :class:`VllmSim`)."""
    cfg = config or VllmSimConfig()
    sim = VllmSim(cfg)
    app = Starlette(
        routes=[
            Route("/v1/chat/completions", _endpoint("chat", sim), methods=["POST"]),
            Route("/v1/completions", _endpoint("completion", sim), methods=["POST"]),
            Route("/v1/embeddings", _endpoint("embedding", sim), methods=["POST"]),
            Route("/v1/models", _models(sim), methods=["GET"]),
            *_flavor_routes(sim),
            *common_routes(
                sim.kv or sim.limiter,  # with a KV cache, its scheduler holds the slots
                sim.stats,
                sim.render_metrics,
                metrics_path=cfg.metrics_path,
                metrics_type=sim.metrics.content_type,
            ),
        ]
    )
    app.state.sim = sim
    app.state.config = cfg
    return app


def build_parser() -> argparse.ArgumentParser:
    """The ``fleetgate sim vllm`` argument parser."""
    p = argparse.ArgumentParser(
        prog="fleetgate sim vllm",
        description="Simulated vLLM server: OpenAI-compatible endpoints that take time, a hard "
        "max_num_seqs capacity (excess requests wait in FIFO), vLLM's /metrics exposition and "
        "/admin endpoints to change capacity at run time and read counters and peaks.",
    )
    add_server_args(p, default_port=8000)
    _add_engine_args(p)
    _add_kv_args(p)
    _add_server_kind_args(p)
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


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's options: the model, its slots and its service time."""
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
        "--prefill-ms",
        type=float,
        default=0.0,
        help="time from admission to the first token, before the service time: a stream's "
        "time to first token beyond its queueing (default: %(default)s)",
    )
    p.add_argument(
        "--ms-per-token",
        type=float,
        default=None,
        metavar="MS",
        help="decode time per output token: the service time is max_tokens x MS instead of "
        "--service-ms (default: off)",
    )
    p.add_argument(
        "--service-dist",
        choices=["fixed", "exp", "lognormal"],
        default="fixed",
        help="service time distribution around the mean; lognormal uses sigma "
        f"{LOGNORMAL_SIGMA} (default: %(default)s)",
    )
    p.add_argument(
        "--occupancy-slowdown",
        type=float,
        default=0.0,
        metavar="F",
        help="service time x (1 + F * running/capacity) at admission, as a fuller "
        "batch runs slower (default: %(default)s)",
    )


def _add_kv_args(p: argparse.ArgumentParser) -> None:
    """The KV cache (vLLM's GPU blocks): off unless --kv-tokens is given."""
    p.add_argument(
        "--kv-tokens",
        type=int,
        default=None,
        metavar="N",
        help="vLLM's KV cache in tokens (GPU blocks x --block-size): a sequence is admitted "
        "when a slot and its prompt's blocks are free, takes a block each --block-size output "
        "tokens, and when none is free the newest running sequence is preempted (recomputed "
        "from the start later); counted in vllm:num_preemptions_total, stated in "
        "vllm:cache_config_info (default: off, slots alone)",
    )
    p.add_argument(
        "--prefill-ms-per-token",
        type=float,
        default=0.0,
        metavar="MS",
        help="with --kv-tokens: prefill time per token of a sequence when it is admitted, and "
        "when a preempted one is recomputed (its prompt and what it had generated) "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=16,
        help="tokens per KV block with --kv-tokens (default: %(default)s)",
    )


def _add_server_kind_args(p: argparse.ArgumentParser) -> None:
    """How the server answers overload and which server's metrics it exposes."""
    p.add_argument(
        "--max-waiting",
        type=int,
        default=None,
        metavar="W",
        help="answer 503 (or --overload-status) when W requests already wait (default: unbounded)",
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


def config_from_args(ns: argparse.Namespace) -> VllmSimConfig:
    """Turn parsed arguments into a :class:`VllmSimConfig`."""
    names = {f.name for f in fields(VllmSimConfig)}
    return VllmSimConfig(**{k: v for k, v in vars(ns).items() if k in names})


def main(argv: list[str] | None = None) -> int:
    """Run the simulator until interrupted; returns the process exit code."""
    return run_cli(build_parser(), lambda ns: build_app(config_from_args(ns)), argv)


if __name__ == "__main__":
    raise SystemExit(main())
