"""TLS: ``rediss://`` URLs against a real ``redis-server --tls-port``, standalone and Cluster.

Certificates (a CA, a server certificate for 127.0.0.1/localhost, a client certificate) are made
by the ``openssl`` CLI in a temporary directory (the ``cryptography`` package is not a fleetgate
dependency). The URL form, as documented in docs/security.md::

    rediss://[user:password@]host:port/0?ssl_ca_certs=/path/ca.crt
        [&ssl_certfile=/path/client.crt&ssl_keyfile=/path/client.key]   (mutual TLS)
        [&cluster=1]                                                     (Redis Cluster)
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from prometheus_client import CollectorRegistry

from fleetgate._redis import connect, prepare
from fleetgate.client import Fleet, RedisUnavailable
from fleetgate.coordinator.config import Config
from fleetgate.coordinator.daemon import Coordinator
from fleetgate.errors import ConfigError
from fleetgate.keys import GateKeys
from fleetgate.tools.redisproc import RedisProcess

from .._certs import Certs, make_certs


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is needed to make test certificates")
    return make_certs(tmp_path_factory.mktemp("tls"))


class TlsRedis(RedisProcess):
    """A private redis-server listening only on a TLS port."""

    def __init__(self, certs: Certs, *, auth_clients: str, cluster: bool = False) -> None:
        self.certs = certs
        self.cluster = cluster
        extra = [
            "--port", "0",
            "--tls-port", "{port}",
            "--tls-cert-file", str(certs.server_crt),
            "--tls-key-file", str(certs.server_key),
            "--tls-ca-cert-file", str(certs.ca),
            "--tls-auth-clients", auth_clients,
            # 127.0.0.2 too: a name the certificate does not cover, for the host-name check.
            "--bind", "127.0.0.1", "127.0.0.2",
        ]  # fmt: skip
        if cluster:
            extra += [
                "--tls-cluster", "yes",
                "--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf",
                "--cluster-port", "{cluster_port}",
            ]  # fmt: skip
        super().__init__(extra_args=extra)  # {port}, {cluster_port}: filled in at each start

    def tls_url(self, *, client_cert: bool = True, ca: Path | None = None) -> str:
        flag = "&cluster=1" if self.cluster else ""
        query = self.certs.query(client_cert=client_cert, ca=ca)
        return f"rediss://127.0.0.1:{self.port}/0?{query}{flag}"

    def admin(self) -> redis.Redis:
        return redis.Redis(
            port=self.port,
            ssl=True,
            ssl_ca_certs=str(self.certs.ca),
            ssl_certfile=str(self.certs.client_crt),
            ssl_keyfile=str(self.certs.client_key),
            decode_responses=True,
            socket_timeout=2,
        )

    def wait_ready(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                log = (self.dir / "redis.log").read_text(errors="replace")
                if "TLS" in log and ("not supported" in log or "Bad directive" in log):
                    pytest.skip(f"this redis-server was built without TLS: {log[-300:]}")
                raise RuntimeError(f"redis-server exited: {log[-2000:]}")
            try:
                with self.admin() as client:
                    client.ping()
                    if self.cluster:
                        self._own_all_slots(client, end)
                return
            except (redis.ConnectionError, OSError):
                if time.monotonic() > end:
                    raise TimeoutError("TLS redis-server not ready") from None
                time.sleep(0.05)

    def _own_all_slots(self, client: redis.Redis, end: float) -> None:
        """A one-node cluster: this node serves every slot (a 3-node TLS cluster proves no
        more about the client's TLS options and costs seconds)."""
        if int(client.cluster("info").get("cluster_slots_assigned", 0)) == 0:
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        while client.cluster("info").get("cluster_state") != "ok":
            if time.monotonic() > end:
                raise TimeoutError("the one-node TLS cluster did not reach cluster_state:ok")
            time.sleep(0.05)


@pytest.fixture(scope="module")
def tls_redis(certs: Certs) -> Iterator[TlsRedis]:
    """Client certificates optional: plain TLS and mutual TLS both work."""
    with TlsRedis(certs, auth_clients="optional") as server:
        yield server


@pytest.fixture(scope="module")
def mtls_redis(certs: Certs) -> Iterator[TlsRedis]:
    """Client certificates required (mutual TLS)."""
    with TlsRedis(certs, auth_clients="yes") as server:
        yield server


async def _permit_works(url: str, prefix: str) -> None:
    """Acquire, park, hand off and release over ``url``; fail (not fall back) on any error."""
    async with Fleet(
        url, prefix=prefix, registry=CollectorRegistry(), on_redis_error="fail"
    ) as fleet:
        gate = fleet.gate("tls-gate", floor=1)
        async with gate.permit(deadline=5) as lease:
            waiting = asyncio.create_task(gate.acquire(deadline=5))
            await asyncio.sleep(0.1)
            assert not waiting.done()
        second = await asyncio.wait_for(waiting, 3)
        assert second.token > lease.token
        await second.release()
        assert (await fleet.utilization("tls-gate")).in_flight == 0


async def test_fleet_permit_over_tls(tls_redis: TlsRedis) -> None:
    await _permit_works(tls_redis.tls_url(client_cert=False), "tls")


async def test_mutual_tls_with_a_client_certificate(mtls_redis: TlsRedis) -> None:
    await _permit_works(mtls_redis.tls_url(client_cert=True), "mtls")


@pytest.mark.long
async def test_cluster_flag_over_tls(certs: Certs) -> None:
    with TlsRedis(certs, auth_clients="optional", cluster=True) as node:
        url = node.tls_url(client_cert=False)
        assert "cluster=1" in url
        client = connect(url)
        try:
            assert isinstance(client, redis.asyncio.RedisCluster)  # a subclass: fleetgate._redis
            await prepare(client)
            assert await client.ping()
        finally:
            await client.aclose()
        await _permit_works(url, "tlsc")


async def test_coordinator_over_tls(tls_redis: TlsRedis) -> None:
    cfg = Config.from_toml_text(
        f"""
[redis]
url = "{tls_redis.tls_url(client_cert=True)}"
prefix = "tlscoord"
[coordinator]
poll_interval = 0.2
leader_ttl = 1.0
metrics_listen = "127.0.0.1:0"
scrape_timeout = 0.1
[[gates]]
name = "g"
floor = 3
""",
        env={},
    )
    assert cfg.redis.url.startswith("rediss://")
    coord = Coordinator(cfg, registry=CollectorRegistry())
    stop = asyncio.Event()
    task = asyncio.create_task(coord.run(stop))
    try:
        with tls_redis.admin() as admin:
            for _ in range(100):
                if admin.hget(GateKeys.of("tlscoord", "g").cfg, "floor") == "3":
                    break
                await asyncio.sleep(0.05)
            assert admin.hget(GateKeys.of("tlscoord", "g").cfg, "floor") == "3"
        assert coord.election.is_leader
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def _fleet_fails_fast(url: str, needle: str) -> str:
    """The client path: a Fleet with on_redis_error="fail" raises RedisUnavailable at once."""
    async with Fleet(
        url, prefix="nope", registry=CollectorRegistry(), on_redis_error="fail"
    ) as fleet:
        start = time.monotonic()
        with pytest.raises(RedisUnavailable) as info:
            await asyncio.wait_for(fleet.gate("g").acquire(), 5)
        took = time.monotonic() - start
    message = str(info.value)
    assert needle in message, message
    assert took < 2, f"took {took:.1f}s"
    return message


async def _connect_fails_fast(url: str) -> str:
    client = connect(url)
    start = time.monotonic()
    try:
        with pytest.raises(redis.ConnectionError) as info:
            await client.ping()
    finally:
        await client.aclose()
    assert time.monotonic() - start < 2
    return str(info.value)


async def test_a_client_that_does_not_trust_the_ca_fails_clearly(
    tls_redis: TlsRedis, certs: Certs
) -> None:
    # No CA at all (the system store does not know ours): a clear, immediate error.
    message = await _fleet_fails_fast(
        f"rediss://127.0.0.1:{tls_redis.port}/0", "CERTIFICATE_VERIFY_FAILED"
    )
    assert "is unreachable" in message  # (with on_redis_error="fair_share": logged, fallback)
    # The wrong CA.
    wrong_ca = tls_redis.tls_url(client_cert=False, ca=certs.other_ca)
    assert "CERTIFICATE_VERIFY_FAILED" in await _connect_fails_fast(wrong_ca)
    # The host name is verified: 127.0.0.2 is not in the certificate (also with redis-py < 6,
    # where ssl_check_hostname defaulted to off; connect() turns it on).
    wrong_host = tls_redis.tls_url(client_cert=False).replace("127.0.0.1", "127.0.0.2")
    assert "IP address mismatch" in await _connect_fails_fast(wrong_host)
    # Plain redis:// against the TLS port: refused at once, not a hang.
    await _connect_fails_fast(f"redis://127.0.0.1:{tls_redis.port}/0")


async def test_mutual_tls_without_a_client_certificate_fails_fast(mtls_redis: TlsRedis) -> None:
    # TLS 1.3 finishes the handshake before the server checks the client certificate, so the
    # error shows at the first read: "certificate required" or a reset, depending on timing.
    message = await _connect_fails_fast(mtls_redis.tls_url(client_cert=False))
    assert any(s in message for s in ("certificate required", "reset", "EOF")), message


def test_check_command_over_tls(tls_redis: TlsRedis) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "fleetgate.cli", "check", "--redis", tls_redis.tls_url()],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "ok" in out.stdout


@pytest.mark.parametrize(
    ("query", "needle"),
    [
        ("ssl_ca_cert=/x", "unknown query parameter 'ssl_ca_cert' (did you mean 'ssl_ca_certs'?)"),
        ("ssl_ca_certs=/nonexistent/ca.crt", "ssl_ca_certs file '/nonexistent/ca.crt' does not"),
        ("ssl_cert_reqs=maybe", "ssl_cert_reqs must be none, optional or required"),
        ("ssl_ca_path=/tmp&cluster=1", "not supported for Redis Cluster"),
    ],
)
def test_tls_url_mistakes_are_config_errors(query: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        connect(f"rediss://:hunter2@127.0.0.1:6380/0?{query}")
    assert needle in str(info.value) and "hunter2" not in str(info.value)


def test_tls_options_need_rediss() -> None:
    with pytest.raises(ConfigError, match="needs a rediss://"):
        connect("redis://127.0.0.1:6380/0?ssl_ca_certs=/x")
    with pytest.raises(ConfigError, match="needs a rediss://"):
        Config.from_toml_text('[redis]\nurl = "redis://h:1/0?ssl_certfile=/c"\n', env={})
