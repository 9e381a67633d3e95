"""The vLLM simulator's streamed replies (``"stream": true``): OpenAI's server-sent events with
a real server's timing (the first token after the queue and the prefill, the rest at a rate), the
slot held until the last token and freed when the caller goes away."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import openai
import pytest

from fleetgate.client import Fleet
from fleetgate.tools._load_run import charge, prompt_of
from fleetgate.tools.load import GateLoad, LoadSpec
from fleetgate.tools.load import run as run_load
from fleetgate.tools.sim import Served, serve_in_thread
from fleetgate.tools.sim.vllm import VllmSimConfig, build_app, build_parser, config_from_args

from ..conftest import RedisUnderTest

CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "hello there"}]}


@pytest.fixture
def sim() -> Iterator[Served]:
    """One slot; 300 ms of prefill, then 9 tokens over 400 ms (one every 50 ms)."""
    config = VllmSimConfig(capacity=1, prefill_ms=300, service_ms=400, max_waiting=0)
    with serve_in_thread(build_app(config)) as served:
        yield served


async def stats(client: httpx.AsyncClient) -> dict[str, Any]:
    body: dict[str, Any] = (await client.get("/admin/stats")).json()
    return body


async def wait_stats(client: httpx.AsyncClient, **want: int) -> dict[str, Any]:
    """Wait until /admin/stats shows every ``want`` value; return that snapshot."""
    deadline = time.monotonic() + 5
    while True:
        seen = await stats(client)
        if all(seen[k] == v for k, v in want.items()):
            return seen
        assert time.monotonic() < deadline, f"stats {seen} never showed {want}"
        await asyncio.sleep(0.01)


async def read_events(
    client: httpx.AsyncClient, path: str, body: dict[str, Any]
) -> list[tuple[float, Any]]:
    """POST ``body`` streamed; every ``data:`` event with its arrival (s after sending), the
    chunk decoded (``[DONE]`` as the string). Also checks the answer's head."""
    events: list[tuple[float, Any]] = []
    start = time.monotonic()
    async with client.stream("POST", path, json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        async for line in resp.aiter_lines():
            if line:
                assert line.startswith("data: ")
                data = line[len("data: ") :]
                events.append(
                    (time.monotonic() - start, data if data == "[DONE]" else json.loads(data))
                )
    return events


async def test_chat_streams_tokens_after_the_prefill_at_the_decode_rate(sim: Served) -> None:
    async with httpx.AsyncClient(base_url=sim.url, timeout=10) as client:
        reading = asyncio.create_task(
            read_events(client, "/v1/chat/completions", {**CHAT, "max_tokens": 9})
        )
        during = await wait_stats(client, running=1)
        events = await reading
        after = await wait_stats(client, running=0)
    assert during["in_flight"] == 1
    assert after["served"] == 1 and after["aborted"] == 0
    assert events[-1][1] == "[DONE]"
    chunks = [chunk for _, chunk in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1 and "usage" not in chunks[0]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    deltas = [(t, c["choices"][0]["delta"].get("content", "")) for t, c in events[1:-2]]
    text = "".join(d for _, d in deltas)
    assert len(deltas) == 9 and len(text.split(" ")) == 9  # one chunk per token
    first, last = deltas[0][0], deltas[-1][0]
    assert 0.27 <= first < 0.6, "time to first token: the prefill"
    assert 0.3 <= last - first < 0.8, "the other 8 tokens over the 400 ms service time"
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(deltas)]
    assert max(gaps) < 0.2, f"tokens at a rate, not in a burst: {gaps}"


async def test_usage_chunk_when_asked(sim: Served) -> None:
    body = {**CHAT, "max_tokens": 3, "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(base_url=sim.url, timeout=10) as client:
        events = await read_events(client, "/v1/chat/completions", body)
    chunks = [chunk for _, chunk in events[:-1]]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == []
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 3
    assert usage["total_tokens"] == usage["prompt_tokens"] + 3


async def test_completions_stream_one_chunk_per_prompt_and_token(sim: Served) -> None:
    body = {"prompt": ["a", "b"], "max_tokens": 2}
    async with httpx.AsyncClient(base_url=sim.url, timeout=10) as client:
        events = await read_events(client, "/v1/completions", body)
    chunks = [chunk for _, chunk in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    by_index = [[c["choices"][0] for c in chunks if c["choices"][0]["index"] == i] for i in (0, 1)]
    for choices in by_index:
        assert len(choices) == 3 and choices[-1]["finish_reason"] == "length"
        assert len("".join(c["text"] for c in choices).split(" ")) == 2


async def test_a_caller_gone_mid_stream_frees_the_slot(sim: Served) -> None:
    async with httpx.AsyncClient(base_url=sim.url, timeout=10) as client:
        body = {**CHAT, "max_tokens": 200, "stream": True}
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            lines = resp.aiter_lines()
            assert (await anext(lines)).startswith("data: ")
            assert (await stats(client))["running"] == 1
        after = await wait_stats(client, running=0, aborted=1)
        assert after["served"] == 0
        again = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1})
        assert again.status_code == 200  # the only slot is free


async def test_a_refused_stream_is_a_status_and_a_queued_one_waits(sim: Served) -> None:
    """Past the wait list a stream is refused with 503 before any event; a stream queued
    behind another starts when the slot frees (its first token after the queue and prefill)."""
    async with httpx.AsyncClient(base_url=sim.url, timeout=10) as client:
        reading = asyncio.create_task(read_events(client, "/v1/chat/completions", CHAT))
        await wait_stats(client, running=1)
        over = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert over.status_code == 503 and over.json()["error"]["code"] == 503
        await reading
    config = VllmSimConfig(capacity=1, prefill_ms=200, service_ms=100)
    with serve_in_thread(build_app(config)) as queued:
        async with httpx.AsyncClient(base_url=queued.url, timeout=10) as client:
            both = await asyncio.gather(
                *(read_events(client, "/v1/completions", {"prompt": "x"}) for _ in range(2))
            )
    firsts = sorted(events[0][0] for events in both)
    assert firsts[0] >= 0.18 and firsts[1] >= 0.45  # the second waited a whole request


async def test_bad_stream_requests_are_refused(sim: Served) -> None:
    async with httpx.AsyncClient(base_url=sim.url, timeout=10) as client:
        for path, body in (
            ("/v1/embeddings", {"input": "x", "stream": True}),
            ("/v1/chat/completions", {**CHAT, "stream": "yes"}),
            ("/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True}}),
            ("/v1/chat/completions", {**CHAT, "stream": True, "stream_options": []}),
        ):
            resp = await client.post(path, json=body)
            assert resp.status_code == 400, (path, body)


def test_the_openai_sdk_reads_the_stream(sim: Served) -> None:
    client = openai.OpenAI(base_url=f"{sim.url}/v1", api_key="sk-test", timeout=10)
    with contextlib.closing(client):
        stream = client.chat.completions.create(
            model="sim-model",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text.split(" ")) == 4
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4


def test_prefill_ms_option() -> None:
    ns = build_parser().parse_args(["--prefill-ms", "120"])
    assert config_from_args(ns) == VllmSimConfig(prefill_ms=120.0)
    with pytest.raises(ValueError):
        VllmSimConfig(prefill_ms=-1)


async def test_the_load_generator_reads_streamed_replies(rut: RedisUnderTest) -> None:
    """``GateLoad(stream=True)`` (the demo's LLM callers): every call a stream read to
    ``[DONE]``, under the gate's permit."""
    config = VllmSimConfig(capacity=4, prefill_ms=20, service_ms=60)
    with serve_in_thread(build_app(config)) as served:
        gate = GateLoad(name="llm", kind="chat", url=served.url, users=2, floor=2, stream=True)
        spec = LoadSpec(redis_url=rut.url, prefix=rut.prefix, gates=[gate], duration=1.5)
        outcomes = await run_load(spec)
        engine = served.state.sim
    assert outcomes["llm"]["ok"] > 3 and set(outcomes["llm"]) == {"ok"}, outcomes
    assert engine.served >= outcomes["llm"]["ok"] and engine.limiter.peak_running <= 2


async def test_the_load_generator_charges_tokens_and_reports_what_usage_says(
    rut: RedisUnderTest,
) -> None:
    """``GateLoad(token_block=16)`` (the demo's chat callers): each call's permit charges its
    prompt at 3 characters a token plus max_tokens, in whole blocks; the streamed reply's usage
    chunk (4 characters a token) is reported with the release."""
    config = VllmSimConfig(capacity=4, kv_tokens=8192, service_ms=60)
    load = GateLoad(
        name="llm", kind="chat", url="", users=2, floor=4, stream=True,
        prompt_tokens=300, max_tokens=100, token_block=16,
    )  # fmt: skip
    text = prompt_of(load, "worker-1 request 1.0")
    assert len(text) == 1200 and charge(load, text) == 512  # 400 + 100 -> 32 blocks
    with serve_in_thread(build_app(config)) as served:
        async with Fleet(rut.url, prefix=rut.prefix) as fleet:
            gate = fleet.gate("llm", floor=4, token_limit=4096)
            async with gate.permit(tokens=1):  # registers the gate's token budget
                pass
            load = msgspec.structs.replace(load, url=served.url)
            spec = LoadSpec(redis_url=rut.url, prefix=rut.prefix, gates=[load], duration=1.5)
            outcomes = await run_load(spec)
            usage = (await gate.snapshot()).token_usage[""]
    assert outcomes["llm"]["ok"] > 3 and set(outcomes["llm"]) == {"ok"}, outcomes
    assert usage.reports == outcomes["llm"]["ok"]
    assert usage.asked == 512 * usage.reports  # what each call was charged ...
    assert usage.used == 400 * usage.reports  # ... and what the server counted: 300 + 100
