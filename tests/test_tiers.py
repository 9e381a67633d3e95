"""The two test tiers the Makefile runs hold every test exactly once.

``make test`` (the fast tier) and ``make test-long`` (the long tier) select with ``-m``; a test
missing from both would never run, and one in both would cost its time twice. This reads the
pytest commands the two targets run (``make -n``: printed, not run), collects each with
``--collect-only`` and compares the node ids with a collection of the whole suite. The long
tier's second command, the model hunt, re-runs the model tests of ``tests/lua`` at a bigger
budget: it must select only fast-tier tests, and some.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys

import pytest

from ._tree import ROOT

pytestmark = pytest.mark.long  # four collections of the suite: ~30-60 s

# A cap test across OS processes of each layer that stays in the fast tier (a change that
# breaks the cap somewhere fails `make test`, not only CI's long tier).
CAP_TESTS_IN_THE_FAST_TIER = {
    "lua": "tests/lua/test_admission.py::test_units_never_above_limit_across_processes",
    "client": "tests/client/test_fleet_processes.py::test_cap_holds_across_processes",
    "coordinator": (
        "tests/coordinator/test_publish_fencing.py"
        "::test_late_publish_of_a_deposed_leader_lands_nowhere"
    ),
    "proxy": "tests/proxy/test_workers.py::test_two_workers_share_the_port_and_the_cap",
}


def pytest_commands(target: str) -> list[tuple[dict[str, str], list[str]]]:
    """The (environment, arguments) of each pytest command ``make <target>`` runs."""
    out = subprocess.run(
        ["make", "-n", "-s", "-C", str(ROOT), target],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    commands = []
    for line in out.replace("\\\n", " ").splitlines():  # continued lines joined
        words = shlex.split(line)
        at = [i for i, w in enumerate(words) if w.endswith("/pytest")]
        if at:
            env = dict(w.split("=", 1) for w in words[: at[0]] if "=" in w)
            commands.append((env, words[at[0] + 1 :]))
    return commands


def start_collecting(env: dict[str, str], args: list[str]) -> subprocess.Popen[str]:
    """``pytest <args> --collect-only`` in the background, under the command's environment."""
    # --verbosity=-1 last: one node id a line, whatever -q the command has already
    argv = [sys.executable, "-m", "pytest", *args, "--collect-only", "--verbosity=-1"]
    argv += ["-p", "no:cacheprovider"]
    return subprocess.Popen(
        argv, cwd=ROOT, env={**os.environ, **env}, stdout=subprocess.PIPE, text=True
    )


def node_ids(proc: subprocess.Popen[str]) -> list[str]:
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-2000:]
    return [line for line in out.splitlines() if "::" in line]


@pytest.mark.timeout(600)
def test_the_two_tiers_hold_every_test_exactly_once() -> None:
    if shutil.which("make") is None:
        pytest.skip("make is not installed: the tiers are the Makefile's commands")
    fast_cmds, long_cmds = pytest_commands("test"), pytest_commands("test-long")
    assert len(fast_cmds) == 1, fast_cmds
    assert len(long_cmds) == 2, long_cmds  # the long tier, then the model hunt
    procs = [
        start_collecting({}, []),
        start_collecting(*fast_cmds[0]),
        start_collecting(*long_cmds[0]),
        start_collecting(*long_cmds[1]),
    ]
    every, fast, long, hunt = (node_ids(p) for p in procs)
    assert len(set(every)) == len(every) > 1000
    assert set(fast) & set(long) == set(), "tests in both tiers"
    assert set(every) - set(fast) - set(long) == set(), "tests in neither tier"
    assert sorted(fast + long) == sorted(every)
    assert {nid for nid in every if nid.startswith("tests/lua/")} <= set(fast), "all of tests/lua"
    for layer, nid in CAP_TESTS_IN_THE_FAST_TIER.items():
        # a test of the server matrix runs once per server: nid[redis-7.0], nid[valkey-9.1], ...
        runs = [f for f in fast if f == nid or f.startswith(nid + "[")]
        assert runs, f"the {layer} layer's cap test across processes left the fast tier"
    assert hunt and set(hunt) <= set(fast), "the hunt re-runs fast-tier model tests only"
    assert all(nid.startswith("tests/lua/") for nid in hunt)
