"""Token budgets through the client, on a real redis-server: both caps held across OS
processes under grants, hand-offs and resizes; the lease's tokens and resize; token reports
learnt per tenant; the token ceiling's refusals; the blocking twin."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from collections.abc import AsyncIterator
from concurrent.futures import ProcessPoolExecutor

import pytest
from prometheus_client import CollectorRegistry

from fleetgate.client import ConfigError, Fleet, LeaseLost, Overloaded, SyncFleet
from fleetgate.keys import GateKeys
from fleetgate.status import format_status, gather_status
from fleetgate.tools.redisproc import RedisProcess

from .. import _workers
from ..conftest import RedisUnderTest
from . import _token_workers
from ._token_workers import FLOOR, TOKEN_LIMIT

ctx = mp.get_context("spawn")


@pytest.fixture
async def fleet(rut: RedisUnderTest) -> AsyncIterator[Fleet]:
    async with Fleet(rut.url, prefix=rut.prefix, registry=CollectorRegistry()) as f:
        yield f


def test_both_caps_hold_across_processes_through_grants_hand_offs_and_resizes(
    rut: RedisUnderTest,
) -> None:
    probe = f"{rut.prefix}:probe"
    args = [(rut.url, rut.prefix, "kv", 60, seed, probe) for seed in range(4)]
    with ctx.Pool(4) as pool:
        peaks = pool.starmap(_token_workers.token_hammer, args)
    assert max(p["tokens"] for p in peaks) <= TOKEN_LIMIT, peaks
    assert max(p["units"] for p in peaks) <= FLOOR, peaks
    # the budget was the binding constraint for some of the time, not a cap never approached
    assert max(p["tokens"] for p in peaks) >= TOKEN_LIMIT // 2, peaks
    import redis

    r = redis.Redis.from_url(rut.url, decode_responses=True)
    keys = GateKeys.of(rut.prefix, "kv")
    assert r.zcard(keys.holders) == 0 and r.zcard(keys.waiters) == 0
    assert not r.hexists(keys.adm, "tok")  # every token given back, none counted for nobody
    assert int(r.hget(keys.stats, "granted") or 0) == 240
    assert int(r.hget(keys.stats, "resized") or 0) > 0
    r.close()


async def test_a_lease_holds_its_tokens_and_resizes_them(fleet: Fleet) -> None:
    gate = fleet.gate("kv", floor=4, token_limit=100, token_ceiling=200)
    async with gate.permit(tokens=70) as lease:
        assert lease.tokens == 70 and lease.id.endswith("t70")
        snap = await gate.snapshot()
        assert (snap.token_limit, snap.token_ceiling, snap.tokens) == (100, 200, 70)
        assert await lease.resize(40) == 40 and lease.tokens == 40
        assert lease.id.endswith("t40")
        assert (await gate.snapshot()).tokens == 40
        assert await lease.resize(120) == 40  # 120 does not fit 100: nothing changes
        with pytest.raises(ConfigError, match="token_ceiling"):
            await lease.resize(201)
    assert (await gate.snapshot()).tokens == 0  # released under its new id
    with pytest.raises(LeaseLost):
        await lease.resize(10)


async def test_a_call_that_cannot_fit_waits_and_then_starts_when_tokens_free(
    fleet: Fleet,
) -> None:
    gate = fleet.gate("kv", floor=4, token_limit=100)
    first = await gate.acquire(tokens=80)
    waiting = asyncio.create_task(gate.acquire(tokens=50, deadline=10))
    await asyncio.sleep(0.2)
    assert not waiting.done() and (await gate.snapshot()).queued == 1
    await first.resize(50)  # the freed 30 tokens let the waiter in
    second = await asyncio.wait_for(waiting, 5)
    assert second.tokens == 50 and (await gate.snapshot()).tokens == 100
    await first.release()
    await second.release()


async def test_more_tokens_than_the_token_ceiling_fail_at_once(fleet: Fleet) -> None:
    gate = fleet.gate("kv", floor=4, token_limit=100)
    with pytest.raises(ConfigError, match="token_ceiling"):
        await gate.acquire(tokens=101, deadline=30)
    with pytest.raises(ConfigError, match="tokens: expected int"):
        await gate.acquire(tokens=-1)


async def test_token_reports_are_learnt_per_tenant_without_changing_what_is_held(
    fleet: Fleet,
) -> None:
    gate = fleet.gate("kv", floor=8, token_limit=10_000)
    for _ in range(20):
        async with gate.permit(tokens=400, tenant="chat") as lease:
            lease.report("ok", tokens=100)
            assert lease.tokens == 400
    async with gate.permit(tokens=300) as lease:
        lease.report("ok", tokens=300)
    await gate.flush()
    usage = (await gate.snapshot()).token_usage
    assert (usage["chat"].reports, usage["chat"].asked, usage["chat"].used) == (20, 8000, 2000)
    assert usage["chat"].estimate(1000) == 100  # what the tenant's calls use, per call
    assert usage["chat"].ratio == 0.25  # of what they asked
    assert usage[""].reports == 1 and usage[""].estimate(1000) == 1000  # too few reports yet


async def test_settled_tokens_move_a_tenants_turn_in_the_fair_order(fleet: Fleet) -> None:
    """Two tenants of one band ask 100 tokens a call under a budget of 100 (one call at a
    time); a's calls use 10, b's all 100. Charged what they asked, they would alternate; settled
    by what they used (the report rides with the release), a gets about 10 turns to b's 1."""
    gate = fleet.gate("vtc", floor=4, token_limit=100, max_queued=100)
    blocker = await gate.acquire(tokens=100)
    order: list[str] = []

    async def call(tenant: str, used: int) -> None:
        async with gate.permit(tokens=100, tenant=tenant, deadline=60) as lease:
            order.append(tenant)
            lease.report("ok", tokens=used)

    tasks = []
    for _ in range(20):
        tasks += [asyncio.create_task(call("a", 10)), asyncio.create_task(call("b", 100))]
    while (await gate.snapshot()).queued < 40:
        await asyncio.sleep(0.02)
    await blocker.release()
    await asyncio.wait_for(asyncio.gather(*tasks), 60)
    print(f"[tokens] settled fair order, first 22 grants: {''.join(order[:22])}")
    assert order[:22].count("a") >= 17, order
    snap = await gate.snapshot()
    assert (snap.holders, snap.queued, snap.tokens) == (0, 0, 0)


def test_the_blocking_twin_asks_and_resizes_tokens(rut: RedisUnderTest) -> None:
    with SyncFleet(rut.url, prefix=rut.prefix, registry=CollectorRegistry()) as fleet:
        gate = fleet.gate("kv", floor=2, token_limit=50)
        with gate.permit(tokens=30) as lease:
            assert gate.resize(lease, 10) == 10
            assert lease.tokens == 10
        with gate.permit(tokens=50) as lease:
            assert lease.tokens == 50


async def test_status_shows_the_tokens_held_of_a_gate_with_a_budget(
    rut: RedisUnderTest, fleet: Fleet
) -> None:
    gate = fleet.gate("kv", floor=4, token_limit=100)
    plain = fleet.gate("plain", floor=4)
    await fleet.redis.sadd(f"{rut.prefix}:gates", "kv", "plain")
    async with gate.permit(tokens=30), plain.permit():
        status = await gather_status(fleet.redis, rut.prefix)
    rows = {g.name: g for g in status.gates}
    assert (rows["kv"].tokens, rows["kv"].token_limit) == (30, 100)
    assert rows["plain"].token_limit is None
    text = format_status(status, 0.0)
    assert "  tokens held: 30/100" in text and text.count("tokens held") == 1


async def test_tokens_of_work_resized_during_an_outage_are_counted_when_redis_returns(
    own_redis: RedisProcess,
) -> None:
    """A fleet lease grown before Redis restarts empty, and a local permit shrunk while it was
    down, are adopted with the tokens they hold now (their ids say them), so a newcomer that
    would overrun the budget parks."""
    async with Fleet(
        own_redis.url, prefix="fg", registry=CollectorRegistry(), heartbeat_interval=0.2
    ) as fleet:
        gate = fleet.gate("kv", floor=4, token_limit=100)
        grown = await gate.acquire(tokens=30)
        assert await grown.resize(60) == 60
        for _ in range(100):  # a trusted heartbeat counts this pod: the local share is known
            if gate.last_live_pods == 1:
                break
            await asyncio.sleep(0.05)
        own_redis.kill()
        local = await gate.acquire(deadline=5, tokens=40)
        assert local.local and await local.resize(30) == 30 and local.id.endswith("t30")
        own_redis.start()  # empty: the grown lease is gone from Redis
        for _ in range(100):
            if not fleet.fallback_active:
                break
            await asyncio.sleep(0.05)
        assert not fleet.fallback_active
        assert (await gate.snapshot()).tokens == 90
        newcomer = asyncio.create_task(gate.acquire(deadline=5, tokens=20))
        await asyncio.sleep(0.3)
        assert not newcomer.done()  # 90 + 20 > 100
        await local.release()
        lease = await asyncio.wait_for(newcomer, 2)
        for held in (lease, grown):
            await held.release()


@pytest.mark.long
def test_the_fallback_bounds_tokens_across_processes(
    own_redis: RedisProcess, rut: RedisUnderTest
) -> None:
    """Redis dies under 2 pods of a gate of 8 units and 1,000 tokens: each pod serves under
    ceil(1,000 / 2) tokens as it does under ceil(8 / 2) units, so calls of 300 tokens run one
    per pod (600 in all), not four per pod (2,400: the units' share alone)."""
    probe, ready, go = (f"{rut.prefix}:{k}" for k in ("probe", "ready", "go"))
    kwargs = dict(
        url=own_redis.url, prefix="fg", gate="kvout", probe_url=rut.url, probe=probe,
        tasks=4, loops=3, hold_s=0.1, floor=8, heartbeat_interval=0.2, tokens=300,
        token_limit=1000, live_pods=2, barrier=(ready, 2), go=go,
    )  # fmt: skip
    import redis

    r = redis.Redis.from_url(rut.url)
    with ProcessPoolExecutor(2, mp_context=ctx) as ex:
        futs = [ex.submit(_workers.hammer_with, **kwargs) for _ in range(2)]
        for _ in range(600):
            if int(r.get(ready) or 0) == 2 or any(f.done() for f in futs):
                break
            time.sleep(0.05)
        own_redis.kill()
        r.set(go, 1)
        peaks = [f.result(timeout=120) for f in futs]
    r.close()
    print(f"[fault] outage under a token budget: peak tokens {max(peaks)} (pods' {peaks})")
    assert 300 <= max(peaks) <= 1000, peaks


async def test_the_local_share_of_tokens_refuses_and_limits_growth(
    own_redis: RedisProcess,
) -> None:
    """While Redis is unreachable a pod holds at most its share of the token budget: a call
    asking more is Overloaded at once, a local lease grows only into the share's free tokens,
    and a fleet lease still running counts against it."""
    async with Fleet(
        own_redis.url, prefix="fg", registry=CollectorRegistry(), heartbeat_interval=0.2
    ) as fleet:
        gate = fleet.gate("kv", floor=4, token_limit=100)
        running = await gate.acquire(tokens=30)
        for _ in range(100):
            if gate.last_live_pods == 1:
                break
            await asyncio.sleep(0.05)
        own_redis.kill()
        with pytest.raises(Overloaded, match="tokens"):
            await gate.acquire(deadline=5, tokens=101)
        local = await gate.acquire(deadline=5, tokens=50)
        assert local.local
        assert await local.resize(80) == 50  # 30 + 80 > 100: nothing changes
        assert await local.resize(70) == 70  # 30 + 70 fits
        waiting = asyncio.create_task(gate.acquire(deadline=5, tokens=10))
        await asyncio.sleep(0.2)
        assert not waiting.done()  # 30 + 70 + 10 > 100
        await running.release()
        second = await asyncio.wait_for(waiting, 2)
        assert second.local
        assert await local.resize(95) == 70  # free, but only 20 of the share
        for held in (second, local):
            await held.release()
