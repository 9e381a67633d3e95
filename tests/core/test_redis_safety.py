"""fleetgate.safety against real servers: eviction policy, replicas, refused CONFIG/INFO, the
coordinator's start-up check and ``fleetgate check``'s exit code; and the key types it expects of
a gate (``GateKeys``' own), schema 1 and 2 keys included."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import redis
import redis.asyncio as aredis
from prometheus_client import CollectorRegistry

from fleetgate.client import Fleet
from fleetgate.coordinator import daemon
from fleetgate.coordinator.config import Config
from fleetgate.coordinator.daemon import Coordinator
from fleetgate.keys import GateKeys
from fleetgate.safety import EXPECTED_TYPES, check_redis, find_bad_keys, server_findings
from fleetgate.tools.redisproc import RedisProcess

from ..conftest import RedisUnderTest


def _cli_check(url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fleetgate.cli", "check", "--redis", url],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
async def r(own_redis: RedisProcess) -> AsyncIterator[aredis.Redis]:
    client = aredis.Redis.from_url(own_redis.url, decode_responses=True)
    yield client
    await client.aclose()


async def test_healthy_server_has_nothing_to_report(r: aredis.Redis) -> None:
    assert await check_redis(r) == []


async def test_eviction_policy_is_an_error(own_redis: RedisProcess, r: aredis.Redis) -> None:
    await r.config_set("maxmemory-policy", "allkeys-lru")
    [finding] = await server_findings(r)
    assert finding.level == "error" and finding.code == "eviction"
    assert "'allkeys-lru'" in finding.message and "noeviction" in finding.message
    out = await asyncio.to_thread(_cli_check, own_redis.url)
    assert out.returncode == 1 and "maxmemory-policy is 'allkeys-lru'" in out.stderr
    assert "NOT OK" in out.stdout


@pytest.fixture
def no_config_redis() -> Iterator[RedisProcess]:
    """A managed-Redis look-alike: CONFIG renamed away."""
    with RedisProcess(extra_args=["--rename-command", "CONFIG", ""]) as proc:
        yield proc


async def test_config_disabled_falls_back_to_info(no_config_redis: RedisProcess) -> None:
    client = aredis.Redis.from_url(no_config_redis.url, decode_responses=True)
    try:
        with pytest.raises(redis.ResponseError):
            await client.config_get("maxmemory-policy")
        assert await check_redis(client) == []  # INFO memory told us
    finally:
        await client.aclose()
    out = await asyncio.to_thread(_cli_check, no_config_redis.url)
    assert out.returncode == 0, out.stderr


async def test_nothing_readable_is_a_warning_not_a_crash(
    own_redis: RedisProcess, r: aredis.Redis
) -> None:
    await r.execute_command(
        "ACL", "SETUSER", "blind", "on", ">pw", "~fg:*", "-@all", "+ping", "+type", "+smembers",
        "+hgetall",
    )  # fmt: skip
    url = f"redis://blind:pw@127.0.0.1:{own_redis.port}/0"
    blind = aredis.Redis.from_url(url, decode_responses=True)
    try:
        findings = await server_findings(blind)
    finally:
        await blind.aclose()
    assert {f.code for f in findings} == {"unchecked"}
    assert all(f.level == "warning" for f in findings)
    assert any("maxmemory-policy could not be checked" in f.message for f in findings)
    out = await asyncio.to_thread(_cli_check, url)
    assert "could not be checked" in out.stderr
    # unknown is reported, not failed: the one error is that this user cannot load the gate
    # scripts (fleetgate.safety.capabilities)
    errors = [line for line in out.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "FUNCTION LOAD" in errors[0], out.stderr
    assert out.returncode == 1


@pytest.fixture
def replicated() -> Iterator[tuple[RedisProcess, RedisProcess]]:
    with RedisProcess() as primary, RedisProcess() as replica:
        with redis.Redis(port=replica.port) as client:
            client.replicaof("127.0.0.1", primary.port)
        with redis.Redis(port=primary.port, decode_responses=True) as client:
            for _ in range(200):
                if client.info("replication").get("connected_slaves"):
                    break
                time.sleep(0.02)
        yield primary, replica


async def test_replicas_are_reported_and_a_replica_is_refused(
    replicated: tuple[RedisProcess, RedisProcess],
) -> None:
    primary, replica = replicated
    client = aredis.Redis.from_url(primary.url, decode_responses=True)
    try:
        [finding] = await server_findings(client)
    finally:
        await client.aclose()
    assert finding.code == "replicas" and finding.level == "warning"
    assert "1 replica(s)" in finding.message and "WAIT" in finding.message
    ok = await asyncio.to_thread(_cli_check, primary.url)
    assert ok.returncode == 0 and "replica(s) attached" in ok.stderr
    bad = await asyncio.to_thread(_cli_check, replica.url)
    assert bad.returncode == 1 and "connected to a replica" in bad.stderr


def _config(url: str) -> Config:
    return Config.from_toml_text(
        f"""
[redis]
url = "{url}"
[coordinator]
poll_interval = 0.2
leader_ttl = 1.0
metrics_listen = "127.0.0.1:0"
scrape_timeout = 0.1
""",
        env={},
    )


async def test_coordinator_warns_loudly_at_start_up(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Started before its Redis, the coordinator checks once Redis answers, and logs WARNING."""
    monkeypatch.setattr(daemon, "SAFETY_RETRY", 0.1)
    caplog.set_level(logging.WARNING, logger="fleetgate")
    with RedisProcess(extra_args=["--maxmemory-policy", "volatile-lru"]) as proc:
        proc.kill()
        coord = Coordinator(_config(proc.url), registry=CollectorRegistry())
        stop = asyncio.Event()
        task = asyncio.create_task(coord.run(stop))
        try:
            await asyncio.sleep(0.3)
            assert coord.safety_findings is None  # not checked yet, and not crashed
            proc.start()
            for _ in range(100):
                if coord.safety_findings is not None:
                    break
                await asyncio.sleep(0.05)
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)
    assert coord.safety_findings is not None and len(coord.safety_findings) == 1
    assert "'volatile-lru'" in coord.safety_findings[0]
    [record] = [rec for rec in caplog.records if "volatile-lru" in rec.getMessage()]
    assert record.levelno == logging.WARNING and record.name == "fleetgate.coordinator"


def test_expected_types_are_gate_keys_types() -> None:
    keys = GateKeys.of("fg", "g")
    assert {getattr(keys, attr): t for attr, t in EXPECTED_TYPES.items()} == dict(
        keys.expected_types()
    )


async def test_check_knows_the_schema_2_keys(
    rut: RedisUnderTest, async_redis: aredis.Redis
) -> None:
    async with Fleet(rut.url, prefix=rut.prefix, registry=CollectorRegistry()) as fleet:
        gate = fleet.gate("ok", floor=2)
        lease = await gate.acquire(weight=2, priority=3, tenant="t")
        assert await find_bad_keys(async_redis, rut.prefix, ["ok"]) == []
        await lease.release()

    def keys(name: str) -> GateKeys:
        return GateKeys.of(rut.prefix, name)

    # schema 1 (fleetgate 0.1's FIFO, not converted yet): a warning about the upgrade
    await async_redis.hset(keys("old").cfg, "floor", 1)
    await async_redis.zadd(keys("old").queue, {"p:1": 1})
    # schema 2 with a FIFO where the fence belongs: an old client wrote it
    await async_redis.hset(keys("mixed").cfg, mapping={"floor": 1, "schema": 2})
    await async_redis.zadd(keys("mixed").queue, {"p:1": 1})
    # schema 2 without its fence
    await async_redis.hset(keys("open").cfg, mapping={"floor": 1, "schema": 2})
    # garbled tenant weight and per-tenant bound; lanes of the wrong type
    await async_redis.hset(
        keys("bad").cfg,
        mapping={
            "max_queued_per_tenant": "x",
            "schema": 2,
            "token_target": "0",
            "token_target_until": "1e400",
        },
    )
    await async_redis.set(keys("bad").queue, "fence")
    await async_redis.hset(keys("bad").tenant_weights, mapping={"a": "2", "b": "nan", "c": "5000"})
    await async_redis.set(keys("bad").lanes, "x")
    found = {
        name: sorted(
            (f.level, f.code) for f in await find_bad_keys(async_redis, rut.prefix, [name])
        )
        for name in ("old", "mixed", "open", "bad")
    }
    assert found == {
        "old": [("warning", "schema")],
        "mixed": [("error", "wrong_type")],
        "open": [("warning", "schema")],
        "bad": [("error", "bad_value")] * 5 + [("error", "wrong_type")],
    }
    [mixed] = await find_bad_keys(async_redis, rut.prefix, ["mixed"])
    assert "HDEL" in mixed.message and keys("mixed").queue in mixed.message


async def test_a_redis_without_functions_is_too_old(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scripts are a Functions library (FUNCTION LOAD, FCALL): Redis 7.0 at least, so a 6.2
    server is refused by `fleetgate check`, as the README says, not accepted."""
    from fleetgate.safety import server

    async def version(_client: object) -> str:
        return "6.2.14"

    monkeypatch.setattr(server, "redis_version", version)
    [finding] = await server._version_findings(object())
    assert finding.level == "error" and ">= 7.0" in finding.message
    monkeypatch.setattr(server, "redis_version", lambda _c: _seven())
    assert await server._version_findings(object()) == []


async def _seven() -> str:
    return "7.0.15"
