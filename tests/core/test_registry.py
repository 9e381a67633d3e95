"""The gate registry ``fg:gates``: an invalid name stops nothing, and gates
idle for long are pruned from it, never a gate with holders, waiters or live pods."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import redis.asyncio as aredis
from prometheus_client import CollectorRegistry

from fleetgate._redis import connect
from fleetgate.admission import member_id
from fleetgate.client import Fleet
from fleetgate.coordinator.config import Config
from fleetgate.coordinator.daemon import Coordinator
from fleetgate.coordinator.publisher import Publisher
from fleetgate.keys import GateKeys
from fleetgate.safety import find_bad_keys
from fleetgate.scripts import GRANTED, PARKED, GateScripts
from fleetgate.settings import GateSettings
from fleetgate.status import gather_status

from ..conftest import RedisUnderTest

pytestmark = pytest.mark.usefixtures("no_gc_during_test")

# Registry entries no gate can have: braces break the hash tag, control characters the layout,
# and bytes that are not UTF-8 cannot even be decoded by a client with decode_responses.
INVALID: list[str | bytes] = ["bad{tag}", "ctl\x01char", "x" * 300, b"\xff\xfe-not-utf8"]
LONG = 600_000  # ms: nothing expires by itself during a test
CLI = [sys.executable, "-m", "fleetgate.cli"]


def config(rut: RedisUnderTest, extra: str = "") -> Config:
    return Config.from_toml_text(
        f"""
[redis]
url = "{rut.url}"
prefix = "{rut.prefix}"
[coordinator]
poll_interval = 0.2
poll_jitter = 0.0
leader_ttl = 1.0
metrics_listen = "127.0.0.1:0"
scrape_timeout = 0.1
{extra}
[[gates]]
name = "configured"
floor = 2
""",
        env={},
    )


@asynccontextmanager
async def running(cfg: Config) -> AsyncIterator[Coordinator]:
    coord = Coordinator(cfg, registry=CollectorRegistry(), reap_interval=0.1)
    stop = asyncio.Event()
    task = asyncio.create_task(coord.run(stop))
    try:
        yield coord
        assert not task.done(), "the coordinator stopped by itself"
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def until(check: Callable[[], Awaitable[object]], timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def registry(rut: RedisUnderTest) -> str:
    return f"{rut.prefix}:gates"


# ------------------------------------------------------------------- invalid registry names


async def test_invalid_registry_names_do_not_stop_the_reaper(
    rut: RedisUnderTest, async_redis: aredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """A crashed holder of a valid gate is reclaimed by the reaper although the registry holds
    invalid names; each invalid name is logged once, not once per sweep."""
    caplog.set_level(logging.INFO, logger="fleetgate")
    keys = GateKeys.of(rut.prefix, "client-gate")
    scripts = GateScripts(async_redis)
    d = GateSettings(floor=1, ceiling=1, lease_ms=100, waiter_ms=LONG)
    assert (await scripts.acquire(keys, "crashed:1", LONG, d)).status == GRANTED
    assert (await scripts.acquire(keys, "parked:1", LONG, d)).status == PARKED
    await async_redis.sadd(registry(rut), "client-gate", *INVALID)
    async with running(config(rut)):
        # Nobody calls the gate: only the reaper can reap the lease and hand the slot on.
        await until(lambda: async_redis.zscore(keys.holders, "parked:1"), 5, "the hand-off")
        await asyncio.sleep(1.0)  # ten more sweeps
    assert await async_redis.zscore(keys.holders, "crashed:1") is None
    for bad in INVALID:
        shown = repr(bad)[:60]
        lines = [r for r in caplog.records if shown in r.getMessage()]
        assert len(lines) == 1, (shown, [r.getMessage()[:100] for r in lines])
    raw = aredis.Redis.from_url(rut.url)  # the entries stay: skipped, not deleted
    try:
        members = await raw.smembers(registry(rut))
    finally:
        await raw.aclose()
    assert {b if isinstance(b, bytes) else b.encode() for b in INVALID} <= members


async def test_status_skips_invalid_registry_names(
    rut: RedisUnderTest, async_redis: aredis.Redis
) -> None:
    keys = GateKeys.of(rut.prefix, "good")
    await GateScripts(async_redis).acquire(keys, "p:1", LONG, GateSettings(floor=3))
    await async_redis.sadd(registry(rut), "good", *INVALID)
    status = await gather_status(async_redis, rut.prefix)
    assert [(g.name, g.in_flight, g.limit) for g in status.gates] == [("good", 1, 3)]
    assert len(status.invalid_gates) == len(INVALID)
    out = await asyncio.to_thread(
        subprocess.run,
        [*CLI, "status", "--json", "--redis", rut.url, "--prefix", rut.prefix],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert [g["name"] for g in json.loads(out.stdout)["gates"]] == ["good"]
    assert "invalid" in out.stderr and "bad{tag}" in out.stderr
    # `fleetgate check` names each entry (a warning: nothing breaks on it).
    findings = await find_bad_keys(async_redis, rut.prefix)
    assert [f.level for f in findings] == ["warning"] * len(INVALID)
    assert all("invalid gate name" in f.message for f in findings)


# ------------------------------------------------------------------- pruning idle gates


async def _used_then_idle(scripts: GateScripts, keys: GateKeys) -> None:
    """A gate that was used (cfg, seq, stats exist) and is idle now."""
    assert (await scripts.acquire(keys, "gone:1", LONG, GateSettings())).status == GRANTED
    assert await scripts.release(keys, "gone:1")


async def test_idle_gates_are_pruned_busy_ones_never(
    rut: RedisUnderTest, async_redis: aredis.Redis
) -> None:
    scripts = GateScripts(async_redis)
    k = {n: GateKeys.of(rut.prefix, n) for n in ("idle", "held", "parked", "beating")}
    await _used_then_idle(scripts, k["idle"])
    d = GateSettings(floor=1, ceiling=1, lease_ms=LONG, waiter_ms=LONG)
    assert (await scripts.acquire(k["held"], "h:1", LONG, d)).status == GRANTED
    assert (await scripts.acquire(k["parked"], "h:2", LONG, d)).status == GRANTED
    assert (await scripts.acquire(k["parked"], "w:1", LONG, d)).status == PARKED
    await _used_then_idle(scripts, k["beating"])
    await scripts.heartbeat(k["beating"], "live-pod", LONG, [], [])  # a live pod, nothing held
    names = ["idle", "held", "parked", "beating", "configured"]
    await async_redis.sadd(registry(rut), *names)

    async with running(config(rut, "prune_idle_after = 0.5")):
        await until(
            lambda: _not(async_redis.sismember(registry(rut), "idle")), 10, "the idle gate pruned"
        )
        await asyncio.sleep(1.5)  # three times the idle period more: nothing else goes
    assert sorted(await async_redis.smembers(registry(rut))) == sorted(names[1:])
    idle = k["idle"]
    assert await async_redis.exists(*[k for k in idle.data_keys()]) == 0
    # The others keep every key they had.
    assert await async_redis.zcard(k["held"].holders) == 1
    assert [member_id(m) for m in await async_redis.zrange(k["parked"].lanes, 0, -1)] == ["w:1"]
    assert await async_redis.zcard(k["parked"].waiters) == 1
    assert await async_redis.zcard(k["beating"].pods) == 1
    assert await async_redis.exists(k["beating"].cfg, k["beating"].seq) == 2
    assert await async_redis.hget(GateKeys.of(rut.prefix, "configured").cfg, "floor") == "2"

    # A client using the pruned gate again registers it again and is served.
    async with Fleet(
        rut.url, prefix=rut.prefix, registry=CollectorRegistry(), heartbeat_interval=0.1
    ) as fleet:
        async with fleet.gate("idle", floor=2).permit(deadline=5):
            await until(lambda: async_redis.sismember(registry(rut), "idle"), 5, "re-registered")


async def prune(pub: Publisher, epoch: int, names: list[str], idle_ms: int) -> list[str]:
    pruned, failed = await pub.prune(epoch, names, idle_ms)
    assert failed == []
    return pruned


async def _not(value: Awaitable[Any]) -> bool:
    return not await value


async def test_prune_needs_the_whole_idle_period_and_is_fenced(
    rut: RedisUnderTest, async_redis: aredis.Redis
) -> None:
    pub = Publisher(async_redis, rut.prefix)
    keys = GateKeys.of(rut.prefix, "g")
    await _used_then_idle(pub.scripts, keys)
    await async_redis.sadd(registry(rut), "g")
    idle_ms = 1000
    assert await prune(pub, 1, ["g"], idle_ms) == []  # first seen idle: the clock starts
    await asyncio.sleep(1.1)
    await _used_then_idle(pub.scripts, keys)  # activity between two checks restarts the clock
    assert await prune(pub, 1, ["g"], idle_ms) == []
    assert await prune(pub, 1, ["g"], idle_ms) == []
    await asyncio.sleep(1.1)
    # A newer leader published the gate: a deposed one (lower epoch) must not delete it.
    await async_redis.hset(keys.target, "epoch", 7)
    assert await prune(pub, 6, ["g"], idle_ms) == []
    # A live target means a coordinator leads the gate: not idle.
    sec, _ = await async_redis.time()
    await async_redis.hset(keys.target, mapping={"value": 3, "expires_at": (sec + 60) * 1000})
    assert await prune(pub, 7, ["g"], idle_ms) == []
    await async_redis.hset(keys.target, "expires_at", 1)  # expired: the idle clock restarts
    assert await prune(pub, 7, ["g"], idle_ms) == []
    await asyncio.sleep(1.1)
    assert await prune(pub, 7, ["g"], idle_ms) == ["g"]
    assert await async_redis.sismember(registry(rut), "g") == 0
    assert await async_redis.exists(*keys.data_keys()) == 0


async def test_activity_racing_the_prune_registers_the_gate_again(
    rut: RedisUnderTest, async_redis: aredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The registry lives outside the gate's slot, so the SREM follows the prune script. A client
    that acquires in between (its SADD came before our SREM) must stay registered."""
    pub = Publisher(async_redis, rut.prefix)
    keys = GateKeys.of(rut.prefix, "g")
    await _used_then_idle(pub.scripts, keys)
    await async_redis.sadd(registry(rut), "g")
    assert await prune(pub, 1, ["g"], 1) == []
    await asyncio.sleep(0.05)
    srem = async_redis.srem

    async def acquire_then_srem(*args: Any) -> Any:
        await pub.scripts.acquire(keys, "late:1", LONG, GateSettings())
        return await srem(*args)

    monkeypatch.setattr(async_redis, "srem", acquire_then_srem)
    assert await prune(pub, 1, ["g"], 1) == []
    assert await async_redis.sismember(registry(rut), "g") == 1
    assert await async_redis.zscore(keys.holders, "late:1") is not None


async def test_a_pod_that_outlived_a_prune_registers_again(
    rut: RedisUnderTest, async_redis: aredis.Redis
) -> None:
    """A pod stalled past the idle period (its pod entry lapsed, the gate was pruned) that then
    resumes must register the gate again: it registered once, at its first beat."""
    async with Fleet(
        rut.url, prefix=rut.prefix, registry=CollectorRegistry(), heartbeat_interval=0.1
    ) as fleet:
        gate = fleet.gate("g")
        await until(lambda: async_redis.sismember(registry(rut), "g"), 5, "registered")
        # What a prune leaves behind, as if this pod had been stalled for the idle period.
        # In one transaction: a beat between the two would re-register the gate before the
        # SREM, which would then undo it (a race of the test, not of a prune: prune.lua never
        # prunes a gate with a live pod).
        async with async_redis.pipeline(transaction=True) as pipe:
            pipe.delete(*gate.keys.data_keys())
            pipe.srem(registry(rut), "g")
            await pipe.execute()
        await until(lambda: async_redis.exists(gate.keys.pods), 5, "the next beat")
        # registered again by a later beat (within 0.5 s on a quiet machine; 5 s under load)
        await until(lambda: async_redis.sismember(registry(rut), "g"), 5, "registered again")


async def test_a_prune_just_before_the_first_beat_leaves_the_gate_registered(
    rut: RedisUnderTest, async_redis: aredis.Redis
) -> None:
    """A prune that lands after the pod decided to beat a new gate but before the beat reached
    Redis: the gate must be listed once the pod is live. (The client listed the gate before the
    beat, so that beat's pod_new looked like the first registration and the prune's SREM left
    a gate in use unlisted for good: the flake of the test above, deterministically.)"""
    keys = GateKeys.of(rut.prefix, "g")
    async with Fleet(
        rut.url, prefix=rut.prefix, registry=CollectorRegistry(), heartbeat_interval=0.1
    ) as fleet:
        scripts = fleet.runtime.scripts
        beat = scripts.heartbeats
        pruned = False

        async def prune_then_beat(*args: Any, **kwargs: Any) -> Any:
            nonlocal pruned
            if not pruned:  # the first beat: what a prune leaves behind, just before it
                pruned = True
                async with async_redis.pipeline(transaction=True) as pipe:
                    pipe.delete(*keys.data_keys())
                    pipe.srem(registry(rut), "g")
                    await pipe.execute()
            return await beat(*args, **kwargs)

        scripts.heartbeats = prune_then_beat  # type: ignore[method-assign]
        fleet.gate("g")
        await until(lambda: async_redis.exists(keys.pods), 5, "the first beat")
        await until(lambda: async_redis.sismember(registry(rut), "g"), 5, "registered")
        assert pruned


async def test_registry_and_prune_on_cluster(cluster_rut: RedisUnderTest) -> None:
    """The same on Redis Cluster: the registry read undecoded, one prune script per gate (each
    in its own slot), SREM and the re-check across slots."""
    client = connect(cluster_rut.url)
    try:
        pub = Publisher(client, cluster_rut.prefix)
        names = [f"gate-{i}" for i in range(6)]  # spread over the three masters
        for n in names:
            await _used_then_idle(pub.scripts, pub.keys(n))
        await client.sadd(f"{cluster_rut.prefix}:gates", *names, *INVALID)
        assert await pub.registered_gates() == names
        assert await prune(pub, 1, names, 1) == []
        await asyncio.sleep(0.05)
        await pub.scripts.acquire(pub.keys("gate-0"), "p:1", LONG, GateSettings())  # in use
        assert await prune(pub, 1, names, 1) == names[1:]
        assert await pub.registered_gates() == ["gate-0"]
        status = await gather_status(client, cluster_rut.prefix)
        assert [g.name for g in status.gates] == ["gate-0"]
        assert len(status.invalid_gates) == len(INVALID)
    finally:
        await client.aclose()
