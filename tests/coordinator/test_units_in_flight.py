"""The units in flight the coordinator reads for each gate (weighted leases count their weight;
a counter left without leases counts nothing), as ``fleet.utilization`` shows them."""

from __future__ import annotations

import redis.asyncio as aredis
from prometheus_client import CollectorRegistry

from fleetgate.client import Fleet
from fleetgate.coordinator.config import GateConfig
from fleetgate.coordinator.publisher import Publisher
from fleetgate.keys import GateKeys

from ..conftest import RedisUnderTest


async def units(publisher: Publisher, gates: list[GateConfig]) -> dict[str, int]:
    """The units column of :meth:`Publisher.held`."""
    return {name: u for name, (u, _) in (await publisher.held(gates)).items()}


async def tokens(publisher: Publisher, gates: list[GateConfig]) -> dict[str, int]:
    """The tokens column of :meth:`Publisher.held`."""
    return {name: t for name, (_, t) in (await publisher.held(gates)).items()}


async def test_coordinator_reads_units_in_flight(
    rut: RedisUnderTest, async_redis: aredis.Redis
) -> None:
    publisher = Publisher(async_redis, rut.prefix)
    gates = [GateConfig(name="heavy", floor=16), GateConfig(name="idle", floor=1)]
    async with Fleet(rut.url, prefix=rut.prefix, registry=CollectorRegistry()) as fleet:
        gate = fleet.gate("heavy", floor=16)
        leases = [await gate.acquire(weight=w) for w in (1, 5, 10)]
        assert await units(publisher, gates) == {"heavy": 16, "idle": 0}
        util = await fleet.utilization("heavy")
        assert (util.units, util.in_flight, util.limit, util.schema) == (16, 3, 16, 2)
        assert {"units", "in_flight", "current_target"} <= set(util.to_dict())
        for lease in leases:
            await lease.release()
        await fleet.flush()
        assert await units(publisher, gates) == {"heavy": 0, "idle": 0}
    # a counter left without leases (a script stopped half-way) counts nothing
    await async_redis.hset(GateKeys.of(rut.prefix, "idle").adm, "extra", 7)
    assert (await units(publisher, gates))["idle"] == 0


async def test_coordinator_reads_tokens_held(
    rut: RedisUnderTest, async_redis: aredis.Redis
) -> None:
    """The tokens a tuned gate's leases hold, as the scripts count them: a counter without
    leases, or garbage in it, counts nothing."""
    publisher = Publisher(async_redis, rut.prefix)
    gates = [GateConfig(name="llm", floor=8, token_limit=1000), GateConfig(name="idle", floor=1)]
    async with Fleet(rut.url, prefix=rut.prefix, registry=CollectorRegistry()) as fleet:
        gate = fleet.gate("llm", floor=8, token_limit=1000)
        leases = [await gate.acquire(tokens=t) for t in (100, 250)]
        assert await tokens(publisher, gates) == {"llm": 350, "idle": 0}
        await async_redis.hset(GateKeys.of(rut.prefix, "llm").adm, "tok", "garbage")
        assert (await tokens(publisher, gates))["llm"] == 0
        await async_redis.hset(GateKeys.of(rut.prefix, "llm").adm, "tok", 350)
        for lease in leases:
            await lease.release()
    await async_redis.hset(GateKeys.of(rut.prefix, "idle").adm, "tok", 70)
    assert (await tokens(publisher, gates))["idle"] == 0
