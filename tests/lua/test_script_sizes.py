"""Every Lua function of the scripts stays short enough to hold, as the Python ones do.

The same limit as tests/test_sizes.py's for Python functions (80 lines, the aim about 60): a
top-level ``local function``, ``function`` or ``name = function`` of a ``lua/*.lua`` file counts
from its first line to the ``end`` at column 0 that closes it. A script's body (the file's own
statements, which the library wraps as ``<name>_body``: every line after its header comment
that is in no top-level function) counts likewise. A failure lists every offender.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

FUNCTION_LINES = 80
LUA = Path(__file__).resolve().parents[2] / "lua"
_START = re.compile(
    r"^(?:local\s+function\s+([\w.:]+)|function\s+([\w.:]+)|(\w+)\s*=\s*function\b)"
)


def long_functions(source: str, limit: int) -> list[tuple[str, int]]:
    """``(name, lines)`` of every top-level function in ``source`` longer than ``limit``."""
    found: list[tuple[str, int]] = []
    name, start = None, 0
    for n, line in enumerate(source.splitlines(), 1):
        m = _START.match(line)
        if m and name is None:
            name, start = next(g for g in m.groups() if g), n
        elif name is not None and re.match(r"^end\b", line):
            if n - start + 1 > limit:
                found.append((name, n - start + 1))
            name = None
    return found


def body_lines(source: str) -> int:
    """The lines of a script's body: those after its header comment (the leading ``--`` lines)
    outside its top-level functions."""
    lines = source.splitlines()
    start = next((k for k, line in enumerate(lines) if not line.startswith("--")), len(lines))
    n, inside = 0, False
    for line in lines[start:]:
        if inside:
            inside = not re.match(r"^end\b", line)
        elif _START.match(line):
            inside = True
        else:
            n += 1
    return n


def test_no_lua_function_over_the_limit() -> None:
    files = sorted(LUA.glob("*.lua"))
    assert len(files) > 10  # the scripts were found
    bad = [
        f"{path.name}: {name}: {k} lines"
        for path in files
        for name, k in long_functions(path.read_text(), FUNCTION_LINES)
    ]
    assert not bad, "too long (split by step):\n  " + "\n  ".join(bad)


_SCRIPTS = [
    p.stem
    for p in sorted(LUA.glob("*.lua"))
    if not p.stem.startswith("lib_") and p.stem != "heartbeat_lib"
]


@pytest.mark.parametrize("name", _SCRIPTS)
def test_no_script_body_over_the_limit(name: str) -> None:
    k = body_lines((LUA / f"{name}.lua").read_text())
    assert 0 < k <= FUNCTION_LINES, f"{name}.lua: its body is {k} lines (split it into steps)"


def test_a_body_counts_the_lines_outside_functions() -> None:
    src = "-- header\n-- more\nlocal a = 1\nlocal function f()\n  x()\nend\n\nreturn a\n"
    assert body_lines(src) == 3  # local a, the blank line, return
    assert body_lines("-- only a header\n") == 0


@pytest.mark.parametrize(
    ("source", "wanted"),
    [
        ("local function f(a)\n" + "  x = 1\n" * 80 + "end\n", [("f", 82)]),
        ("g = function()\n" + "  if x then\n  end\n" * 40 + "end\n", [("g", 82)]),
        ("function h()\n" + "  x = 1\n" * 78 + "end\n", []),
        ("local function a()\nend\nlocal function b()\n" + "  y()\n" * 85 + "end\n", [("b", 87)]),
    ],
)
def test_a_planted_long_function_is_found(source: str, wanted: list[tuple[str, int]]) -> None:
    assert long_functions(source, FUNCTION_LINES) == wanted
