"""A real Redis Sentinel deployment on loopback: one master, one replica, three sentinels.

Every process is a private ``redis-server`` (sentinels run ``redis-server <conf> --sentinel``
from the same package) on a free port, with a short ``down-after-milliseconds`` so a SIGKILLed
master is failed over in about two seconds. Tests kill the master and wait for the sentinels to
promote the replica, never by sleeping.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import redis

from fleetgate.tools.redisproc import RedisProcess, RedisServerMissing, free_port, wait_for_ping

__all__ = ["SentinelDeployment"]

SERVICE = "fgmaster"


class _Sentinel:
    """One ``redis-server --sentinel`` process; its config file is rewritten by Sentinel itself."""

    def __init__(self, master_port: int, quorum: int, down_after_ms: int) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RedisServerMissing("redis-server was not found on PATH")
        self.binary = binary
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="fleetgate-sentinel-"))
        self.conf = self.dir / "sentinel.conf"
        self.conf.write_text(
            "\n".join(
                [
                    f"port {self.port}",
                    "bind 127.0.0.1",
                    f"dir {self.dir}",
                    f"logfile {self.dir / 'sentinel.log'}",
                    f"sentinel monitor {SERVICE} 127.0.0.1 {master_port} {quorum}",
                    f"sentinel down-after-milliseconds {SERVICE} {down_after_ms}",
                    f"sentinel failover-timeout {SERVICE} {max(3 * down_after_ms, 3000)}",
                    f"sentinel parallel-syncs {SERVICE} 1",
                    "",
                ]
            ),
            encoding="utf-8",
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 10.0) -> None:
        self.proc = subprocess.Popen(
            [self.binary, str(self.conf), "--sentinel"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for_ping(self.port, self.proc, self.dir / "sentinel.log", timeout, "sentinel")

    def master_addr(self) -> tuple[str, int] | None:
        client = redis.Redis(port=self.port, socket_timeout=0.5, decode_responses=True)
        try:
            addr = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
        except redis.RedisError:
            return None
        finally:
            client.close()
        return (str(addr[0]), int(addr[1])) if addr else None

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)


class SentinelDeployment:
    """Master + replica + three sentinels (quorum 2), all private processes on 127.0.0.1."""

    def __init__(self, down_after_ms: int = 1000) -> None:
        self.master = RedisProcess()
        self.replica = RedisProcess()
        self.down_after_ms = down_after_ms
        self.sentinels: list[_Sentinel] = []

    @property
    def url(self) -> str:
        """The fleetgate Sentinel URL of this deployment (``redis+sentinel://``)."""
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def start(self) -> SentinelDeployment:
        try:
            self.master.start()
            self.replica.extra_args += ["--replicaof", "127.0.0.1", str(self.master.port)]
            self.replica.start()
            self._wait_replication()
            self.sentinels = [_Sentinel(self.master.port, 2, self.down_after_ms) for _ in range(3)]
            for s in self.sentinels:
                s.start()
            self._wait(lambda: self._sentinels_know_each_other(), 20, "sentinels discover")
        except BaseException:
            self.close()
            raise
        return self

    def _wait_replication(self, timeout: float = 10.0) -> None:
        client = redis.Redis(port=self.replica.port, decode_responses=True)
        try:
            self._wait(
                lambda: client.info("replication").get("master_link_status") == "up",
                timeout, "replica in sync",
            )  # fmt: skip
        finally:
            client.close()

    def _sentinels_know_each_other(self) -> bool:
        for s in self.sentinels:
            client = redis.Redis(port=s.port, decode_responses=True, socket_timeout=0.5)
            try:
                fields = client.sentinel_master(SERVICE)
                if int(fields["num-other-sentinels"]) < 2 or int(fields["num-slaves"]) < 1:
                    return False
            finally:
                client.close()
        return True

    def master_port(self) -> int | None:
        """The master's port as the first sentinel that answers sees it."""
        for s in self.sentinels:
            addr = s.master_addr()
            if addr is not None:
                return addr[1]
        return None

    def kill_master_and_wait_failover(self, timeout: float = 30.0) -> float:
        """SIGKILL the master; return the seconds until the sentinels name the replica master."""
        old = self.master.port
        t0 = time.monotonic()
        self.master.kill()
        self._wait(lambda: self.master_port() == self.replica.port, timeout, "failover")
        elapsed = time.monotonic() - t0
        assert old != self.replica.port
        return elapsed

    @staticmethod
    def _wait(cond: Callable[[], bool], timeout: float, what: str) -> None:
        end = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > end:
                raise TimeoutError(f"sentinel deployment: {what} not reached in {timeout}s")
            time.sleep(0.05)

    def close(self) -> None:
        for s in self.sentinels:
            s.close()
        self.replica.close()
        self.master.close()

    def __enter__(self) -> SentinelDeployment:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
