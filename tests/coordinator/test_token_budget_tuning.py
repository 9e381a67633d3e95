"""The coordinator tuning a gate's token budget, in-process against real Redis and a vLLM
metrics stub: to the KV cache the stub states, cut on its preemptions, shown in the snapshot,
the status text and the coordinator's metrics, resumed by a new leader, and lapsing to the
configured ``token_limit`` when no leader renews it."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aredis
from prometheus_client import CollectorRegistry

from fleetgate.client import Fleet
from fleetgate.keys import GateKeys
from fleetgate.scripts import GateScripts
from fleetgate.status import format_status, gather_status
from fleetgate.tools.sim import serve_in_thread
from fleetgate.util_hash import UtilHash

from .._stub import StubValues, metrics_stub
from ..conftest import RedisUnderTest
from ._coordinator import config_with, eventually, running

KV = 4096  # 256 blocks of 16 tokens
CALL = 256  # tokens each call charges


def gates(metrics_url: str, token_limit: int, ceiling: int = 4 * KV) -> str:
    return f"""
[[gates]]
name = "llm"
floor = 64
ceiling = 64
metrics_url = "{metrics_url}"
token_limit = {token_limit}
token_ceiling = {ceiling}
lease_ms = 2000
"""


async def budget(r: aredis.Redis, keys: GateKeys) -> tuple[int | None, bool]:
    snap = await GateScripts(r).snapshot(keys)
    return snap.token_limit, snap.token_tuned


async def test_the_budget_grows_to_the_stated_cache_and_is_cut_by_preemptions(
    rut: RedisUnderTest, async_redis: aredis.Redis
) -> None:
    """From 1/4 of the cache: doubled while the fleet fills it, to the cache; a preemption with
    the fleet within the budget cuts it below what the fleet holds, and it stays there."""
    values = StubValues(running=8, kv_blocks=KV // 16, preemptions=0)
    keys = GateKeys.of(rut.prefix, "llm")
    with serve_in_thread(metrics_stub(values)) as served:
        cfg = config_with(rut, gates(f"{served.url}/metrics", KV // 4))
        async with Fleet(rut.url, prefix=rut.prefix, registry=CollectorRegistry()) as fleet:
            gate = fleet.gate("llm")
            stop = asyncio.Event()

            async def caller() -> None:  # more tokens asked than any budget: near full
                while not stop.is_set():
                    async with gate.permit(deadline=30, tokens=CALL):
                        await asyncio.sleep(0.05)

            callers = [asyncio.create_task(caller()) for _ in range(40)]
            try:
                async with running(cfg) as coord:
                    await eventually(
                        lambda: _eq(budget(async_redis, keys), (KV, True)), 10, "the cache"
                    )
                    util = UtilHash.decode(await async_redis.hgetall(keys.util))
                    assert util.kv_tokens == KV and util.token_target == KV
                    assert util.token_reason in ("grow", "hold_capacity")
                    assert util.tokens_held is not None and util.tokens_held <= KV
                    text = format_status(await gather_status(async_redis, rut.prefix), 0.0)
                    assert "tokens held: " in text and f"/{KV} (tuned: " in text
                    sample = coord.registry.get_sample_value
                    assert sample("fleetgate_coordinator_token_target", {"gate": "llm"}) == KV
                    assert sample("fleetgate_coordinator_kv_tokens", {"gate": "llm"}) == KV
                    values.preemptions = 3.0  # the estimates behind the charges are short
                    await eventually(
                        lambda: _lt(budget(async_redis, keys), KV), 5, "a cut below the cache"
                    )
                    cut = (await budget(async_redis, keys))[0]
                    assert cut is not None and cut <= 0.8 * KV
                    await asyncio.sleep(1.0)  # no more preemptions: it stays at what it learnt
                    assert (await budget(async_redis, keys))[0] == cut
            finally:
                stop.set()
                await asyncio.gather(*callers)


@pytest.mark.long
async def test_a_new_leader_resumes_the_budget_and_without_one_it_lapses(
    rut: RedisUnderTest, async_redis: aredis.Redis
) -> None:
    """The budget is a target: a new leader continues from the stored state (not from the
    configured 4x), and once nobody renews it the configured token_limit is in force again."""
    values = StubValues(running=0, kv_blocks=KV // 16, preemptions=0)
    keys = GateKeys.of(rut.prefix, "llm")
    with serve_in_thread(metrics_stub(values)) as served:
        cfg = config_with(rut, gates(f"{served.url}/metrics", 4 * KV))
        async with running(cfg):
            await eventually(lambda: _eq(budget(async_redis, keys), (KV, True)), 5, "the cache")
        stored = await async_redis.hget(keys.util, "token_state")
        assert stored is not None and f'"budget":{KV}' in stored
        first = int(await async_redis.hget(keys.target, "epoch") or 0)
        # the server no longer states its cache: only the resumed state keeps the budget at it
        # (a cold start would publish the configured 4x, idle)
        values.kv_blocks = None
        async with running(cfg):
            await eventually(
                lambda: _gt(async_redis.hget(keys.target, "epoch"), first), 10, "a new leader"
            )
            await asyncio.sleep(0.5)
            assert await budget(async_redis, keys) == (KV, True)  # never back to 4x
        ttl = cfg.coordinator.target_ttl
        await eventually(
            lambda: _eq(budget(async_redis, keys), (4 * KV, False)), ttl + 5, "the lapse"
        )


async def _eq(value: object, expected: object) -> bool:
    return await value == expected  # type: ignore[misc]


async def _lt(value: object, bound: int) -> bool:
    got = (await value)[0]  # type: ignore[misc]
    return got is not None and got < bound


async def _gt(value: object, bound: int) -> bool:
    got = await value  # type: ignore[misc]
    return got is not None and int(got) > bound
