"""Fixtures of the chaos suite: the control channel, the simulator, worker processes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fleetgate.tools.redisproc import INSTALL_HINT, RedisProcess

from ._harness import Control, Sim, Workers


@pytest.fixture(scope="session")
def control_server() -> Iterator[RedisProcess]:
    """A private Redis for reports and commands; no fault ever touches it."""
    if not RedisProcess.available():
        pytest.fail(INSTALL_HINT, pytrace=False)
    with RedisProcess() as proc:
        yield proc


@pytest.fixture
def control(control_server: RedisProcess) -> Iterator[Control]:
    ctl = Control(control_server.url)
    yield ctl
    ctl.close()


@pytest.fixture
def sim() -> Iterator[Sim]:
    """The rerank simulator (20 ms + 1 ms per passage) with its exact running-calls timeline."""
    with Sim(base_ms=20.0, per_passage_ms=1.0) as s:
        yield s


@pytest.fixture
def workers(control: Control, tmp_path: Path) -> Iterator[Callable[..., Workers]]:
    """``workers(**base_spec)`` makes a pool of worker processes; every process it spawned is
    killed and reaped after the test, pass or fail (logs in ``tmp_path``)."""
    pools: list[Workers] = []

    def make(**base: Any) -> Workers:
        pool = Workers(control, tmp_path, base)
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.close()
