"""``fleetgate proxy --workers N``: this process supervises N worker processes on one port.

The parent never serves a request. It

1. holds the port: a socket bound with SO_REUSEPORT and never listening (port 0 is resolved
   here, once; no connection is ever queued on it; another user's process cannot join the port,
   the kernel refuses a SO_REUSEPORT bind across users);
2. makes a directory for prometheus-client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``)
   and starts each worker (``python -m fleetgate.proxy._worker``) with a listening socket of its
   own on the port (SO_REUSEPORT: the kernel spreads new connections over the listeners), its
   configuration on stdin, and the Via name all workers share;
3. says ``listening on URL`` once every worker accepts;
4. on SIGTERM or SIGINT sends SIGTERM to every worker (each drains as a single proxy does: no
   new connections, the requests in flight and queued finished within ``drain_seconds``), a
   second signal sends a second SIGTERM (stop at once); exits 0 when every worker exited 0;
5. logs a worker that dies (its pid, exit code or signal), marks its metric files dead and
   starts another in its place, unless workers died :data:`RESTARTS` times within
   :data:`RESTART_WINDOW_S` (a crash loop: the proxy drains the rest and exits 1) or the first
   start fails (exit 1).

Each worker's share of ``max_buffered_bytes`` is 1/N of it (at least ``max_request_bytes``), so
the bound stays the proxy's.
"""

from __future__ import annotations

import collections
import contextlib
import glob
import logging
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import FrameType

import msgspec
from prometheus_client import multiprocess

from ._shared import MULTIPROC_ENV
from .config import ProxyConfig
from .server import bind

__all__ = ["RESTARTS", "RESTART_WINDOW_S", "STARTUP_TIMEOUT_S", "supervise"]

log = logging.getLogger("fleetgate.proxy")

#: more worker deaths than this within RESTART_WINDOW_S: the proxy stops (exit 1)
RESTARTS = 5
RESTART_WINDOW_S = 60.0
#: a worker must accept within this long of its start
STARTUP_TIMEOUT_S = 60.0
#: past its drain, the time a worker has to close its fleet before it is killed
_CLOSE_GRACE_S = 20.0


@dataclass
class _Worker:
    index: int
    proc: subprocess.Popen[bytes]
    started: float = field(default_factory=time.monotonic)
    ready: bool = False

    def check_ready(self) -> None:
        """Read the worker's ``ready`` line (its stdout is readable)."""
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() == b"ready":
            self.ready = True
        self.proc.stdout.close()


def _exit_text(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


class Supervisor:
    """The parent's state: the port, the metric directory, the workers (see the module's
    docstring)."""

    def __init__(self, config: ProxyConfig, metrics_dir: str, log_config: str | None) -> None:
        self.config = config
        self.n = config.proxy.workers
        self.metrics_dir = metrics_dir
        self.via_name = f"fleetgate-{secrets.token_hex(4)}"
        host, port = config.proxy.address
        self.host = host
        self.reservation = bind(host, port, reuse_port=True, listen=False)
        self.port: int = self.reservation.getsockname()[1]
        self.workers: dict[int, _Worker] = {}  # index -> worker
        self.signals = 0
        self.deaths: collections.deque[float] = collections.deque()
        self.failed = False
        per = max(config.proxy.max_request_bytes, config.proxy.max_buffered_bytes // self.n)
        proxy = msgspec.structs.replace(config.proxy, max_buffered_bytes=per, workers=1)
        self.brief = {
            "config": msgspec.to_builtins(msgspec.structs.replace(config, proxy=proxy)),
            "via_name": self.via_name,
            "workers": self.n,
            "metrics_dir": metrics_dir,
            "log_level": logging.getLogger().getEffectiveLevel(),
            "log_config": log_config,
            "parent": os.getpid(),  # not the worker's getppid(): it reads 1 if we died first
        }

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, index: int) -> None:
        """Start worker ``index`` on a listening socket of its own (SO_REUSEPORT)."""
        listener = bind(self.host, self.port, reuse_port=True)
        env = {**os.environ, MULTIPROC_ENV: self.metrics_dir}
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "fleetgate.proxy._worker", str(listener.fileno())],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                pass_fds=(listener.fileno(),),
                env=env,
            )
        finally:
            listener.close()  # the worker's copy is the one that listens
        assert proc.stdin is not None
        with proc.stdin:
            proc.stdin.write(msgspec.json.encode({**self.brief, "index": index}))
        self.workers[index] = _Worker(index, proc)
        log.info("fleetgate proxy: worker %d started, pid %d", index, proc.pid)

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signals += 1

    def forward(self) -> None:
        """One SIGTERM to every worker still running."""
        for w in self.workers.values():
            if w.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    w.proc.send_signal(signal.SIGTERM)

    def wait_ready(self, timeout: float) -> None:
        """Read the ``ready`` lines that came (at most ``timeout`` s)."""
        waiting = {
            w.proc.stdout: w
            for w in self.workers.values()
            if not w.ready and w.proc.stdout is not None and not w.proc.stdout.closed
        }
        if not waiting:
            time.sleep(timeout)
            return
        readable, _, _ = select.select(list(waiting), [], [], timeout)
        for f in readable:
            waiting[f].check_ready()

    def reap(self, stopping: bool) -> None:
        """Log each worker that exited; start another in its place unless ``stopping`` or a
        crash loop (then ``failed``)."""
        for index, w in list(self.workers.items()):
            code = w.proc.poll()
            if code is None:
                continue
            del self.workers[index]
            multiprocess.mark_process_dead(w.proc.pid, self.metrics_dir)  # type: ignore[no-untyped-call]
            # its per-process gauges (the client's in-flight and queue, by pid) are void too
            for path in glob.glob(os.path.join(self.metrics_dir, f"gauge_all_{w.proc.pid}.db")):
                os.remove(path)
            if stopping:
                log.info("fleetgate proxy: worker %d (pid %d) %s", index, w.proc.pid,
                         _exit_text(code))  # fmt: skip
                self.failed |= code != 0
                continue
            self._replace(w, code)

    def _replace(self, w: _Worker, code: int) -> None:
        now = time.monotonic()
        self.deaths.append(now)
        while self.deaths and self.deaths[0] < now - RESTART_WINDOW_S:
            self.deaths.popleft()
        what = f"worker pid {w.proc.pid} (worker {w.index}) {_exit_text(code)}"
        if not w.ready or len(self.deaths) > RESTARTS:
            why = "before it accepted" if not w.ready else f"{len(self.deaths)} deaths in 60 s"
            log.error("fleetgate proxy: %s, %s: stopping the proxy", what, why)
            self.failed = True
            return
        log.error("fleetgate proxy: %s; starting another", what)
        self.start(w.index)

    def kill_late(self, deadline: float) -> None:
        """SIGKILL the workers still running past ``deadline``."""
        if time.monotonic() < deadline:
            return
        for w in self.workers.values():
            if w.proc.poll() is None:
                log.error("fleetgate proxy: worker pid %d did not stop: SIGKILL", w.proc.pid)
                w.proc.kill()

    def close(self) -> None:
        for w in self.workers.values():
            w.proc.kill()
            w.proc.wait()
        self.reservation.close()


@contextlib.contextmanager
def _signals(handler: Callable[[int, FrameType | None], None]) -> Iterator[None]:
    sigs = (signal.SIGTERM, signal.SIGINT)
    before = {s: signal.signal(s, handler) for s in sigs}
    try:
        yield
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def _starting(sup: Supervisor, on_ready: Callable[[str], None]) -> bool:
    """Start the workers and wait until each accepts; False if one fails or a signal came."""
    for i in range(sup.n):
        sup.start(i)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not all(w.ready for w in sup.workers.values()):
        sup.wait_ready(0.1)
        sup.reap(stopping=False)
        if sup.failed or sup.signals or time.monotonic() > deadline:
            if time.monotonic() > deadline:
                log.error("fleetgate proxy: workers did not accept in %g s", STARTUP_TIMEOUT_S)
            return False
    log.info("fleetgate proxy: %d workers on %s", sup.n, sup.url)
    on_ready(sup.url)
    return True


def _running(sup: Supervisor) -> None:
    """Until a signal or a crash loop: replace the workers that die."""
    while not sup.signals and not sup.failed:
        sup.wait_ready(0.1)  # a replacement's ready line; else just the pause
        sup.reap(stopping=False)


def _stopping(sup: Supervisor) -> None:
    """SIGTERM to every worker (again for each further signal); wait for all to exit."""
    sent = 0
    deadline = time.monotonic() + sup.config.proxy.drain_seconds + _CLOSE_GRACE_S
    while sup.workers:
        if sent < max(1, sup.signals):
            sup.forward()
            sent += 1
        sup.reap(stopping=True)
        sup.kill_late(deadline)
        time.sleep(0.05)


def supervise(
    config: ProxyConfig, on_ready: Callable[[str], None], *, log_config: str | None = None
) -> int:
    """Run ``config.proxy.workers`` workers until SIGTERM/SIGINT; 0 when all drained cleanly,
    1 when the start failed, a crash loop stopped the proxy, or a worker exited badly.
    ``log_config``: the ``--log-config`` file, which each worker applies too (else they log as
    this process does, at its level, their pid in each line)."""
    metrics_dir = tempfile.mkdtemp(prefix="fleetgate-proxy-metrics-")
    try:
        sup = Supervisor(config, metrics_dir, log_config)
        try:
            with _signals(sup.on_signal):
                if _starting(sup, on_ready):
                    _running(sup)
                _stopping(sup)
        finally:
            sup.close()
        return 1 if sup.failed else 0
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)
