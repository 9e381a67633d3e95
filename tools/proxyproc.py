"""``fleetgate proxy`` as an OS process, for tests and benchmarks: start it on a free port, read
the URL it prints when it listens, stop it with SIGTERM (its drain), SIGKILL if it hangs."""

from __future__ import annotations

import subprocess
import sys
import threading

__all__ = ["start_proxy_process", "stop_process"]


def start_proxy_process(
    args: list[str], log_path: str, timeout: float = 20.0
) -> tuple[subprocess.Popen[bytes], str]:
    """``fleetgate proxy ARGS`` as an OS process (``--listen 127.0.0.1:0`` is added unless
    given); returns (Popen, base URL) once it printed that it listens. Its logs go to
    ``log_path``; if it does not start within ``timeout`` s, RuntimeError with their tail."""
    if "--listen" not in args and "--config" not in args:
        args = [*args, "--listen", "127.0.0.1:0"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fleetgate.cli", "proxy", *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log,
        )
    found: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        if "listening on " in line:
            found.append(line.rsplit("listening on ", 1)[1].strip())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    if not found:
        proc.kill()
        proc.wait(5)
        if proc.stdout is not None:
            proc.stdout.close()
        with open(log_path, errors="replace") as f:
            tail = f.read()[-2000:]
        raise RuntimeError(f"fleetgate proxy did not start (exit {proc.returncode}): {tail}")
    return proc, found[0]


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 15.0) -> int:
    """SIGTERM, wait; SIGKILL if it does not stop. Returns the exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    if proc.stdout is not None:
        proc.stdout.close()
    return int(proc.returncode)
