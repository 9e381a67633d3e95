"""A worker of ``fleetgate proxy --workers N`` whose parent died before the worker looked at its
parent still exits (it once read ``os.getppid()`` after the parent's death, got 1, and served
on as an orphan for good)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from fleetgate.proxy.config import ProxyConfig
from fleetgate.proxy.workers import Supervisor

from ..conftest import RedisUnderTest


def _dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=30)
    return gone.pid


@pytest.mark.timeout(60)
def test_a_worker_briefed_by_a_dead_parent_exits(rut: RedisUnderTest, tmp_path: Path) -> None:
    """The race, made deterministic: the brief names the parent (the supervisor's pid), and
    that parent is already gone when the worker starts; the worker must drain and exit within
    a few seconds (the orphan check runs twice a second), not serve on."""
    raw = {
        "redis": {"url": rut.url, "prefix": rut.prefix},
        "proxy": {"listen": "127.0.0.1:0", "workers": 2},
        "routes": [{"upstream": "http://127.0.0.1:1", "gate": "g"}],
    }
    sup = Supervisor(ProxyConfig.from_mapping(raw, env={}), str(tmp_path), None)
    try:
        brief = {**sup.brief, "parent": _dead_pid(), "index": 0}
        listener = socket.create_server(("127.0.0.1", 0))
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
        worker = subprocess.Popen(
            [sys.executable, "-m", "fleetgate.proxy._worker", str(listener.fileno())],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, pass_fds=(listener.fileno(),),
            env=env,
        )  # fmt: skip
        listener.close()
        assert worker.stdin is not None
        with worker.stdin:
            worker.stdin.write(msgspec.json.encode(brief))
        started = time.monotonic()
        try:
            code = worker.wait(timeout=15)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait(timeout=10)
            pytest.fail("the worker outlived its dead parent by 15 s")
        assert code == 0, code  # a drain, not a crash
        assert time.monotonic() - started < 15
        assert sup.brief["parent"] == os.getpid()  # the real parent names itself
    finally:
        sup.close()
