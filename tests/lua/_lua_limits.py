"""Counting what the gate scripts use of Lua 5.1's compile-time limits, as Redis embeds it.

Lua 5.1 (Redis' Lua, and ``lupa.lua51``: the same compiler, the same limits) refuses to compile
a function with more than :data:`MAX_LOCALS` locals active at once or more than
:data:`MAX_UPVALUES` upvalues. A script near either limit fails to load at the next local a fix
adds, so the tests keep room under both (tests/lua/test_lua_limits.py):

- :func:`free_locals`: how many more locals the main chunk could hold, found by compiling the
  chunk with ``k`` unused locals declared on its first line (active through the whole chunk, so
  the chunk compiles iff its busiest point holds ``200 - k`` or fewer), ``k`` bisected;
- :func:`functions`: every function of a chunk with the upvalues it closes over, read from the
  compiled chunk (``string.dump``; the count in each function's header is the compiler's own).
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from typing import Any

import lupa.lua51

MAX_LOCALS = 200  # LUAI_MAXVARS
MAX_UPVALUES = 60  # LUAI_MAXUPVALUES

_LUA = lupa.lua51.LuaRuntime(encoding=None)
# (bytecode, nil) or (nil, the compiler's message)
_DUMP: Any = _LUA.eval(
    "function(src) local f, err = loadstring(src, '=chunk') "
    "if f == nil then return nil, err end return string.dump(f), nil end"
)
_NAMED = re.compile(
    r"(?:local\s+function\s+([\w.:]+)|function\s+([\w.:]+)|([\w.\[\]']+)\s*=\s*function\b)"
)


@dataclass(frozen=True)
class Function:
    """One function of a chunk: its name (from its first line), that line, its upvalues."""

    name: str
    line: int
    upvalues: int


def compile_error(source: str) -> str | None:
    """The compiler's message for ``source``, or None when it compiles."""
    code, err = _DUMP(source.encode())
    return None if code is not None else bytes(err).decode()


def dump(source: str) -> bytes:
    """The compiled chunk (Lua 5.1 bytecode, this platform's sizes)."""
    code, err = _DUMP(source.encode())
    if code is None:
        raise SyntaxError(bytes(err).decode())
    return bytes(code)


def with_locals(source: str, k: int) -> str:
    """``source`` with ``k`` unused locals declared on a line of their own before it."""
    if k == 0:
        return source
    return "local " + ", ".join(f"x_{j}" for j in range(k)) + "\n" + source


def free_locals(source: str) -> int:
    """How many more locals the main chunk of ``source`` could hold at its busiest point."""
    if compile_error(source) is not None:
        raise SyntaxError(compile_error(source))
    lo, hi = 0, MAX_LOCALS  # with lo it compiles; with hi + 1 it does not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if compile_error(with_locals(source, mid)) is None:
            lo = mid
        else:
            hi = mid - 1
    return lo


class _Reader:
    """Lua 5.1's dump format (lundump.c), for a chunk dumped on this machine."""

    def __init__(self, code: bytes) -> None:
        if code[:5] != b"\x1bLua\x51":
            raise ValueError("not a Lua 5.1 chunk")
        self.code = code
        self.int_size, self.size_t = code[7], code[8]
        self.pos = 12  # the header

    def take(self, n: int) -> bytes:
        out = self.code[self.pos : self.pos + n]
        self.pos += n
        return out

    def int(self) -> int:
        return int(struct.unpack("<i", self.take(self.int_size))[0])

    def string(self) -> bytes:
        n = int.from_bytes(self.take(self.size_t), "little")
        return self.take(n)

    def function(self, out: list[tuple[int, int]]) -> None:
        self.string()  # source name
        line = self.int()
        self.int()  # last line
        nups = self.take(4)[0]  # nups, numparams, is_vararg, maxstacksize
        self.take(4 * self.int())  # code
        for _ in range(self.int()):  # constants
            kind = self.take(1)[0]
            if kind == 1:
                self.take(1)
            elif kind == 3:
                self.take(8)
            elif kind == 4:
                self.string()
        for _ in range(self.int()):  # nested functions
            self.function(out)
        self.take(4 * self.int())  # line info
        for _ in range(self.int()):  # locals: name, startpc, endpc
            self.string()
            self.int()
            self.int()
        for _ in range(self.int()):  # upvalue names
            self.string()
        out.append((line, nups))


def functions(source: str) -> list[Function]:
    """Every function of ``source`` (the main chunk as ``main``) with its upvalues."""
    found: list[tuple[int, int]] = []
    _Reader(dump(source)).function(found)
    lines = source.splitlines()
    out = []
    for line, nups in found:
        if line == 0:
            name = "main"
        else:
            m = _NAMED.search(lines[line - 1])
            name = next(g for g in m.groups() if g) if m else f"function at line {line}"
        out.append(Function(name, line, nups))
    return out
