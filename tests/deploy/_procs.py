"""Processes of the end-to-end observability test: start with output to a log, stop with a
signal (killed if they linger), wait for a condition, ask Prometheus' HTTP API."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx


@contextlib.contextmanager
def process(argv: list[str], log: Path, env: dict[str, str] | None = None) -> Iterator[Any]:
    """Popen with output to ``log``; on exit SIGTERM, wait, kill if it lingers."""
    with log.open("wb") as out, subprocess.Popen(argv, stdout=out, stderr=out, env=env) as proc:
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)


def wait_for(check: Callable[[], bool], timeout: float, what: str, interval: float = 0.2) -> None:
    end = time.monotonic() + timeout
    while not check():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def query(api: httpx.Client, promql: str) -> list[dict[str, Any]]:
    """An instant query's result; an error answer (a bad expression) fails with its text."""
    body = api.get("/api/v1/query", params={"query": promql}).json()
    assert body["status"] == "success", f"{promql}: {body}"
    return list(body["data"]["result"])


def tail(path: Path, n: int = 2000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else "(no log)"
