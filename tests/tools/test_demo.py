"""``fleetgate demo`` end to end: it runs, fails over, plots, and leaves no process behind."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis

from fleetgate.coordinator.config import Config, CoordinatorSettings
from fleetgate.demo.plan import GATES
from fleetgate.demo.processes import _config_toml
from fleetgate.tools.redisproc import INSTALL_HINT, RedisProcess

from ..conftest import RedisUnderTest


def _alive(pid: int) -> bool:
    """True if ``pid`` runs (a zombie counts as gone: it has exited)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _run_demo(out: Path, *extra: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "fleetgate.demo", "--out", str(out), "--quiet", *extra],
        capture_output=True,
        text=True,
        timeout=150,
        env=env,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "failover:" in proc.stdout and "peak targets" in proc.stdout
    assert (out / "demo.png").stat().st_size > 10_000
    data: dict[str, Any] = json.loads((out / "demo.json").read_text())
    still = {name: pid for name, pid in data["pids"].items() if _alive(pid)}
    assert not still, f"processes left behind: {still}"
    return data


def _check_failover_and_ramp(data: dict[str, Any]) -> None:
    samples = data["samples"]
    leaders = {s["leader"] for s in samples if s["leader"]}
    epochs = [s["epoch"] for s in samples if s["epoch"] is not None]
    assert len(leaders) >= 2, leaders
    assert max(epochs) > min(epochs), epochs
    fo = data["failover"]
    assert fo["killed"] in leaders and fo["new_leader"] in leaders - {fo["killed"]}
    assert fo["new_epoch"] > fo["old_epoch"]
    assert 0 < fo["elected_after"] <= fo["published_after"] < 30
    for gate in data["gates"]:
        targets = [
            s["gates"][gate["name"]]["target"]
            for s in samples
            if gate["name"] in s["gates"] and s["gates"][gate["name"]]["target"] is not None
        ]
        if gate["adaptive"]:
            assert max(targets) > gate["floor"], (gate["name"], targets)
        else:
            assert not targets  # a fixed gate has no target: its limit is the floor
    assert data["summary"]["requests_ok"] > 0
    if shutil.which("curl"):  # the non-Python caller, through fleetgate proxy on the same gate
        gateway = data["summary"]["gateway"]
        assert gateway["ok"] >= 1, gateway
        assert set(gateway["codes"]) <= {"200", "000"}, gateway  # 000: cut by the demo's end


def test_generated_config_is_valid() -> None:
    urls = {g.name: f"http://127.0.0.1:{9000 + i}" for i, g in enumerate(GATES)}
    cfg = Config.from_toml_text(_config_toml("redis://127.0.0.1:1/0", "fg", urls), env={})
    assert [g.name for g in cfg.gates] == [g.name for g in GATES]
    assert [cfg.is_adaptive(g) for g in cfg.gates] == [True, True, False]
    # the default lifetimes, not shorter ones that hide a slow takeover
    defaults = CoordinatorSettings()
    assert cfg.coordinator.leader_ttl == defaults.leader_ttl
    assert cfg.coordinator.poll_interval == defaults.poll_interval
    assert cfg.coordinator.target_ttl_polls == defaults.target_ttl_polls
    assert cfg.coordinator.takeover < cfg.coordinator.target_ttl  # targets outlive a failover


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_demo_embedded_redis(tmp_path: Path) -> None:
    if not RedisProcess.available():
        pytest.fail(INSTALL_HINT, pytrace=False)
    env = {k: v for k, v in os.environ.items() if k != "FLEETGATE_REDIS_URL"}
    data = _run_demo(tmp_path / "out", "--duration", "12", env=env)
    _check_failover_and_ramp(data)
    assert "redis" in data["pids"]
    assert data["prefix"] == "fg"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_demo_external_redis_uses_own_prefix(tmp_path: Path, shared_redis: RedisUnderTest) -> None:
    """With FLEETGATE_REDIS_URL the demo starts no Redis, uses a fresh prefix and removes only
    its own keys."""
    sentinel = f"t{uuid.uuid4().hex[:10]}:keep"
    with redis.Redis.from_url(shared_redis.url) as r:
        r.set(sentinel, "1")
        try:
            env = dict(os.environ, FLEETGATE_REDIS_URL=shared_redis.url)
            data = _run_demo(tmp_path / "out", "--duration", "8", "--workers", "1", env=env)
            _check_failover_and_ramp(data)
            assert "redis" not in data["pids"]
            prefix = data["prefix"]
            assert prefix.startswith("demo-")
            assert not list(r.scan_iter(match=f"{prefix}:*"))
            assert r.get(sentinel) == b"1"
        finally:
            r.delete(sentinel)
