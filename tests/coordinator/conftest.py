"""Fixtures of the coordinator room."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator

import pytest


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    """A list to append started coordinator processes to; each is resumed (a test may have
    stopped it), killed and reaped after the test."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
        p.wait(10)
        if p.stderr:
            p.stderr.close()
