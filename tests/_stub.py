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
    )


def metrics_stub(values: StubValues) -> Starlette:
    async def metrics(_: Request) -> PlainTextResponse:
        return PlainTextResponse(exposition(values))

    async def health(_: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    return Starlette(routes=[Route("/metrics", metrics), Route("/health", health)])
