"""The vLLM simulator's KV cache (``--kv-tokens``): admission while the prompt's blocks fit,
a block per ``block_size`` output tokens, recompute preemption of the newest sequence when
none is free, and the cache stated as vLLM states it -- through the real served app."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetgate.coordinator.scrape.adapters import get_adapter
from fleetgate.tools.sim import serve_in_thread
from fleetgate.tools.sim._vllm_kv import KvScheduler
from fleetgate.tools.sim.vllm import VllmSimConfig, build_app


def completion(prompt: int, out: int) -> dict[str, object]:
    """A completion of exactly ``prompt`` tokens (token ids) asking ``out`` output tokens."""
    return {"model": "sim-model", "prompt": [1] * prompt, "max_tokens": out}


async def test_a_sequence_waits_while_its_prompt_does_not_fit_and_runs_when_blocks_free() -> None:
    kv = KvScheduler(capacity=8, kv_tokens=160, block_size=16, max_waiting=None)  # 10 blocks
    first = asyncio.create_task(kv.run(prompt=120, gen=8, service_s=0.3))  # 8 blocks
    await asyncio.sleep(0.05)
    second = asyncio.create_task(kv.run(prompt=60, gen=8, service_s=0.05))  # needs 4 blocks
    await asyncio.sleep(0.1)
    assert (kv.running, kv.waiting, kv.used_blocks) == (1, 1, 8)  # a slot is free, blocks not
    await first
    await asyncio.wait_for(second, 2)
    assert (kv.running, kv.used_blocks, kv.preemptions) == (0, 0, 0)
    assert kv.peak_running == 1


async def test_decoding_past_the_cache_preempts_the_newest_sequence_which_runs_again() -> None:
    kv = KvScheduler(capacity=8, kv_tokens=64, block_size=16, max_waiting=None)  # 4 blocks
    # each starts with 1 block (16 prompt tokens + 1) and grows to 3 blocks (16 + 32)
    t0 = time.monotonic()
    runs = [asyncio.create_task(kv.run(prompt=15, gen=33, service_s=0.2)) for _ in range(2)]
    await asyncio.wait_for(asyncio.gather(*runs), 5)
    assert kv.preemptions >= 1  # 2 x 3 blocks > 4: the newer one was recomputed
    assert time.monotonic() - t0 >= 0.35  # its progress was lost: it ran twice
    assert (kv.running, kv.waiting, kv.used_blocks) == (0, 0, 0)
    assert kv.peak_blocks <= 4


async def test_a_cancelled_sequence_gives_its_blocks_back() -> None:
    kv = KvScheduler(capacity=4, kv_tokens=64, block_size=16, max_waiting=None)
    task = asyncio.create_task(kv.run(prompt=40, gen=4, service_s=5.0))
    await asyncio.sleep(0.05)
    assert kv.used_blocks == 3
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (kv.running, kv.used_blocks) == (0, 0)


def test_the_served_cache_is_stated_used_and_preempting_as_vllm_reports_it() -> None:
    cfg = VllmSimConfig(capacity=8, kv_tokens=256, block_size=16, ms_per_token=4.0)
    with serve_in_thread(build_app(cfg)) as served:

        async def main() -> tuple[str, list[httpx.Response]]:
            async with httpx.AsyncClient(base_url=served.url, timeout=30) as http:
                # four calls of 64 + 64 tokens: 5 blocks each at the start, 8 at the end, 16
                # blocks in all: they cannot all finish without a preemption
                calls = [http.post("/v1/completions", json=completion(64, 64)) for _ in range(4)]
                answers = await asyncio.gather(*calls)
                too_big = await http.post("/v1/completions", json=completion(200, 100))
                text = (await http.get("/metrics")).text
                return text, [*answers, too_big]

        text, answers = asyncio.run(main())
    assert [a.status_code for a in answers] == [200] * 4 + [400]
    assert answers[0].json()["usage"] == {
        "prompt_tokens": 64,
        "completion_tokens": 64,
        "total_tokens": 128,
    }
    assert "more than the KV cache holds" in answers[4].json()["error"]["message"]
    families = {f.name: f for f in text_string_to_metric_families(text)}
    preempted = sum(s.value for s in families["vllm:num_preemptions"].samples)
    assert preempted >= 1
    generated = sum(
        s.value for s in families["vllm:generation_tokens"].samples if s.name.endswith("_total")
    )
    assert generated == 4 * 64
    # the coordinator reads the cache's size from it, as from a real vLLM
    assert get_adapter("vllm").parse(text, "sim-model").kv_tokens == 256


def test_admin_capacity_resizes_the_kv_schedulers_slots() -> None:
    """``/admin/capacity`` acts on the scheduler that admits (with a KV cache, not the unused
    FIFO limiter): fewer slots admit fewer sequences, and the stats and metrics say so."""
    cfg = VllmSimConfig(capacity=4, kv_tokens=1024, block_size=16, service_ms=300.0)
    with serve_in_thread(build_app(cfg)) as served:

        async def main() -> tuple[dict[str, int], dict[str, int], str]:
            async with httpx.AsyncClient(base_url=served.url, timeout=30) as http:
                shrunk = (await http.post("/admin/capacity", json={"capacity": 2})).json()
                calls = [
                    asyncio.ensure_future(http.post("/v1/completions", json=completion(16, 4)))
                    for _ in range(4)
                ]
                await asyncio.sleep(0.15)
                during = (await http.get("/admin/stats")).json()
                text = (await http.get("/metrics")).text
                await asyncio.gather(*calls)
                return shrunk, during, text

        shrunk, during, text = asyncio.run(main())
    assert shrunk["capacity"] == 2
    assert (during["running"], during["waiting"]) == (2, 2)
    assert 'vllm:num_requests_running{engine="0",model_name="sim-model"} 2.0' in text


def test_without_kv_tokens_the_engine_is_slots_alone() -> None:
    cfg = VllmSimConfig(capacity=2)
    with serve_in_thread(build_app(cfg)) as served:
        text = httpx.get(f"{served.url}/metrics").text
        stats = httpx.get(f"{served.url}/admin/stats").json()
    assert "vllm:cache_config_info" not in text and "kv_blocks" not in stats
    with pytest.raises(ValueError, match="kv_tokens"):
        VllmSimConfig(kv_tokens=8, block_size=16)
    with pytest.raises(ValueError, match="kv_tokens"):
        VllmSimConfig(kv_tokens=1024, flavor="tgi")


async def test_a_preempted_sequence_is_recomputed_from_what_it_had_made() -> None:
    """vLLM's recompute: the preempted sequence keeps its generated tokens, pays a prefill of
    its prompt and them when it runs again, and goes on from there."""
    kv = KvScheduler(
        capacity=8, kv_tokens=64, block_size=16, max_waiting=None, prefill_ms_per_token=2.0
    )
    t0 = time.monotonic()
    runs = [asyncio.create_task(kv.run(prompt=15, gen=33, service_s=0.2)) for _ in range(2)]
    await asyncio.wait_for(asyncio.gather(*runs), 5)
    elapsed = time.monotonic() - t0
    assert kv.preemptions >= 1
    # prefill 30 ms + 200 ms of decode for the first; the second waits, then is recomputed
    # (prefill of 15 + the tokens it had) and finishes the rest: well under two full runs
    assert 0.25 <= elapsed < 0.75, elapsed
    assert (kv.running, kv.waiting, kv.used_blocks) == (0, 0, 0)


async def test_a_prefill_stalls_the_whole_batch() -> None:
    """A step that prefills decodes nothing: a sequence admitted while another decodes delays
    the other by its prefill."""
    kv = KvScheduler(
        capacity=8, kv_tokens=4096, block_size=16, max_waiting=None, prefill_ms_per_token=1.0
    )
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    first = asyncio.create_task(kv.run(prompt=10, gen=10, service_s=0.3))  # 10 ms prefill
    await asyncio.sleep(0.1)
    second = asyncio.create_task(kv.run(prompt=200, gen=1, service_s=0.0))  # 200 ms prefill
    await first
    assert loop.time() - t0 >= 0.5  # 0.01 + 0.3 of its own, + 0.2 of the other's prefill
    await second
