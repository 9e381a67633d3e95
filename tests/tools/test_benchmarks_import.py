"""Every benchmark module imports and every listed benchmark has a ``run``: CI's bench-quick runs
them last, so a broken import (a helper renamed in ``benchmarks/_server.py`` and not in one of its
users) would otherwise surface only there, after the whole suite."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import pytest

from benchmarks._common import BENCHMARKS, DRIVERS

ROOT = Path(__file__).resolve().parents[2]
MODULES = sorted(
    m.name for m in pkgutil.iter_modules([str(ROOT / "benchmarks")]) if m.name != "__main__"
)


def test_every_public_benchmark_module_is_listed() -> None:
    public = {m for m in MODULES if not m.startswith("_")}
    assert public == set(BENCHMARKS) | set(DRIVERS)


@pytest.mark.parametrize("name", MODULES)
def test_benchmark_module_imports(name: str) -> None:
    module = importlib.import_module(f"benchmarks.{name}")
    if name in BENCHMARKS:
        assert callable(getattr(module, "run", None)), f"benchmarks.{name} has no run(opts)"
