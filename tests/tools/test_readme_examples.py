"""Every Python example of the README runs as written, against a private redis-server.

The examples take the Redis URL from ``FLEETGATE_REDIS_URL`` (``Fleet()``'s default), so each
runs in a process of its own with that variable pointing at a server this test started, and a
prefix of its own, stamped by ``fleetgate init`` first as the quickstart says. An example that
defines ``test_*`` functions (the ``fleetgate.testing`` one) has them called, as pytest would.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import uuid

import pytest

from fleetgate.stamp import init_prefix
from fleetgate.tools.redisproc import RedisProcess

from .._tree import ROOT

_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_RUN_TESTS = """

for _name, _fn in list(globals().items()):
    if _name.startswith("test_") and callable(_fn):
        _fn()
"""


def readme_examples() -> list[tuple[int, str]]:
    """``(line, code)`` of each ```python block of README.md."""
    text = (ROOT / "README.md").read_text()
    return [(text.count("\n", 0, m.start()) + 1, m[1]) for m in _BLOCK.finditer(text)]


EXAMPLES = readme_examples()


def test_the_readme_has_examples() -> None:
    assert len(EXAMPLES) >= 6  # a pattern that stopped matching would pass every case below


@pytest.fixture(scope="module")
def server() -> object:
    with RedisProcess() as proc:
        yield proc


@pytest.mark.parametrize(("line", "code"), EXAMPLES, ids=[f"line{n}" for n, _ in EXAMPLES])
def test_the_example_runs_as_written(server: RedisProcess, line: int, code: str) -> None:
    prefix = f"readme{uuid.uuid4().hex[:8]}"
    # as the quickstart says: `fleetgate init` on a new prefix (no recovery fence at first)
    assert asyncio.run(init_prefix(server.url, prefix)).result == "stamped"
    env = {**os.environ, "FLEETGATE_REDIS_URL": server.url, "FLEETGATE_PREFIX": prefix}
    ran = subprocess.run(
        [sys.executable, "-c", code + _RUN_TESTS],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, f"README.md line {line}:\n{ran.stderr[-3000:]}"
