"""Fixtures of the real-server room: llama.cpp's ``llama-server`` and its random-weight model,
built and cached by ``make llama-server`` (``.ci/llama_server.py``).

``make test-long`` (the long tier, where these tests are) builds both first (cached: a second
run does nothing). Without the binary (a machine without cmake or a C++ compiler, or a bare
``pytest``) every test here skips, saying how to build it; with
``FLEETGATE_REQUIRE_REAL_SERVER=1`` (CI's long tier, ``.ci/run``) it fails instead, so CI cannot
pass by skipping them. The model is written here when only it is missing (seconds).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ._llama import BUILD_SCRIPT, SLOTS, LlamaServer, built_paths


@pytest.fixture(scope="session")
def llama_build() -> tuple[Path, Path]:
    """The llama-server binary and the model's path."""
    paths = built_paths()
    binary, model = Path(str(paths["binary"])), Path(str(paths["model"]))
    if not binary.is_file():
        reason = (
            f"llama-server is not built ({binary} is missing): run `make llama-server` "
            "(about 11 minutes on 2 cores, cached after)"
        )
        if os.environ.get("FLEETGATE_REQUIRE_REAL_SERVER"):
            pytest.fail(f"FLEETGATE_REQUIRE_REAL_SERVER is set and {reason}", pytrace=False)
        pytest.skip(reason)
    if not model.is_file():
        subprocess.run([sys.executable, str(BUILD_SCRIPT), "--only", "model"], check=True)
    return binary, model


@pytest.fixture(scope="package")
def llama(
    llama_build: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LlamaServer]:
    """One llama-server with SLOTS slots for this room's tests that do not restart it (each
    test has its own key prefix, so its own controller state); stopped after the room's last."""
    server = LlamaServer(*llama_build, tmp_path_factory.mktemp("llama"))
    server.start(SLOTS)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def own_llama(llama_build: tuple[Path, Path], tmp_path: Path) -> Iterator[LlamaServer]:
    """A llama-server of this test's own, not started yet (the test starts and restarts it);
    stopped after the test."""
    server = LlamaServer(*llama_build, tmp_path)
    try:
        yield server
    finally:
        server.stop()
