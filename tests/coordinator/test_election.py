"""Leader election across `fleetgate coordinator` OS processes against a real Redis."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from fleetgate.keys import GateKeys
from fleetgate.tools.sim import serve_in_thread

from .._stub import StubValues, metrics_stub
from .._workers import wait_for
from ..conftest import RedisUnderTest
from ._coordinator import start

POLL = 0.5
TTL = 2.0


def write_config(tmp_path: Path, rut: RedisUnderTest, metrics_url: str) -> Path:
    path = tmp_path / "coordinator.toml"
    path.write_text(
        f"""
[redis]
url = "{rut.url}"
prefix = "{rut.prefix}"
[coordinator]
poll_interval = {POLL}
poll_jitter = 0.0
leader_ttl = {TTL}
metrics_listen = "127.0.0.1:0"
scrape_timeout = 0.4
[[gates]]
name = "llm"
floor = 4
ceiling = 64
metrics_url = "{metrics_url}"
"""
    )
    return path


@pytest.mark.long
def test_failover_and_fencing(
    tmp_path: Path, rut: RedisUnderTest, procs: list[subprocess.Popen[bytes]]
) -> None:
    r = redis.Redis.from_url(rut.url, decode_responses=True)
    keys = GateKeys.of(rut.prefix, "llm")
    leader_key = f"{rut.prefix}:leader"
    # Saturated engine with our target stable: the controller holds, so the target stays put.
    values = StubValues(running=0, waiting_capacity=0)
    with serve_in_thread(metrics_stub(values)) as served:
        cfg = write_config(tmp_path, rut, f"{served.url}/metrics")
        by_id = {}
        for cid in ("c1", "c2", "c3"):
            p = start(cfg, cid)
            procs.append(p)
            by_id[cid] = p
        wait_for(lambda: r.exists(keys.target) == 1, 20)
        leader = r.get(leader_key)
        assert leader in by_id
        # Exactly one leader: only it writes, with one epoch, for a few polls.
        epochs = set()
        for _ in range(6):
            epochs.add(r.hget(keys.target, "epoch"))
            assert r.get(leader_key) == leader
            time.sleep(POLL / 2)
        assert len(epochs) == 1
        first_epoch = int(epochs.pop())
        # SIGKILL the leader: a standby publishes a higher epoch within TTL + 1 poll.
        t0 = time.monotonic()
        by_id[leader].kill()
        # The dead leader's last stored state, made distinct from the floor (nobody writes
        # until a standby wins): the standby must resume from it.
        r.hset(keys.util, "state", '{"target":24,"slow_start":false}')
        wait_for(lambda: int(r.hget(keys.target, "epoch") or 0) > first_epoch, TTL + POLL + 5)
        took = time.monotonic() - t0
        print(f"failover after leader SIGKILL: {took * 1000:.0f} ms (ttl {TTL * 1000:.0f} ms)")
        assert took <= TTL + POLL + 0.5
        new_leader = r.get(leader_key)
        assert new_leader in by_id and new_leader != leader
        # Warm failover: the standby resumed the stored state, not the floor.
        assert int(r.hget(keys.target, "value") or 0) == 24

        # SIGSTOP the new leader past its TTL, let a third one win, then SIGCONT: the woken
        # leader's writes are refused (its epoch is stale), and it steps down.
        stopped = by_id[new_leader]
        os.kill(stopped.pid, signal.SIGSTOP)
        epoch2 = int(r.hget(keys.target, "epoch") or 0)
        wait_for(lambda: int(r.hget(keys.target, "epoch") or 0) > epoch2, TTL + POLL + 5)
        third = r.get(leader_key)
        assert third not in (leader, new_leader)
        epoch3 = int(r.hget(keys.target, "epoch") or 0)
        os.kill(stopped.pid, signal.SIGCONT)
        for _ in range(int(3 * POLL / 0.05)):
            assert int(r.hget(keys.target, "epoch") or 0) >= epoch3
            time.sleep(0.05)
        assert r.get(leader_key) == third

        # Clean shutdown of the leader: a standby takes over without waiting the TTL.
        t0 = time.monotonic()
        by_id[third].send_signal(signal.SIGTERM)
        assert by_id[third].wait(10) == 0
        wait_for(lambda: r.get(leader_key) not in (None, third), TTL + 2)
        took = time.monotonic() - t0
        print(f"handover after SIGTERM: {took * 1000:.0f} ms")
        assert took < TTL
    r.close()


def test_config_errors_exit_nonzero_with_one_line(tmp_path: Path) -> None:
    cases = {
        "missing": None,
        "bad toml": "[redis\nurl=",
        "wrong type": '[[gates]]\nname = "x"\nfloor = "four"\n',
        "unknown key": '[[gates]]\nname = "x"\nfloor = 1\nflor = 2\n',
        "bad floor": '[[gates]]\nname = "a"\nfloor = 1\n[[gates]]\nname = "b"\nfloor = 0\n',
    }
    expect = {
        "missing": "not found",
        "bad toml": "TOML",
        "wrong type": "gates[0].floor",
        "unknown key": "flor",
        "bad floor": "gates[1].floor",
    }
    for name, text in cases.items():
        path = tmp_path / f"{name.replace(' ', '_')}.toml"
        if text is not None:
            path.write_text(text)
        out = subprocess.run(
            [sys.executable, "-m", "fleetgate.cli", "coordinator", "--config", str(path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode != 0, name
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1, (name, out.stderr)
        assert expect[name].lower() in lines[0].lower(), (name, lines[0])
