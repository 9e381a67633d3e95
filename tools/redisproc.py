"""Start and stop private ``redis-server`` processes (tests, benchmarks, the demo).

A private server listens on a free loopback port, keeps nothing on disk and is waited for by
PING, never by sleeping. It can be killed and restarted on the same port for fault tests.

A port from :func:`free_port` was free a moment ago only: by the time the server binds it, another
process (a server of a concurrent test run, an outgoing connection) may hold it. A server whose
ports were picked here therefore starts again on fresh ports when a bind fails, and the server
that answers the readiness PING must be ours (its ``process_id``), not whoever holds the port.

The server binary is ``redis-server`` on the PATH unless a ``binary`` is given or
FLEETGATE_REDIS_SERVER names one (a ``valkey-server``, say: the suite's server matrix,
tests/conftest.py, passes each server it tests against as ``binary``).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

__all__ = [
    "SERVER_ENV",
    "PortTaken",
    "RedisClusterProcess",
    "RedisProcess",
    "RedisServerMissing",
    "free_port",
    "server_binary",
]

#: Environment variable naming the server binary to start instead of ``redis-server``.
SERVER_ENV = "FLEETGATE_REDIS_SERVER"

INSTALL_HINT = (
    "redis-server was not found on PATH. Install Redis 7 (Debian/Ubuntu: "
    "`apt-get install redis-server`; macOS: `brew install redis`), or point the tests at a "
    "server you own with FLEETGATE_TEST_REDIS_URL=redis://host:port/db"
)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class RedisServerMissing(RuntimeError):
    """No ``redis-server`` binary is available."""


def server_binary(binary: str | None = None) -> str | None:
    """The server binary to start: ``binary``, else $FLEETGATE_REDIS_SERVER, else
    ``redis-server`` on the PATH; None when it is not found (a path given is used as given)."""
    chosen = binary or os.environ.get(SERVER_ENV) or "redis-server"
    return shutil.which(chosen)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_ping(
    port: int,
    proc: subprocess.Popen[bytes] | None,
    logfile: Path,
    timeout: float,
    what: str,
) -> None:
    """Wait until the server on ``port`` answers PING; if ``proc`` exits first, raise with the
    tail of its ``logfile``."""
    end = time.monotonic() + timeout
    client = redis.Redis(port=port, socket_connect_timeout=0.5, socket_timeout=0.5)
    try:
        while True:
            if proc is not None and proc.poll() is not None:
                log = logfile.read_text(errors="replace")[-2000:] if logfile.exists() else ""
                raise RuntimeError(f"{what} exited with {proc.returncode}: {log}")
            try:
                # The server that answers must be ours, not whoever held the port before it
                # (ours then fails its bind and exits: the caller may retry on another port).
                if client.ping() and (proc is None or _pid_of(client) == proc.pid):
                    return
            except (redis.ConnectionError, redis.TimeoutError):  # not up yet, or not a Redis
                pass
            if time.monotonic() > end and (proc is None or proc.poll() is None):
                raise TimeoutError(f"{what} on port {port} not ready in {timeout}s")
            time.sleep(0.02)
    finally:
        client.close()


def _pid_of(client: redis.Redis) -> int | None:
    try:
        return int(client.info("server")["process_id"])
    except (redis.RedisError, KeyError, ValueError):
        return None


class PortTaken(RuntimeError):
    """The server could not bind one of its ports (``Address already in use``)."""


class RedisProcess:
    """One private redis-server process on 127.0.0.1.

    ``extra_args`` may name ``{port}`` (this server's port) and ``{cluster_port}`` (a free port
    picked for the cluster bus). Ports picked here (``port`` None) are picked again when the
    first start finds one taken; a given ``port`` is used as given. ``binary``: the server to
    run (:func:`server_binary`: a ``valkey-server`` speaks the same protocol).
    """

    START_ATTEMPTS = 5

    def __init__(
        self,
        port: int | None = None,
        *,
        extra_args: list[str] | None = None,
        die_with_parent: bool = False,
        binary: str | None = None,
    ) -> None:
        found = server_binary(binary)
        if found is None:
            raise RedisServerMissing(f"{binary} was not found" if binary else INSTALL_HINT)
        self.binary = found
        self._pick_ports = port is None
        self.port = port or free_port()
        self.extra_args = list(extra_args or [])
        self.cluster_port: int | None = (
            free_port() if any("{cluster_port}" in a for a in self.extra_args) else None
        )
        self._started = False  # a restart keeps the ports (clients reconnect to them)
        # Linux: the server gets SIGTERM when the process that started it dies, even by SIGKILL
        # (the demo must not leave an orphan redis-server behind).
        self.die_with_parent = die_with_parent
        self.dir = Path(tempfile.mkdtemp(prefix="fleetgate-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The server's ``redis://`` URL (database 0)."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisProcess:
        """Start the server and wait until it answers PING (on fresh ports if one was taken)."""
        attempts = self.START_ATTEMPTS if self._pick_ports and not self._started else 1
        for attempt in range(1, attempts + 1):
            try:
                self._start(timeout)
            except PortTaken:
                if attempt == attempts:
                    raise
                self.port = free_port()
                if self.cluster_port is not None:
                    self.cluster_port = free_port()
            else:
                self._started = True
                return self
        raise AssertionError("unreachable")  # pragma: no cover

    def _args(self) -> list[str]:
        subst = {"{port}": str(self.port), "{cluster_port}": str(self.cluster_port)}
        out = []
        for arg in self.extra_args:
            for key, value in subst.items():
                arg = arg.replace(key, value)
            out.append(arg)
        return out

    def _start(self, timeout: float) -> None:
        log = self.dir / "redis.log"
        log.unlink(missing_ok=True)  # redis appends: a failed attempt's lines are not this one's
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.dir),
            "--logfile", str(self.dir / "redis.log"),
            "--maxmemory-policy", "noeviction",
            *self._args(),
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=_die_with_parent if self.die_with_parent else None,
        )
        try:
            self.wait_ready(timeout)
        except RuntimeError as exc:
            if self.proc.poll() is not None and "Address already in use" in (
                log.read_text(errors="replace") if log.exists() else ""
            ):
                self.proc = None
                raise PortTaken(str(exc)) from exc
            raise

    def wait_ready(self, timeout: float) -> None:
        """Wait until the server answers PING; its log tail explains a failure."""
        wait_for_ping(self.port, self.proc, self.dir / "redis.log", timeout, "redis-server")

    def kill(self) -> None:
        """SIGKILL the server (state is lost: nothing is persisted)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        """Terminate the server and wait for it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def restart(self) -> None:
        """SIGKILL the server and start it again, empty, on the same port."""
        self.kill()
        self.start()

    def close(self) -> None:
        """Stop the server and remove its directory."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def available() -> bool:
        """Whether the server binary (:func:`server_binary`) is found."""
        return server_binary() is not None


class RedisClusterProcess:
    """A real Redis Cluster of ``masters`` private ``redis-server --cluster-enabled yes`` nodes,
    created with ``redis-cli --cluster create`` and waited for until every node reports
    ``cluster_state:ok``. ``binary``: the nodes' server, as for :class:`RedisProcess` (Redis'
    ``redis-cli`` creates a Valkey cluster too)."""

    def __init__(self, masters: int = 3, *, binary: str | None = None) -> None:
        self.nodes = [
            RedisProcess(
                binary=binary,
                extra_args=[
                    "--cluster-enabled", "yes",
                    "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", "2000",
                    # An explicit bus port: the default (port + 10000) may be taken or > 65535.
                    "--cluster-port", "{cluster_port}",
                ]
            )
            for _ in range(masters)
        ]  # fmt: skip

    @property
    def url(self) -> str:
        """A fleetgate URL for the cluster (any node seeds the topology)."""
        return f"redis://127.0.0.1:{self.nodes[0].port}/0?cluster=1"

    def start(self, timeout: float = 20.0) -> RedisClusterProcess:
        """Start the nodes, create the cluster and wait for ``cluster_state:ok`` on each."""
        try:
            return self._start(timeout)
        except BaseException:
            self.close()
            raise

    def _start(self, timeout: float) -> RedisClusterProcess:
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RedisServerMissing(INSTALL_HINT)
        for node in self.nodes:
            node.start()
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run(
            [cli, "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=timeout,
        )
        end = time.monotonic() + timeout
        for node in self.nodes:
            client = redis.Redis(port=node.port, decode_responses=True)
            try:
                while client.cluster("info").get("cluster_state") != "ok":
                    if time.monotonic() > end:
                        raise TimeoutError("Redis Cluster did not reach cluster_state:ok")
                    time.sleep(0.05)
            finally:
                client.close()
        return self

    def close(self) -> None:
        """Stop every node and remove their directories."""
        for node in self.nodes:
            node.close()

    def __enter__(self) -> RedisClusterProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
