"""``fleetgate proxy`` in front of the vLLM simulator, read by the ``openai`` SDK with
``stream=True``: the chunks reach the caller as the upstream makes them (not all at once at the
end), the permit is held while the stream runs, and a stream the caller closes early gives its
permit back (and frees the upstream's slot)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import openai
import pytest

from fleetgate.tools.sim import Served, serve_in_thread
from fleetgate.tools.sim.vllm import VllmSimConfig, build_app

from ..conftest import RedisUnderTest
from ._proxy import gate_counts, serve_proxy, wait_idle, wait_until

MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture
def sim() -> Iterator[Served]:
    """The simulator: 200 ms to the first token, then one token every 50 ms."""
    config = VllmSimConfig(capacity=4, prefill_ms=200, service_ms=50 * 9)
    with serve_in_thread(build_app(config)) as served:
        yield served


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="sk-test", timeout=20)


def test_a_stream_arrives_chunk_by_chunk_through_the_proxy(
    rut: RedisUnderTest, sim: Served
) -> None:
    with serve_proxy(rut, sim) as url, _client(url) as client:
        start = time.monotonic()
        stream = client.chat.completions.create(
            model="sim-model", messages=MESSAGES, max_tokens=10, stream=True
        )
        arrivals: list[float] = []
        text = ""
        holders: list[int] = []
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                arrivals.append(time.monotonic() - start)
                text += chunk.choices[0].delta.content
                if len(arrivals) == 5:
                    holders.append(gate_counts(rut.url, rut.prefix, "g")[0])
        assert len(text.split(" ")) == 10 and len(arrivals) == 10
        assert holders == [1], "the permit is held while the stream runs"
        assert arrivals[0] >= 0.15, "the first token after the prefill"
        assert arrivals[-1] - arrivals[0] >= 0.3, f"spread at the decode rate: {arrivals}"
        assert sorted(arrivals) == arrivals
        wait_idle(rut.url, rut.prefix, "g")


def test_a_stream_closed_early_frees_its_permit(rut: RedisUnderTest) -> None:
    config = VllmSimConfig(capacity=4, service_ms=20_000)  # 100 tokens, one every 0.2 s
    with (
        serve_in_thread(build_app(config)) as sim,
        serve_proxy(rut, sim) as url,
        _client(url) as client,
    ):
        stream = client.chat.completions.create(
            model="sim-model", messages=MESSAGES, max_tokens=101, stream=True
        )
        chunks = iter(stream)
        next(chunks)
        next(chunks)
        assert gate_counts(rut.url, rut.prefix, "g") == (1, 0)
        stream.close()  # long before its 20 s of tokens are over
        closed = time.monotonic()
        wait_idle(rut.url, rut.prefix, "g", timeout=5)
        assert time.monotonic() - closed < 5
        engine = sim.state.sim
        wait_until(lambda: engine.limiter.running == 0, 5, "the upstream's slot freed")
        assert engine.aborted == 1 and engine.served == 0
