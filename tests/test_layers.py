"""The import rules between fleetgate's layers, and no import cycles between its modules.

Every module of the installed packages (``fleetgate/``, ``client/``, ``coordinator/``, ``lua/``
mapped by pyproject's ``package-dir``) is parsed with :mod:`ast`; every import counts, also one
inside a function or under ``if TYPE_CHECKING:`` (a cycle of knowledge is a cycle). An import
of ``a.b.c`` is an edge to ``a.b.c`` only, not to the packages above it: Python runs their
``__init__`` first, but counting that would put every module that imports a sibling into a cycle
with a package ``__init__`` that re-exports it.

The layers, bottom up, each in a folder of its own at the repository root (mapped to its
import name by ``package-dir``; ``test_each_layer_has_a_folder_of_its_own`` holds that no module
lives in another layer's folder, so the tree shows the layers):

* **core** — ``fleetgate/`` (errors, keys, settings, the ask, scripts, the Redis connection,
  config files, status, safety, registry, the read-only commands :mod:`fleetgate.commands`) and
  ``lua/``. It imports no other layer.
* **client** (``client/``, ``fleetgate.client``) and **coordinator** (``coordinator/``,
  ``fleetgate.coordinator``) — each on the core only; they never know about each other.
* **proxy** (``proxy/``, ``fleetgate.proxy``: ``fleetgate proxy``, the HTTP gateway) -- on the
  client and the core; nothing below knows it.
* **tools** (``tools/``, ``fleetgate.tools``: simulators, redis-server launcher, load generator)
  and **testing** (``testing/``, ``fleetgate.testing``) — on the client and the core.
* **demo** (``demo/``, ``fleetgate.demo``) — on anything below it.
* **cli** (``cli/``, ``fleetgate.cli``) — the dispatcher on top: it may import any layer, lazily,
  inside the subcommand that runs it (the coordinator for ``fleetgate coordinator``, the demo,
  the tools). That is why the read-only commands live in the core module
  :mod:`fleetgate.commands`: what an operator runs against Redis stays core, only the dispatch is
  an application.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

from ._tree import ROOT, discover, package_dirs

# layer -> the layers it must never import
FORBIDDEN: dict[str, set[str]] = {
    "core": {"client", "coordinator", "demo", "tools", "testing", "cli", "proxy"},
    "client": {"coordinator", "demo", "tools", "testing", "cli", "proxy"},
    "coordinator": {"client", "demo", "tools", "testing", "cli", "proxy"},
    "proxy": {"coordinator", "demo", "tools", "testing", "cli"},
    "tools": {"coordinator", "demo", "testing", "cli", "proxy"},
    "testing": {"coordinator", "demo", "tools", "cli", "proxy"},
    "demo": {"testing", "cli"},
    "cli": set(),
}

_PREFIX_LAYERS = (
    ("fleetgate.client", "client"),
    ("fleetgate.coordinator", "coordinator"),
    ("fleetgate.demo", "demo"),
    ("fleetgate.proxy", "proxy"),
    ("fleetgate.tools", "tools"),
    ("fleetgate.testing", "testing"),
    ("fleetgate.cli", "cli"),
)


def layer_of(module: str) -> str:
    """The layer a ``fleetgate.*`` module belongs to."""
    for prefix, layer in _PREFIX_LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            return layer
    return "core"


def imports_of(source: str, module: str, is_pkg: bool, known: Iterable[str]) -> set[str]:
    """Every ``fleetgate.*`` module ``source`` imports, wherever the import statement is.

    ``from X import Y`` counts as an import of ``X.Y`` when that is a module, else of ``X``;
    relative imports are resolved against ``module``.
    """
    known = set(known)
    package = module if is_pkg else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):  # walks function bodies and if-blocks too
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join([*base, *([node.module] if node.module else [])])
            else:
                origin = node.module or ""
            for alias in node.names:
                sub = f"{origin}.{alias.name}"
                found.add(sub if sub in known else origin)
    return {m for m in found if m == "fleetgate" or m.startswith("fleetgate.")}


def import_graph(sources: Mapping[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """Module -> the fleetgate modules it imports (no self-edges from ``from . import``)."""
    known = set(sources)
    return {
        module: imports_of(text, module, is_pkg, known) - {module}
        for module, (text, is_pkg) in sources.items()
    }


def layer_violations(graph: Mapping[str, set[str]]) -> list[str]:
    """One readable line per import that breaks :data:`FORBIDDEN`."""
    bad = []
    for module, targets in sorted(graph.items()):
        layer = layer_of(module)
        for target in sorted(targets):
            if layer_of(target) in FORBIDDEN[layer]:
                bad.append(f"{module} ({layer}) imports {target} ({layer_of(target)})")
    return bad


def strongly_connected(graph: Mapping[str, set[str]]) -> list[frozenset[str]]:
    """The sets of modules that import each other, directly or around a loop (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                members.add(w)
                if w == v:
                    break
            if len(members) > 1 or v in graph.get(v, ()):
                found.append(frozenset(members))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def cycle_chain(graph: Mapping[str, set[str]], members: frozenset[str]) -> str:
    """One shortest import loop through the first member, as ``a -> b -> a``."""
    start = min(members)
    paths = {start: [start]}
    frontier = [start]
    while frontier:  # breadth first inside the set, back to start
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, set()) & members):
                if w == start:
                    return " -> ".join([*paths[v], start])
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no loop through {start} in {sorted(members)}")


def folder_violations(modules: Mapping[str, Path], dirs: Mapping[str, Path]) -> list[str]:
    """One line per module whose layer is not its room's: each layer has a folder of its own
    (pyproject's ``package-dir``), so a module of one layer inside another's folder is misfiled
    (the import rule above would still hold; the tree would no longer show the layers)."""
    bad = []
    for module, path in sorted(modules.items()):
        room = max(
            (name for name, top in dirs.items() if path.is_relative_to(top)),
            key=lambda name: len(dirs[name].parts),
        )
        if layer_of(module) != layer_of(room):
            bad.append(
                f"{module} ({layer_of(module)}) lives in {dirs[room].name}/ ({layer_of(room)})"
            )
    return bad


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    sources = {m: (path.read_text(), pkg) for m, (path, pkg) in discover().items()}
    return import_graph(sources)


def test_the_modules_are_found(graph: dict[str, set[str]]) -> None:
    for module in (
        "fleetgate.errors",
        "fleetgate.cli",
        "fleetgate.client._fleet",
        "fleetgate.coordinator.daemon",
        "fleetgate.demo.main",
        "fleetgate.tools.load",
        "fleetgate.tools.sim.vllm",
        "fleetgate.proxy.app",
        "fleetgate.lua",
    ):
        assert module in graph
    assert "fleetgate.client" in graph["fleetgate.testing"]
    assert "fleetgate.coordinator.daemon" in graph["fleetgate.cli"]  # a lazy import counts


def test_layers_import_only_downwards(graph: dict[str, set[str]]) -> None:
    bad = layer_violations(graph)
    assert not bad, "imports against the layering:\n  " + "\n  ".join(bad)


def test_each_layer_has_a_folder_of_its_own() -> None:
    dirs = package_dirs()
    layers = {layer_of(name) for name in dirs}
    assert layers == set(FORBIDDEN), f"layers without a folder: {set(FORBIDDEN) - layers}"
    bad = folder_violations({m: path for m, (path, _) in discover().items()}, dirs)
    assert not bad, "modules outside their layer's folder:\n  " + "\n  ".join(bad)


def test_a_misfiled_module_is_found(tmp_path: Path) -> None:
    dirs = {"fleetgate": tmp_path / "fleetgate", "fleetgate.proxy": tmp_path / "proxy"}
    modules = {
        "fleetgate.keys": dirs["fleetgate"] / "keys.py",
        "fleetgate.proxy.app": dirs["fleetgate.proxy"] / "app.py",
        # a core module whose name only starts like a room's is core
        "fleetgate.proxy_extra.app": dirs["fleetgate"] / "proxy_extra" / "app.py",
        "fleetgate.tools.load": dirs["fleetgate"] / "tools" / "load.py",
    }
    assert folder_violations(modules, dirs) == [
        "fleetgate.tools.load (tools) lives in fleetgate/ (core)"
    ]


def test_no_import_cycles(graph: dict[str, set[str]]) -> None:
    cycles = strongly_connected(graph)
    chains = [cycle_chain(graph, c) for c in cycles]
    assert not chains, "import cycles:\n  " + "\n  ".join(chains)


# The checks themselves must be able to fail: planted violations on synthetic modules.

_TC = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    {}\n"
_IN_FUNCTION = "def f():\n    {}\n"


@pytest.mark.parametrize(
    ("module", "source", "wanted"),
    [
        ("fleetgate.status", "from fleetgate.client import Fleet", "fleetgate.client (client)"),
        ("fleetgate.keys", _IN_FUNCTION.format("import fleetgate.coordinator.daemon"), "daemon"),
        ("fleetgate.scripts", _TC.format("from fleetgate.tools import load"), "tools.load"),
        ("fleetgate.safety", _IN_FUNCTION.format("from fleetgate import demo"), "demo (demo)"),
        ("fleetgate.client._gate", "from fleetgate.coordinator import config", "coordinator"),
        ("fleetgate.client._gate", _TC.format("from ..tools.sim import vllm"), "tools.sim.vllm"),
        ("fleetgate.coordinator.daemon", _TC.format("from fleetgate.client import Gate"), "client"),
        ("fleetgate.coordinator.signals", "from ..demo.main import main", "fleetgate.demo.main"),
        ("fleetgate.client._gate", _IN_FUNCTION.format("import fleetgate.proxy.app"), "proxy"),
        ("fleetgate.proxy.app", "from fleetgate.coordinator import config", "coordinator"),
    ],
)
def test_a_planted_layer_violation_is_found(module: str, source: str, wanted: str) -> None:
    modules = {
        "fleetgate.client": "",
        "fleetgate.coordinator.config": "",
        "fleetgate.coordinator.daemon": "",
        "fleetgate.demo": "",
        "fleetgate.demo.main": "",
        "fleetgate.tools.load": "",
        "fleetgate.tools.sim.vllm": "",
        "fleetgate.proxy.app": "",
        module: source,
    }
    pkgs = {"fleetgate.client", "fleetgate.demo"}
    graph = import_graph({m: (s, m in pkgs) for m, s in modules.items()})
    bad = layer_violations(graph)
    assert len(bad) == 1 and bad[0].startswith(module) and wanted in bad[0], bad


def test_the_cli_may_import_every_layer() -> None:
    source = _IN_FUNCTION.format("from fleetgate.coordinator.daemon import run_coordinator")
    graph = import_graph(
        {"fleetgate.cli": (source, False), "fleetgate.coordinator.daemon": ("", False)}
    )
    assert graph["fleetgate.cli"] == {"fleetgate.coordinator.daemon"}
    assert layer_violations(graph) == []


@pytest.mark.parametrize(
    ("sources", "chain"),
    [
        (  # two modules, one import only for typing: still a cycle
            {
                "fleetgate.a": "from fleetgate import b",
                "fleetgate.b": _TC.format("from fleetgate.a import A"),
            },
            "fleetgate.a -> fleetgate.b -> fleetgate.a",
        ),
        (  # three modules around a loop, one import inside a function, one relative
            {
                "fleetgate.x.p": "from .q import Q",
                "fleetgate.x.q": _IN_FUNCTION.format("import fleetgate.x.r"),
                "fleetgate.x.r": "from fleetgate.x import p",
            },
            "fleetgate.x.p -> fleetgate.x.q -> fleetgate.x.r -> fleetgate.x.p",
        ),
    ],
)
def test_a_planted_cycle_is_found(sources: dict[str, str], chain: str) -> None:
    graph = import_graph({m: (s, False) for m, s in sources.items()})
    cycles = strongly_connected(graph)
    assert [cycle_chain(graph, c) for c in cycles] == [chain]


def test_no_cycle_in_a_chain_of_imports() -> None:
    sources = {"fleetgate.a": "import fleetgate.b", "fleetgate.b": "import fleetgate.c"}
    graph = import_graph({m: (s, False) for m, s in {**sources, "fleetgate.c": ""}.items()})
    assert strongly_connected(graph) == []


def test_the_readme_layout_names_every_folder() -> None:
    """The README's layout table names every subpackage of fleetgate/ (a new one is explained)."""
    table = (ROOT / "README.md").read_text().split("## Repository layout", 1)[1]
    folders = [d for d in (ROOT / "fleetgate").iterdir() if (d / "__init__.py").exists()]
    missing = [f"fleetgate/{d.name}/" for d in folders if f"`fleetgate/{d.name}/`" not in table]
    assert not missing, f"the README's 'Repository layout' does not name {missing}"
