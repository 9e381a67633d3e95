"""``fleetgate check`` names what a server lacks or refuses of the commands fleetgate sends:
each refusal made real by an ACL user (or, for the argument bound, a proxy that refuses as
ElastiCache Serverless does), on each server of the matrix."""

from __future__ import annotations

import uuid

import pytest
import redis
import redis.asyncio as aredis

from fleetgate import commands
from fleetgate._redis import MAX_ARGS, connect, prepare
from fleetgate.safety import Finding, capability_findings
from fleetgate.tools.redisproc import RedisClusterProcess

from .._argcap import ArgCapProxy
from .._servers import MatrixServer
from ..conftest import RedisUnderTest

pytestmark = pytest.mark.servers


def _user(port: int, *rules: str) -> str:
    """A user of every command and key but ``rules`` took away; its name."""
    name = f"u{uuid.uuid4().hex[:8]}"
    with redis.Redis(port=port) as admin:
        admin.execute_command("ACL", "SETUSER", name, "on", ">pw", "~*", "&*", "+@all", *rules)
    return name


def _port(rut: RedisUnderTest) -> int:
    """The private server's port (ACL users are made on it)."""
    if rut.process is None:
        pytest.skip("needs a private server: FLEETGATE_TEST_REDIS_URL names one not ours")
    return rut.process.port


async def _findings(url: str, prefix: str) -> list[Finding]:
    client = connect(url)
    try:
        await prepare(client)  # as `fleetgate check` does: a cluster client's topology first
        return await capability_findings(client, prefix)
    finally:
        await client.aclose()


def _has_setinfo(port: int) -> bool:
    """CLIENT SETINFO came with Redis 7.2 (Valkey reports redis_version 7.2.4)."""
    with redis.Redis(port=port, decode_responses=True) as admin:
        version = str(admin.info("server")["redis_version"])
    return tuple(int(x) for x in version.split(".")[:2]) >= (7, 2)


async def test_a_server_that_runs_everything_has_no_finding(rut: RedisUnderTest) -> None:
    assert await _findings(rut.url, rut.prefix) == []


@pytest.mark.parametrize(
    ("rules", "expected"),
    [
        (["-function"], {("error", "functions", "FUNCTION LOAD")}),
        (["-fcall"], {("error", "functions", "FCALL")}),
        (
            ["-eval", "-evalsha", "-fcall"],
            {("error", "functions", "FCALL"), ("warning", "evalsha", "EVALSHA")},
        ),
    ],
)
async def test_each_refused_script_command_is_named(
    rut: RedisUnderTest, rules: list[str], expected: set[tuple[str, str, str]]
) -> None:
    port = _port(rut)
    url = f"redis://{_user(port, *rules)}:pw@127.0.0.1:{port}/0"
    findings = await _findings(url, rut.prefix)
    assert {(f.level, f.code) for f in findings} == {(level, code) for level, code, _ in expected}
    for level, code, command in expected:
        [found] = [f for f in findings if f.code == code]
        assert found.level == level and command in found.message, found
        assert "refuses" in found.message and "permission" in found.message


async def test_a_refused_client_setinfo_is_a_note_and_config_is_not_needed(
    rut: RedisUnderTest, matrix_server: MatrixServer, capsys: pytest.CaptureFixture[str]
) -> None:
    port = _port(rut)
    url = f"redis://{_user(port, '-client', '-config')}:pw@127.0.0.1:{port}/0"
    findings = await _findings(url, rut.prefix)
    if _has_setinfo(port):
        [note] = findings
        assert (note.level, note.code) == ("note", "client") and "CLIENT SETINFO" in note.message
    else:  # Redis 7.0 has no SETINFO (redis-py expects that) and fleetgate sends no other
        assert findings == []
    assert await commands.check(url, rut.prefix) == commands.EXIT_OK  # INFO names the policy
    out = capsys.readouterr()
    assert "ERROR" not in out.err and ": ok" in out.out
    assert out.out.startswith(matrix_server.name.replace("-", " ") + ".")  # valkey 9.1.2 at ...


async def test_the_cli_fails_on_refused_functions(
    rut: RedisUnderTest, capsys: pytest.CaptureFixture[str]
) -> None:
    port = _port(rut)
    url = f"redis://{_user(port, '-function')}:pw@127.0.0.1:{port}/0"
    assert await commands.check(url, rut.prefix) == commands.EXIT_ERROR
    err = capsys.readouterr().err
    assert "ERROR: the server refuses FUNCTION LOAD" in err and "no EVAL fallback" in err


@pytest.mark.parametrize(
    ("cap", "level", "shown"), [(MAX_ARGS, "note", "4,000"), (MAX_ARGS - 1, "error", "3,999")]
)
async def test_an_argument_bound_is_named(
    rut: RedisUnderTest, cap: int, level: str, shown: str
) -> None:
    async with ArgCapProxy(_port(rut), cap) as proxy:
        [found] = await _findings(proxy.url, rut.prefix)
    assert (found.level, found.code) == (level, "arguments")
    assert f"a command of {shown} arguments" in found.message
    assert proxy.refused >= 1


async def test_refused_sharded_pubsub_is_named_on_cluster(
    cluster_rut: RedisUnderTest, redis_cluster: RedisClusterProcess
) -> None:
    name = f"u{uuid.uuid4().hex[:8]}"
    for node in redis_cluster.nodes:
        admin = aredis.Redis(port=node.port)
        try:
            await admin.execute_command(
                "ACL", "SETUSER", name, "on", ">pw", "~*", "&*", "+@all", "-ssubscribe",
                "-spublish",
            )  # fmt: skip
        finally:
            await admin.aclose()
    url = f"redis://{name}:pw@127.0.0.1:{redis_cluster.nodes[0].port}/0?cluster=1"
    findings = await _findings(url, cluster_rut.prefix)
    assert sorted((f.level, f.code) for f in findings) == [("warning", "shard_pubsub")] * 2
    assert {f.message.split(" (")[0] for f in findings} == {
        "the server refuses SPUBLISH",
        "the server refuses SSUBSCRIBE",
    }
    # the same user on a standalone server is not asked: its pods pop lists
    assert await _findings(cluster_rut.url, cluster_rut.prefix) == []
