"""Every product module stays small enough to read, and every function short enough to hold.

Product modules are the installed packages' ``.py`` files (pyproject's ``package-dir``; the
simulators and the demo included: they are read as examples). Limits: 500 lines a module, 80 a
function (``def`` to its last line, nested functions counted in their parent too). The aim is
lower (about 400 and 60, ``docs/design.md``); the limits are where a file or a function has
plainly taken on a second job. A failure lists every offender with its size.

The suite's own modules (every ``.py`` under ``tests/``, helpers included) stay under 600 lines:
a test file holds one behaviour of one room, and what several files share lives in a helper
module or a conftest of that room.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ._tree import discover

MODULE_LINES = 500
FUNCTION_LINES = 80
TEST_MODULE_LINES = 600
TESTS = Path(__file__).resolve().parent


def long_functions(source: str, limit: int) -> list[tuple[str, int]]:
    """``(qualified name, lines)`` of every function in ``source`` longer than ``limit``."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    lines = (child.end_lineno or child.lineno) - child.lineno + 1
                    if lines > limit:
                        found.append((name, lines))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def offenders(files: dict[str, Path]) -> list[str]:
    """A line per module over :data:`MODULE_LINES`, per function over :data:`FUNCTION_LINES`."""
    out = []
    for module, path in sorted(files.items()):
        source = path.read_text()
        n = len(source.splitlines())
        if n > MODULE_LINES:
            out.append(f"{module}: {n} lines")
        out += [f"{module}.{f}: {k} lines" for f, k in long_functions(source, FUNCTION_LINES)]
    return out


def long_test_modules(root: Path) -> list[str]:
    """A line per ``.py`` file under ``root`` over :data:`TEST_MODULE_LINES`."""
    out = []
    for path in sorted(root.rglob("*.py")):
        n = len(path.read_text().splitlines())
        if n > TEST_MODULE_LINES:
            out.append(f"{path.relative_to(root).as_posix()}: {n} lines")
    return out


def test_no_module_or_function_over_its_limit() -> None:
    files = {m: path for m, (path, _) in discover().items()}
    assert len(files) > 50  # the discovery found the packages
    bad = offenders(files)
    assert not bad, "too long (split by job):\n  " + "\n  ".join(bad)


@pytest.mark.parametrize(
    ("source", "wanted"),
    [
        ("def f():\n" + "    x = 1\n" * 80, [("f", 81)]),
        ("class C:\n    async def m(self):\n" + "        pass\n" * 90, [("C.m", 91)]),
        ("def f():\n    def g():\n" + "        pass\n" * 85, [("f", 87), ("f.g", 86)]),
        ("def f():\n" + "    x = 1\n" * 79, []),
    ],
)
def test_a_planted_long_function_is_found(source: str, wanted: list[tuple[str, int]]) -> None:
    assert long_functions(source, FUNCTION_LINES) == wanted


def test_a_planted_long_module_is_found(tmp_path: Path) -> None:
    path = tmp_path / "big.py"
    path.write_text("x = 1\n" * (MODULE_LINES + 1))
    assert offenders({"fleetgate.big": path}) == [f"fleetgate.big: {MODULE_LINES + 1} lines"]


def test_no_test_module_over_its_limit() -> None:
    assert len(list(TESTS.rglob("test_*.py"))) > 50  # the suite's files were found
    bad = long_test_modules(TESTS)
    assert not bad, "test modules too long (split by behaviour):\n  " + "\n  ".join(bad)


def test_a_planted_long_test_module_is_found(tmp_path: Path) -> None:
    (tmp_path / "room").mkdir()
    (tmp_path / "room" / "test_big.py").write_text("x = 1\n" * (TEST_MODULE_LINES + 1))
    (tmp_path / "room" / "_helper.py").write_text("x = 1\n" * (TEST_MODULE_LINES + 2))
    (tmp_path / "test_fits.py").write_text("x = 1\n" * TEST_MODULE_LINES)
    assert long_test_modules(tmp_path) == [
        f"room/_helper.py: {TEST_MODULE_LINES + 2} lines",
        f"room/test_big.py: {TEST_MODULE_LINES + 1} lines",
    ]
