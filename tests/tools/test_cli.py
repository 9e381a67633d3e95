"""The command line against a real redis-server: status, inspect, check, help."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import redis
from prometheus_client import CollectorRegistry

from fleetgate.client import Fleet
from fleetgate.scripts import GateScripts

from ..conftest import RedisUnderTest


def fleetgate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fleetgate.cli", *args], capture_output=True, text=True, timeout=60
    )


def test_status_json_and_inspect(rut: RedisUnderTest) -> None:
    async def setup() -> None:
        async with Fleet(
            rut.url, prefix=rut.prefix, registry=CollectorRegistry(), heartbeat_interval=0.1
        ) as fleet:
            gate = fleet.gate("bge-m3", floor=4, ceiling=64)
            lease = await gate.acquire()
            await asyncio.sleep(0.3)  # the first heartbeat registers the gate
            await GateScripts(fleet.redis).set_target(gate.keys, 9, epoch=3, ttl_ms=60_000)
            await fleet.redis.set(f"{rut.prefix}:leader", "coord-a")
            await fleet.redis.set(f"{rut.prefix}:epoch", "3")
            out = fleetgate("status", "--json", "--redis", rut.url, "--prefix", rut.prefix)
            assert out.returncode == 0, out.stderr
            status = json.loads(out.stdout)
            assert status["leader"] == "coord-a" and status["epoch"] == 3
            [g] = status["gates"]
            for field in (
                "name",
                "limit",
                "target",
                "floor",
                "ceiling",
                "epoch",
                "in_flight",
                "queued",
                "saturated",
                "last_poll",
                "units",
                "schema",
                "bands",
                "tenants",
                "tenants_other",
            ):
                assert field in g
            assert (g["name"], g["limit"], g["target"], g["epoch"], g["in_flight"]) == (
                "bge-m3",
                9,
                9,
                3,
                1,
            )
            human = fleetgate("status", "--redis", rut.url, "--prefix", rut.prefix)
            assert "bge-m3" in human.stdout and "coord-a" in human.stdout
            assert g["units"] == 1 and " 1/9 " in human.stdout  # units held / limit
            detail = fleetgate("inspect", "bge-m3", "--redis", rut.url, "--prefix", rut.prefix)
            assert detail.returncode == 0 and lease.id in detail.stdout
            await lease.release()

    asyncio.run(setup())


def test_check_health(rut: RedisUnderTest) -> None:
    ok = fleetgate("check", "--redis", rut.url)
    assert ok.returncode == 0, ok.stderr
    bad = fleetgate("check", "--redis", "redis://user:s3cret@127.0.0.1:1/0")
    assert bad.returncode == 1
    assert "s3cret" not in bad.stderr + bad.stdout  # secrets never printed


@pytest.mark.parametrize("cmd", [[], ["coordinator"], ["status"], ["inspect"], ["check"], ["init"]])
def test_help_explains(cmd: list[str]) -> None:
    out = fleetgate(*cmd, "--help")
    assert out.returncode == 0
    assert "usage: fleetgate" in out.stdout and len(out.stdout) > 200


def test_init_stamps_a_new_prefix_once_and_refuses_one_in_use(rut: RedisUnderTest) -> None:
    """Exit 0 and what it did; again: a no-op, exit 0; a prefix holding keys: exit 1, why, and
    nothing written. ``--help`` says what it is for and what a wipe does."""
    new = f"i{uuid.uuid4().hex[:10]}"
    first = fleetgate("init", "--redis", rut.url, "--prefix", new)
    assert first.returncode == 0, first.stderr
    assert f"prefix {new!r} is new: stamped ({new}:born = 0)" in first.stdout
    again = fleetgate("init", "--redis", rut.url, "--prefix", new)
    assert (again.returncode, again.stdout) == (
        0,
        f"prefix {new!r} is already stamped: nothing to do.\n",
    )
    used = f"u{uuid.uuid4().hex[:10]}"
    with redis.Redis.from_url(rut.url, decode_responses=True) as r:
        r.set(f"{used}:leader", "coord-a")
        refused = fleetgate("init", "--redis", rut.url, "--prefix", used)
        assert refused.returncode == 1 and refused.stdout == ""
        assert f"prefix {used!r} is not new (it holds {used}:leader): not stamped" in refused.stderr
        assert r.get(f"{used}:born") is None
    help_text = " ".join(fleetgate("init", "--help").stdout.split())
    assert "recovery fence" in help_text and "removes the stamp" in help_text


@pytest.mark.cluster
def test_init_on_cluster_needs_the_gates(cluster_rut: RedisUnderTest, tmp_path: Path) -> None:
    """Cluster: exit 2 without gate names, nothing written; the coordinator config's gates are
    stamped (its Redis and prefix taken from it), each in its own slot."""
    bare = fleetgate("init", "--redis", cluster_rut.url, "--prefix", cluster_rut.prefix)
    assert bare.returncode == 2 and "name the gates (--gate NAME" in bare.stderr
    config = tmp_path / "coordinator.toml"
    config.write_text(
        f'[redis]\nurl = "{cluster_rut.url}"\nprefix = "{cluster_rut.prefix}"\n'
        '[[gates]]\nname = "chat"\nfloor = 2\n[[gates]]\nname = "embed"\nfloor = 2\n'
    )
    done = fleetgate("init", "--config", str(config), "--gate", "rerank")
    assert done.returncode == 0, done.stderr
    assert "stamped gates rerank, chat, embed" in done.stdout


def test_inspect_names_a_gate_that_does_not_exist(rut: RedisUnderTest) -> None:
    """A gate with no state and not in the registry is a typo, not a gate of limit 1."""

    async def setup() -> None:
        async with Fleet(
            rut.url, prefix=rut.prefix, registry=CollectorRegistry(), heartbeat_interval=0.1
        ) as fleet:
            lease = await fleet.gate("bge-m3", floor=2).acquire()
            await asyncio.sleep(0.3)  # the first heartbeat registers the gate
            await lease.release()

    asyncio.run(setup())
    for extra in ([], ["--json"]):
        typo = fleetgate("inspect", "bge-m4", *extra, "--redis", rut.url, "--prefix", rut.prefix)
        assert typo.returncode == 1, typo.stdout
        assert typo.stdout == ""
        assert "no gate 'bge-m4'" in typo.stderr and "bge-m3" in typo.stderr  # names the known
    known = fleetgate("inspect", "bge-m3", "--redis", rut.url, "--prefix", rut.prefix)
    assert known.returncode == 0, known.stderr
    assert "gate bge-m3: limit 2" in known.stdout


SHORT_LIVED = """
import asyncio, sys
from prometheus_client import CollectorRegistry
from fleetgate.client import Fleet

async def main() -> None:
    async with Fleet(sys.argv[1], prefix=sys.argv[2], registry=CollectorRegistry()) as fleet:
        async with fleet.gate("short").permit(deadline=5):
            pass

asyncio.run(main())
"""


def test_status_lists_the_gate_of_a_process_that_already_left(rut: RedisUnderTest) -> None:
    """A process that used a gate for a moment and exited (a cron job, a test) is listed."""
    ran = subprocess.run(
        [sys.executable, "-c", SHORT_LIVED, rut.url, rut.prefix], capture_output=True, timeout=60
    )
    assert ran.returncode == 0, ran.stderr
    out = fleetgate("status", "--json", "--redis", rut.url, "--prefix", rut.prefix)
    assert [g["name"] for g in json.loads(out.stdout)["gates"]] == ["short"]
