"""mypy --strict over the installed package layout, from a source checkout.

The repository keeps ``client/``, ``coordinator/`` and ``lua/`` at the root and installs them as
``fleetgate.client``, ``fleetgate.coordinator`` and ``fleetgate.lua`` (pyproject's
``[tool.setuptools] package-dir``). mypy has no such mapping, and it cannot follow setuptools'
editable-install finder either, so run over the folders as they are it sees a top-level
``client`` package and cannot resolve ``fleetgate.client``. This script builds the installed
tree as symlinks (read from pyproject, so a new mapping needs no edit here) under
``build/typecheck`` and runs ``mypy -p fleetgate -p benchmarks`` there; error paths read
``fleetgate/client/_acquire.py`` and so on, which map back to the checkout one to one.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import tomllib  # Python 3.11+, which CI and the dev machine run; the package itself needs 3.10

ROOT = Path(__file__).resolve().parent.parent
#: checked beside the package though not installed: the benchmarks import the package as users
#: do, and CI runs them only in their last step, so a renamed attribute would fail there first
UNINSTALLED = ("benchmarks",)


def build_tree(dest: Path) -> None:
    """Symlink every mapped package folder to its installed place under ``dest``."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    mapping: dict[str, str] = config["tool"]["setuptools"]["package-dir"]
    shutil.rmtree(dest, ignore_errors=True)
    top = mapping.pop("fleetgate")
    (dest / "fleetgate").mkdir(parents=True)
    for entry in (ROOT / top).iterdir():
        if entry.name != "__pycache__":
            (dest / "fleetgate" / entry.name).symlink_to(entry)
    for name, folder in mapping.items():
        (dest / Path(*name.split("."))).symlink_to(ROOT / folder)
    for folder in UNINSTALLED:
        (dest / folder).symlink_to(ROOT / folder)


def main() -> int:
    dest = ROOT / "build" / "typecheck"
    build_tree(dest)
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")]
    packages = [arg for name in ("fleetgate", *UNINSTALLED) for arg in ("-p", name)]
    return subprocess.call([*cmd, *packages], cwd=dest)


if __name__ == "__main__":
    raise SystemExit(main())
