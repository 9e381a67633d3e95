"""Every process the demo starts: :class:`Children` starts each in its own process group, logs it
to a file and stops them in order (SIGTERM, a bounded wait, SIGKILL); :func:`wait_for` polls until
one is ready, never sleeping a fixed time."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from fleetgate.tools.redisproc import RedisProcess

__all__ = ["STARTUP_TIMEOUT", "Children", "DemoError", "wait_for"]

STARTUP_TIMEOUT = 30.0


class DemoError(RuntimeError):
    """Setup failed (a process did not start, Redis is missing, ...); the message says why."""


def _pdeathsig() -> Callable[[], None] | None:
    """On Linux, a pre-exec hook asking the kernel to SIGTERM the child if the demo dies."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1

    def hook() -> None:
        prctl(pr_set_pdeathsig, int(signal.SIGTERM))

    return hook


class Children:
    """Every process the demo started, by name, in stop order groups."""

    GROUPS = ("worker", "coordinator", "sim")

    def __init__(self, log_dir: Path) -> None:
        """Logs of the children go to ``log_dir/<name>.log``."""
        self.log_dir = log_dir
        self.procs: dict[str, tuple[str, subprocess.Popen[bytes]]] = {}
        self.redis: RedisProcess | None = None
        self.on_close: list[Callable[[], None]] = []
        self.env: dict[str, str] = dict(os.environ)
        self._hook = _pdeathsig()

    def spawn(
        self, name: str, group: str, argv: list[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` in its own process group (Ctrl-C reaches only the demo), with
        ``env`` added to :attr:`env`."""
        with open(self.log_dir / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**self.env, **(env or {})},
                start_new_session=True,
                preexec_fn=self._hook,
            )
        self.procs[name] = (group, proc)
        return proc

    def start_redis(self) -> RedisProcess:
        """A private redis-server, with SIGINT blocked so a terminal Ctrl-C cannot kill it
        before the workers have left (the mask is inherited; SIGTERM still stops it)."""
        server = RedisProcess(die_with_parent=True)
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            self.redis = server
            server.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        return server

    def log_tail(self, name: str, chars: int = 1500) -> str:
        """The end of a child's log, for error messages."""
        path = self.log_dir / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return text[-chars:].strip() or "(empty log)"

    def check_alive(self, name: str) -> None:
        """Raise :class:`DemoError` with the log tail if ``name`` has exited."""
        proc = self.procs[name][1]
        if proc.poll() is not None:
            raise DemoError(f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}")

    def kill(self, name: str) -> int:
        """SIGKILL ``name``'s process group; return its pid."""
        proc = self.procs[name][1]
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return proc.pid

    def pids(self, include_stopped: bool = True) -> dict[str, int]:
        """Name → pid of every child (and Redis, when it is ours)."""
        out = {n: p.pid for n, (_, p) in self.procs.items() if include_stopped or p.poll() is None}
        if self.redis is not None and self.redis.proc is not None:
            out["redis"] = self.redis.proc.pid
        return out

    def stop_all(self) -> None:
        """Stop the groups in order (workers release their permits first), then Redis."""
        for group, grace in zip(self.GROUPS, (10.0, 8.0, 5.0), strict=True):
            members = [p for g, p in self.procs.values() if g == group]
            for p in members:
                if p.poll() is None:
                    _signal_group(p.pid, signal.SIGTERM)
            deadline = time.monotonic() + grace
            for p in members:
                try:
                    p.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    _signal_group(p.pid, signal.SIGKILL)
                    p.wait(5)
                _signal_group(p.pid, signal.SIGKILL)  # any grandchild left in the group
        for hook in self.on_close:
            try:
                hook()
            except Exception as exc:  # cleanup must go on
                print(f"cleanup: {exc}", file=sys.stderr)
        if self.redis is not None:
            self.redis.close()

    def survivors(self) -> list[str]:
        """Names of children that are still running (should be none after :meth:`stop_all`)."""
        alive = [n for n, (_, p) in self.procs.items() if p.poll() is None]
        if self.redis is not None and self.redis.proc is not None:
            alive.append("redis")
        return alive


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def wait_for(
    what: str, check: Callable[[], bool], alive: Callable[[], None], timeout: float
) -> None:
    """Poll ``check`` until true; ``alive`` raises if the process behind it died."""
    end = time.monotonic() + timeout
    while not check():
        alive()
        if time.monotonic() > end:
            raise DemoError(f"{what} not ready after {timeout:.0f} s")
        time.sleep(0.05)
