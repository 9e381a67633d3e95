"""A vLLM /metrics stub whose values the test sets (the simulator: fleetgate.tools.sim)."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route


@dataclass
class StubValues:
    running: float = 0.0
    waiting_capacity: float = 0.0
    model: str = "stub-model"
    #: the KV cache the engine states (cache_config_info), in blocks of ``block_size`` tokens
    #: (None: not stated), and its preemptions counter (None: not exported)
    kv_blocks: int | None = None
    block_size: int = 16
    preemptions: float | None = None


def exposition(v: StubValues) -> str:
    labels = f'engine="0",model_name="{v.model}"'
    return (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        f"vllm:num_requests_running{{{labels}}} {v.running}\n"
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        f"vllm:num_requests_waiting{{{labels}}} {v.waiting_capacity}\n"
        "# HELP vllm:num_requests_waiting_by_reason Number of requests waiting, by reason.\n"
        "# TYPE vllm:num_requests_waiting_by_reason gauge\n"
        f'vllm:num_requests_waiting_by_reason{{{labels},reason="capacity"}} {v.waiting_capacity}\n'
        f'vllm:num_requests_waiting_by_reason{{{labels},reason="deferred"}} 0.0\n'
        + _kv_lines(v, labels)
    )


def _kv_lines(v: StubValues, labels: str) -> str:
    text = ""
    if v.kv_blocks is not None:
        text += (
            "# TYPE vllm:cache_config_info gauge\n"
            f'vllm:cache_config_info{{block_size="{v.block_size}",engine="0",'
            f'num_gpu_blocks="{v.kv_blocks}"}} 1.0\n'
        )
    if v.preemptions is not None:
        text += (
            "# TYPE vllm:num_preemptions_total counter\n"
            f"vllm:num_preemptions_total{{{labels}}} {v.preemptions}\n"
        )
    return text


def metrics_stub(values: StubValues) -> Starlette:
    async def metrics(_: Request) -> PlainTextResponse:
        return PlainTextResponse(exposition(values))

    async def health(_: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    return Starlette(routes=[Route("/metrics", metrics), Route("/health", health)])
