"""Redis Sentinel: the URL form of the README, and Fleet, the CLI and the coordinator through it,
against a real master + replica + three sentinels (``tests/_sentinel.py``). The failover under
load is ``tests/chaos/test_sentinel_failover.py``."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator

import pytest
import redis
from prometheus_client import CollectorRegistry

from fleetgate._redis import connect, redact, sentinel_url, validate_redis_url
from fleetgate.client import Fleet
from fleetgate.coordinator.config import Config
from fleetgate.coordinator.daemon import Coordinator
from fleetgate.errors import ConfigError
from fleetgate.keys import GateKeys

from .._sentinel import SERVICE, SentinelDeployment


@pytest.mark.parametrize(
    ("url", "sentinels", "service", "db", "user", "password", "sentinel_password", "tls"),
    [
        ("redis+sentinel://h1:26380,h2/main", (("h1", 26380), ("h2", 26379)), "main", 0,
         None, None, None, False),
        ("redis+sentinel://u:p%40ss@h1/main/3?sentinel_password=sp", (("h1", 26379),), "main", 3,
         "u", "p@ss", "sp", False),
        ("rediss+sentinel://:pw@[::1]:5000,10.0.0.2:5001/svc", (("::1", 5000), ("10.0.0.2", 5001)),
         "svc", 0, None, "pw", None, True),
    ],
)  # fmt: skip
def test_sentinel_url_is_parsed(
    url: str,
    sentinels: tuple[tuple[str, int], ...],
    service: str,
    db: int,
    user: str | None,
    password: str | None,
    sentinel_password: str | None,
    tls: bool,
) -> None:
    target = sentinel_url.parse(url)
    assert target.sentinels == sentinels
    assert (target.service, target.db, target.tls) == (service, db, tls)
    assert (target.username, target.password) == (user, password)
    assert target.sentinel_password == sentinel_password
    assert validate_redis_url(url) == url


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis+sentinel://h1:26379", "no service name"),
        ("redis+sentinel://h1,,h2/main", "a sentinel host is empty"),
        ("redis+sentinel://h1:99999/main", "port must be 1-65535"),
        ("redis+sentinel://h1/main/x", "db: expected a number"),
        ("redis+sentinel://h1/main?db=2", "db: give it in the path"),
        ("redis+sentinel://h1/main?cluster=1", "cluster= does not apply"),
        ("redis+sentinel://h1/main?socket_timout=1", "did you mean 'socket_timeout'"),
        ("redis+sentinel://h1/main?ssl_ca_certs=/x", "needs a rediss:// (TLS) URL"),
    ],
)
def test_bad_sentinel_urls_are_config_errors_saying_why(url: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_redis_url(url)


def test_sentinel_url_secrets_are_redacted() -> None:
    url = "redis+sentinel://user:s3cret@h1,h2/main/0?sentinel_password=t0psecret"
    shown = redact(url)
    assert "s3cret" not in shown and "t0psecret" not in shown
    assert shown.startswith("redis+sentinel://***@h1,h2/main/0")
    with pytest.raises(ConfigError) as err:
        validate_redis_url("redis+sentinel://user:s3cret@h1/main/x?sentinel_password=t0psecret")
    assert "s3cret" not in str(err.value) and "t0psecret" not in str(err.value)


@pytest.fixture(scope="module")
def sentinel() -> Iterator[SentinelDeployment]:
    with SentinelDeployment() as deployment:
        yield deployment


@pytest.mark.long
async def test_fleet_takes_permits_on_the_master_the_sentinels_name(
    sentinel: SentinelDeployment,
) -> None:
    async with Fleet(sentinel.url, prefix="fgs") as fleet:
        gate = fleet.gate("sent-a", floor=2, ceiling=2)
        async with gate.permit(deadline=5) as first, gate.permit(deadline=5) as second:
            assert not first.local and not second.local
            master = redis.Redis(port=sentinel.master.port, decode_responses=True)
            try:
                holders = master.zrange(GateKeys.of("fgs", "sent-a").holders, 0, -1)
            finally:
                master.close()
            assert sorted(holders) == sorted([first.id, second.id])


async def test_dedicated_connection_and_a_wrong_service_name(sentinel: SentinelDeployment) -> None:
    client = connect(sentinel.url, dedicated=True)
    try:
        assert await client.ping()
    finally:
        await client.aclose()
    wrong = connect(sentinel.url.replace(f"/{SERVICE}/", "/nosuchservice/"))
    try:
        # redis-py's MasterNotFoundError is a ConnectionError: the outage path (fallback).
        with pytest.raises(redis.ConnectionError):
            await wrong.ping()
    finally:
        await wrong.aclose()


def test_cli_inspect_reads_through_sentinel(sentinel: SentinelDeployment) -> None:
    async def seed() -> None:
        async with Fleet(sentinel.url, prefix="fgcli") as fleet:
            async with fleet.gate("sent-cli", floor=3).permit(deadline=5):
                pass

    asyncio.run(seed())
    out = subprocess.run(
        [sys.executable, "-m", "fleetgate.cli", "inspect", "--redis", sentinel.url,
         "--prefix", "fgcli", "--json", "sent-cli"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    snap = json.loads(out.stdout)
    assert snap["floor"] == 3 and snap["stats"]["granted"] in (1, "1")


async def test_coordinator_publishes_through_sentinel(sentinel: SentinelDeployment) -> None:
    cfg = Config.from_toml_text(
        f"""
[redis]
url = "{sentinel.url}"
prefix = "fgcoord"
[coordinator]
poll_interval = 0.3
poll_jitter = 0.0
leader_ttl = 2.0
metrics_listen = "127.0.0.1:0"
[[gates]]
name = "sent-fixed"
floor = 5
""",
        env={},
    )
    stop = asyncio.Event()
    coord = Coordinator(cfg, registry=CollectorRegistry())
    task = asyncio.create_task(coord.run(stop))
    master = redis.Redis(port=sentinel.master.port, decode_responses=True)
    try:
        keys = GateKeys.of("fgcoord", "sent-fixed")
        for _ in range(200):
            if master.hget(keys.cfg, "floor") == "5":
                break
            await asyncio.sleep(0.02)
        assert master.hget(keys.cfg, "floor") == "5"  # the leader wrote the gate's config
    finally:
        stop.set()
        await task
        master.close()
