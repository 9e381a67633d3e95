"""The shared Lua library's parts (``lua/lib_*.lua``): every file joined once, in the order
``LIB_PARTS`` declares, and each part using only the top-level locals the parts before it define
(a name used before its ``local`` line is a global in Lua: nil when the call runs)."""

from __future__ import annotations

import importlib.resources
import re

from fleetgate.scripts import LIB_PARTS, SCRIPT_NAMES, gate_library, lib_source, script_source

_LUA = importlib.resources.files("fleetgate.lua")
# comments, strings, then names (a name after '.' or ':' is a field, not a variable)
_TOKEN = re.compile(r"--[^\n]*|'(?:\\.|[^'\\\n])*'|\"(?:\\.|[^\"\\\n])*\"|([.:]?)([A-Za-z_]\w*)")
_LOCAL = re.compile(r"^local (?:function (\w+)|([\w, ]+?)\s*(?:=|--|$))", re.M)


def _part(name: str) -> str:
    return _LUA.joinpath(f"{name}.lua").read_text(encoding="utf-8")


def _declared(text: str) -> dict[str, int]:
    """The top-level locals of ``text`` (its ``local`` lines at column 0) -> where declared."""
    where: dict[str, int] = {}
    for m in _LOCAL.finditer(text):
        for name in [m[1]] if m[1] else [n.strip() for n in m[2].split(",")]:
            assert name not in where, f"{name} declared twice"
            where[name] = m.start()
    return where


def test_the_parts_are_every_lib_file_once() -> None:
    files = sorted(p.name[: -len(".lua")] for p in _LUA.iterdir() if p.name.startswith("lib_"))
    assert sorted(LIB_PARTS) == files
    assert len(set(LIB_PARTS)) == len(LIB_PARTS)
    assert lib_source() == "\n".join(_part(p) for p in LIB_PARTS)
    for name in SCRIPT_NAMES:
        assert script_source(name).startswith(lib_source() + "\n")
    assert lib_source().replace("use_gate(KEYS[1])\n", "", 1) in gate_library().source


def test_each_part_uses_only_what_the_parts_before_it_define() -> None:
    lib = lib_source()
    where = _declared(lib)
    assert len(where) > 50  # the parser found the library's locals
    starts, offset = [], 0
    for part in LIB_PARTS:
        starts.append((offset, part))
        offset += len(_part(part)) + 1

    def part_at(pos: int) -> str:
        return max((s, p) for s, p in starts if s <= pos)[1]

    early = [
        f"{part_at(m.start())} uses {m[2]} before its declaration in {part_at(where[m[2]])}"
        for m in _TOKEN.finditer(lib)
        if m[2] and not m[1] and m[2] in where and m.start() < where[m[2]]
    ]
    assert not early, early
