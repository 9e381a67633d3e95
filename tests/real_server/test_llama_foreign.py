"""Foreign load on a real llama-server: callers that bypass the gate saturate the server while
the fleet holds nothing, then leave; the fleet's target must come back to the server's slots.

The rule under test: the saturation the fleet did not cause (it holds nothing) may cut the
target, but must not be stored as the server's capacity; after the foreign callers leave, a
target that had learned "capacity 1" took 13-25 polls to get back to 0.8 N (a cold start takes
3).
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import redis.asyncio as aredis
from prometheus_client import CollectorRegistry

from fleetgate.client import Fleet
from fleetgate.keys import GateKeys

from ..conftest import RedisUnderTest
from ..coordinator._coordinator import running as coordinating
from ._llama import (
    PERMIT_DEADLINE,
    POLL,
    SLOTS,
    Callers,
    LlamaServer,
    PollRecord,
    coordinator_config,
    first_in,
    llama_gate,
    recording,
)

pytestmark = pytest.mark.real_server

GATE = "llama"
#: polls the foreign callers saturate the server for
FOREIGN_POLLS = 8
#: polls after they leave within which the target is back at >= 0.8 N
BOUND = 5


async def test_target_returns_after_foreign_load_leaves(
    rut: RedisUnderTest, async_redis: aredis.Redis, llama: LlamaServer
) -> None:
    keys = GateKeys.of(rut.prefix, GATE)
    cfg = coordinator_config(rut.url, rut.prefix, llama_gate(GATE, llama.url))
    async with (
        Fleet(rut.url, prefix=rut.prefix, registry=CollectorRegistry()) as fleet,
        httpx.AsyncClient(base_url=llama.url, timeout=PERMIT_DEADLINE) as http,
        recording(async_redis, keys) as record,
        coordinating(cfg),
    ):
        gate = fleet.gate(GATE, floor=1, ceiling=32)
        # 1. the fleet alone, until the target is steady in [0.8 N, 1.25 N] (3 polls in a
        # row): the precondition, so that what is measured after is the foreign load's effect
        async with Callers(http, 3 * SLOTS, gate).running():
            await _steady(record, timeout=40 * POLL)
        # 2. the fleet idle, foreign callers saturate the server
        foreign_from = len(record.polls)
        async with Callers(http, 3 * SLOTS, None).running():
            await record.until(foreign_from + FOREIGN_POLLS, timeout=30 * POLL)
        foreign = record.polls[foreign_from:]
        assert any(p.saturated for p in foreign), f"the foreign load never saturated: {record}"
        # 3. they leave; the fleet's callers are back
        back_from = len(record.polls)
        async with Callers(http, 3 * SLOTS, gate).running():
            await record.until(back_from + BOUND + 3, timeout=30 * POLL)
    at = first_in(record.targets(back_from), 0.8 * SLOTS, float("inf"))
    during = record.targets(foreign_from)[:FOREIGN_POLLS]
    print(
        f"real-server: foreign load: targets during it {during}, back at >= 0.8 N at poll "
        f"{at} after it left; polls: {record}"
    )
    assert at is not None and at <= BOUND, (
        f"target not back at >= {0.8 * SLOTS} within {BOUND} polls after the foreign load "
        f"left: {record.targets(back_from)}; polls: {record}"
    )


async def _steady(record: PollRecord, timeout: float) -> None:
    """Until the last 3 polls' targets are all in [0.8 N, 1.25 N]; fails after ``timeout``."""
    end = time.monotonic() + timeout
    while True:
        last = record.targets()[-3:]
        if len(last) == 3 and all(0.8 * SLOTS <= (t or 0) <= 1.25 * SLOTS for t in last):
            return
        assert time.monotonic() < end, f"never steady in [0.8 N, 1.25 N] first: {record}"
        await asyncio.sleep(0.05)
