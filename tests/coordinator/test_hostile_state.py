"""Hostile state planted in Redis, seen from the coordinator: it keeps running, names each bad
key in its log without flooding it, keeps publishing the other gates, and recovers by itself
once the key is deleted; a corrupt stored epoch does not make the leader flap. The client's side
is ``tests/client/test_hostile_state.py``."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
import redis.asyncio as aredis
from prometheus_client import CollectorRegistry

from fleetgate.coordinator.config import Config
from fleetgate.coordinator.daemon import Coordinator
from fleetgate.keys import GateKeys
from fleetgate.tools.redisproc import RedisProcess
from fleetgate.tools.sim import serve_in_thread

from .._stub import StubValues, metrics_stub

pytestmark = pytest.mark.usefixtures("no_gc_during_test")


@pytest.fixture
async def r(own_redis: RedisProcess) -> AsyncIterator[aredis.Redis]:
    client = aredis.Redis.from_url(own_redis.url, decode_responses=True)
    yield client
    await client.aclose()


POLL = 0.2


def _config(url: str) -> Config:
    return Config.from_toml_text(
        f"""
[redis]
url = "{url}"
[coordinator]
poll_interval = {POLL}
poll_jitter = 0.0
leader_ttl = 1.0
metrics_listen = "127.0.0.1:0"
scrape_timeout = 0.1
[[gates]]
name = "good"
floor = 3
[[gates]]
name = "bad"
floor = 5
""",
        env={},
    )


@asynccontextmanager
async def _running(url: str) -> AsyncIterator[Coordinator]:
    coord = Coordinator(_config(url), registry=CollectorRegistry(), reap_interval=0.1)
    stop = asyncio.Event()
    task = asyncio.create_task(coord.run(stop))
    try:
        yield coord
        assert not task.done(), "the coordinator stopped by itself"
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def _until(check: Callable[[], Awaitable[object]], timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def _planted_then_healed(
    url: str, r: aredis.Redis, caplog: pytest.LogCaptureFixture, bad_keys: list[str]
) -> None:
    """Run a coordinator against the planted keys: it keeps running, logs each bad key without
    flooding the log, and heals every gate once the keys are deleted."""
    caplog.set_level(logging.INFO, logger="fleetgate")
    async with _running(url):
        await asyncio.sleep(1.0)  # several polls, sweeps and campaigns against the bad keys
        errors = [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
        assert errors, "the bad keys went unnoticed"
        # Throttled: one line per distinct error, not one per poll (5/s) or sweep (10/s).
        assert len(errors) <= 12, [rec.getMessage()[:120] for rec in errors]
        for key in bad_keys:
            assert key in caplog.text, f"{key} not named in the log"
        await r.delete(*bad_keys)
        await _until(lambda: r.exists("fg:leader"), 5, "a leader")
        for name, floor in (("bad", "5"), ("good", "3")):
            cfg = GateKeys.of("fg", name).cfg
            await _until(lambda c=cfg, f=floor: _eq(r.hget(c, "floor"), f), 5, f"{name} published")
            await _until(lambda n=name: r.sismember("fg:gates", n), 5, f"{name} registered")


async def test_coordinator_survives_bad_fleet_keys(
    own_redis: RedisProcess, r: aredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    await r.hset("fg:epoch", "x", "1")  # INCR fails: no term can be confirmed
    await r.set("fg:gates", "x")  # SADD/SMEMBERS fail: registry and reaper
    await _planted_then_healed(own_redis.url, r, caplog, ["fg:epoch", "fg:gates"])


async def test_one_broken_gate_does_not_stop_the_others(
    own_redis: RedisProcess, r: aredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    bad, good = GateKeys.of("fg", "bad"), GateKeys.of("fg", "good")
    await r.set(bad.holders, "x")  # in-flight count and every script of the gate fail
    await r.rpush(bad.util, "x")  # the warm-failover state cannot be read nor written
    await r.rpush(bad.cfg, "x")  # the gate's configuration cannot be published

    async def good_published() -> bool:
        return await r.hget(good.cfg, "floor") == "3" and await r.exists(good.util) == 1

    async with _running(own_redis.url):
        await _until(good_published, 5, "the good gate published despite the bad one")
    await _planted_then_healed(own_redis.url, r, caplog, [bad.holders, bad.util, bad.cfg])


async def _eq(value: Awaitable[object], expected: object) -> bool:
    return await value == expected


async def test_coordinator_leader_key_of_wrong_type_stands_by_then_leads(
    own_redis: RedisProcess, r: aredis.Redis
) -> None:
    await r.hset("fg:leader", "x", "1")
    async with _running(own_redis.url) as coord:
        await asyncio.sleep(0.8)
        assert not _leads(coord)  # nobody can win while the key is there
        await r.delete("fg:leader")
        await _until(lambda: _true(_leads(coord)), 5, "leadership")


async def _true(value: bool) -> bool:
    return value


def _leads(coord: Coordinator) -> bool:
    return coord._election is not None and coord.election.is_leader


async def test_corrupt_target_epoch_does_not_make_the_leader_flap(
    own_redis: RedisProcess, r: aredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """A stored target epoch above every epoch ever issued (planted, or fg:epoch reset) must
    not depose every leader forever: the leader keeps leading and names the gate."""
    caplog.set_level(logging.INFO, logger="fleetgate")
    bad = GateKeys.of("fg", "llm")
    await r.hset(bad.target, mapping={"value": "7", "epoch": "999999", "expires_at": "0"})
    with serve_in_thread(metrics_stub(StubValues(running=1))) as served:
        cfg = Config.from_toml_text(
            f"""
[redis]
url = "{own_redis.url}"
[coordinator]
poll_interval = {POLL}
poll_jitter = 0.0
leader_ttl = 1.0
metrics_listen = "127.0.0.1:0"
scrape_timeout = 0.1
[[gates]]
name = "llm"
floor = 2
metrics_url = "{served.url}/metrics"
""",
            env={},
        )
        coord = Coordinator(cfg, registry=CollectorRegistry())
        stop = asyncio.Event()
        task = asyncio.create_task(coord.run(stop))
        try:
            await _until(lambda: _true(_leads(coord)), 5, "leadership")
            term = coord.election.term
            await asyncio.sleep(8 * POLL)  # several refused publishes
            assert coord.election.is_leader, "stepped down because of a corrupt stored epoch"
            assert coord.election.term is not None and term is not None
            assert coord.election.term.epoch == term.epoch
            assert "stepping down" not in caplog.text
            assert "target refused although no epoch above" in caplog.text
            # Once the corrupt target is deleted, the leader publishes again.
            await r.delete(bad.target)
            await _until(lambda: r.hexists(bad.target, "value"), 5, "a published target")
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)
