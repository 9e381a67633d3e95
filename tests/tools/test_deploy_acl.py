"""The least-privilege ACL users of ``deploy/acl.conf``, applied verbatim to a private server.

A fleet runs every client path under the client rule, a coordinator every coordinator path under
the coordinator rule, the CLI's status/inspect/check under the coordinator rule -- and Redis'
ACL LOG must record no denial. Then the client rule is shown to deny what it must: keys outside
its pattern (another prefix, the leadership keys) and administrative commands.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import redis.asyncio as aredis
from prometheus_client import CollectorRegistry

from fleetgate.client import ConfigError, Fleet
from fleetgate.coordinator.config import Config
from fleetgate.coordinator.daemon import Coordinator
from fleetgate.keys import GateKeys
from fleetgate.tools.redisproc import RedisProcess
from fleetgate.tools.sim import serve_in_thread

from .._stub import StubValues, metrics_stub

pytestmark = pytest.mark.usefixtures("no_gc_during_test")

ACL_FILE = Path(__file__).resolve().parents[2] / "deploy" / "acl.conf"


def acl_rules() -> dict[str, list[str]]:
    """``user NAME RULES...`` lines of deploy/acl.conf; passwords become ``pw-NAME``."""
    users: dict[str, list[str]] = {}
    for line in ACL_FILE.read_text().splitlines():
        if line.startswith("user "):
            name, *rules = line.split()[1:]
            users[name] = [f">pw-{name}" if r.startswith(">") else r for r in rules]
    return users


@dataclass
class AclServer:
    proc: RedisProcess
    admin: redis.Redis

    def url(self, user: str) -> str:
        return f"redis://{user}:pw-{user}@127.0.0.1:{self.proc.port}/0"

    @property
    def client_url(self) -> str:
        return self.url("fleetgate-client")

    @property
    def coordinator_url(self) -> str:
        return self.url("fleetgate-coordinator")

    def denials(self) -> list[str]:
        entries = self.admin.execute_command("ACL", "LOG")
        return [f"{e['username']}: {e['reason']} {e['object']} ({e['context']})" for e in entries]


@pytest.fixture
def acl(own_redis: RedisProcess) -> Iterator[AclServer]:
    admin = redis.Redis(port=own_redis.port, decode_responses=True)
    users = acl_rules()
    assert set(users) == {"fleetgate-client", "fleetgate-coordinator"}
    for name, rules in users.items():
        admin.execute_command("ACL", "SETUSER", name, *rules)
    admin.execute_command("ACL", "LOG", "RESET")
    try:
        yield AclServer(own_redis, admin)
    finally:
        admin.close()


async def test_client_rule_covers_acquire_park_wake_release(acl: AclServer) -> None:
    async with Fleet(
        acl.client_url,
        registry=CollectorRegistry(),
        heartbeat_interval=0.1,
        on_redis_error="fail",  # a denial must raise, not hide in the fallback
    ) as fleet:
        gate = fleet.gate("rerank/x", floor=1, max_queued=1)
        first = await gate.acquire()
        parked = asyncio.create_task(gate.acquire(deadline=5))
        await asyncio.sleep(0.3)  # parked; heartbeats renew lease and waiter, register the gate
        assert not parked.done()
        await first.release()  # hands the slot to the parked caller and wakes its pod
        second = await asyncio.wait_for(parked, 3)
        assert (await fleet.utilization("rerank/x")).in_flight == 1
        await second.release()
        # A deadline while parked: the waiter leaves the queue (cancel.lua).
        third = await gate.acquire()
        with pytest.raises(TimeoutError):
            await gate.acquire(deadline=0.2)
        await third.release()
        assert await gate.capacity() == 1
    assert acl.denials() == []


@pytest.mark.long
async def test_coordinator_rule_covers_election_publish_reaper_and_cli(acl: AclServer) -> None:
    admin = aredis.Redis(port=acl.proc.port, decode_responses=True)
    llm, fixed = GateKeys.of("fg", "llm"), GateKeys.of("fg", "fixed")
    # An expired lease the reaper has to sweep.
    await admin.zadd(fixed.holders, {"deadpod:1": 1})
    # Gates no config names: one idle (pruned: script, SREM, EXISTS), one held (checked only).
    idle, held = GateKeys.of("fg", "idle"), GateKeys.of("fg", "held")
    await admin.hset(idle.cfg, "floor", 1)
    await admin.zadd(held.holders, {"pod:1": 2**50})
    await admin.sadd("fg:gates", "fixed", "idle", "held")
    with serve_in_thread(metrics_stub(StubValues(running=1, model="m"))) as served:
        cfg = Config.from_toml_text(
            f"""
[redis]
url = "{acl.coordinator_url}"
[coordinator]
poll_interval = 0.2
poll_jitter = 0.0
leader_ttl = 1.0
metrics_listen = "127.0.0.1:0"
scrape_timeout = 0.15
prune_idle_after = 0.2
[[gates]]
name = "llm"
floor = 2
metrics_url = "{served.url}/metrics"
[[gates]]
name = "fixed"
floor = 3
""",
            env={},
        )
        for _ in range(2):  # the second run resumes from the stored state (warm failover)
            coord = Coordinator(cfg, registry=CollectorRegistry(), reap_interval=0.1)
            stop = asyncio.Event()
            task = asyncio.create_task(coord.run(stop))
            for _ in range(100):  # leader, target of this term published, dead lease swept
                term = coord._election.term if coord._election else None
                epoch = await admin.hget(llm.target, "epoch")
                swept = not await admin.zcard(fixed.holders)
                pruned = not await admin.sismember("fg:gates", "idle")
                if term is not None and epoch == str(term.epoch) and swept and pruned:
                    break
                await asyncio.sleep(0.05)
            assert coord.election.is_leader and swept and pruned
            assert coord.safety_findings == []  # INFO was enough to check the settings
            stop.set()
            await task
    assert int(await admin.hget(llm.target, "epoch") or 0) >= 2
    assert await admin.hget(fixed.cfg, "floor") == "3"
    assert await admin.hget(llm.util, "state")
    assert await admin.sismember("fg:gates", "held") and await admin.zcard(held.holders) == 1
    await admin.aclose()
    for command in (["status", "--json"], ["inspect", "llm"], ["check"]):
        out = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "fleetgate.cli", *command, "--redis", acl.coordinator_url],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, (command, out.stderr)
    assert acl.denials() == []


def test_coordinator_rule_covers_init(acl: AclServer) -> None:
    """``fleetgate init`` under the coordinator rule: the stamp (and a named gate's) written,
    again a no-op, no denial. (The fixture stamped ``fg`` as the default user; unstamped here.)"""
    acl.admin.delete("fg:born")
    argv = [sys.executable, "-m", "fleetgate.cli", "init", "--redis", acl.coordinator_url]
    for expected in ("stamped (fg:born = 0 and gates llm)", "is already stamped"):
        out = subprocess.run(
            [*argv, "--gate", "llm"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0 and expected in out.stdout, out.stderr
    assert acl.admin.get("fg:born") == "0" and acl.admin.hget("fg:{llm}:cfg", "fence") == "0"
    assert acl.denials() == []


async def test_client_rule_denies_keys_outside_its_pattern(acl: AclServer) -> None:
    r = aredis.Redis.from_url(acl.client_url, decode_responses=True)
    try:
        for call in (
            r.set("other:key", "x"),
            r.get("fg:leader"),  # the leadership keys belong to the coordinator
            r.incr("fg:epoch"),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                await call
        for call in (r.keys("*"), r.flushall(), r.config_get("requirepass"), r.info()):
            with pytest.raises(redis.exceptions.NoPermissionError):
                await call
    finally:
        await r.aclose()
    # A fleet under another prefix: its script's keys are outside the pattern.
    async with Fleet(
        acl.client_url, prefix="other", registry=CollectorRegistry(), on_redis_error="fail"
    ) as fleet:
        # Translated where it enters fleetgate: a ConfigError naming the gate and the ACL file.
        with pytest.raises(ConfigError, match=r"gate 'g'.*no permissions.*acl\.conf"):
            await asyncio.wait_for(fleet.gate("g").acquire(), 3)
    assert acl.denials()  # the attempts are on record
    assert all(d.startswith("fleetgate-client") for d in acl.denials())
