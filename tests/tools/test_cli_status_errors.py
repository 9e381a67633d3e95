"""``fleetgate status`` (and ``inspect``) name the Redis URL they could not use, without its
password: a port nobody listens on, a refused password, a server that dies under ``--watch``.
Before: redis-py's text alone (``fleetgate status: ConnectionError: Error 111 connecting to
127.0.0.1:1.``), which names no URL (no scheme, database, Sentinel or Cluster URL, nor
which of the flags, environment or config file it came from)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import redis

from fleetgate.tools.redisproc import RedisProcess, free_port

SECRET = "pw-31c7-secret"


def fleetgate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fleetgate.cli", *args], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("command", [["status"], ["status", "--json"], ["inspect", "g"]])
def test_an_unreachable_url_is_named_without_its_password(command: list[str]) -> None:
    port = free_port()
    url = f"redis://fleet:{SECRET}@127.0.0.1:{port}/3"
    out = fleetgate(*command, "--redis", url, "--prefix", "pfx")
    assert out.returncode == 1, out
    line = out.stderr.strip()
    assert line.startswith(
        f"fleetgate {command[0]}: Redis at redis://***@127.0.0.1:{port}/3 (prefix 'pfx') is "
        "unreachable: ConnectionError: "
    ), line
    assert SECRET not in out.stdout + out.stderr
    assert "Traceback" not in out.stderr


def test_a_refused_password_is_named_with_the_url(own_redis: RedisProcess) -> None:
    with redis.Redis(port=own_redis.port) as admin:
        admin.config_set("requirepass", SECRET)
    try:
        for url in (
            f"redis://:not-{SECRET}@127.0.0.1:{own_redis.port}/0",  # WRONGPASS
            f"redis://127.0.0.1:{own_redis.port}/0",  # NOAUTH: no password given
        ):
            out = fleetgate("status", "--redis", url)
            assert out.returncode == 1, out
            shown = url.replace(f":not-{SECRET}@", "***@")
            assert f"fleetgate status: Redis at {shown} (prefix 'fg')" in out.stderr, out.stderr
            assert SECRET not in out.stdout + out.stderr
    finally:
        with redis.Redis(port=own_redis.port, password=SECRET) as admin:
            admin.config_set("requirepass", "")


def test_watch_names_the_url_when_redis_goes_away(own_redis: RedisProcess) -> None:
    url = own_redis.url
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleetgate.cli", "status", "--watch", "0.2", "--redis", url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert "leader:" in proc.stdout.readline() + proc.stdout.readline()  # it watches
        own_redis.kill()
        deadline = time.monotonic() + 20
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        _, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1
    assert f"fleetgate status: Redis at {own_redis.url} (prefix 'fg') is unreachable" in err, err
