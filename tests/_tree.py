"""The repository's rooms as installed: pyproject's ``package-dir`` mapping and every module
under it (read by the layer, size and packaging checks)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def package_dirs() -> dict[str, Path]:
    """pyproject's ``[tool.setuptools] package-dir``: top package name -> directory."""
    text = (ROOT / "pyproject.toml").read_text()
    if sys.version_info >= (3, 11):
        import tomllib

        data = tomllib.loads(text)
    else:
        data = pytest.importorskip("tomli").loads(text)
    mapping: dict[str, str] = data["tool"]["setuptools"]["package-dir"]
    return {name: ROOT / path for name, path in mapping.items()}


def discover() -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package ``__init__``), over every mapped package."""
    modules: dict[str, tuple[Path, bool]] = {}
    dirs = package_dirs()
    for name, top in dirs.items():
        for path in sorted(top.rglob("*.py")):
            rel = path.relative_to(top).with_suffix("").parts
            if any(part.startswith(".") for part in rel):
                continue
            is_pkg = rel[-1] == "__init__"
            parts = rel[:-1] if is_pkg else rel
            module = ".".join((name, *parts))
            modules[module] = (path, is_pkg)
    return modules
