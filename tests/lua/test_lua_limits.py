"""The gate scripts keep room under Lua 5.1's compile-time limits, in both forms they load in.

Lua 5.1 refuses a function with more than 200 locals active at once or 60 upvalues, and a
script at the limit fails to load at the next ``local`` a fix adds (the acquire script once used
199 of 200 locals as an EVAL chunk, and ``acquire_body`` 49 of 60 upvalues in the library). Both
forms are counted (tests/lua/_lua_limits.py, the figures printed):

- each gate script as one EVAL chunk (``script_source``: the shared library + the script);
- the Redis Functions library (``gate_library``): its main chunk, where the shared library's
  and every ``<name>_body`` function's locals live, and every function's upvalues.

Each keeps :data:`FREE_LOCALS` locals and :data:`FREE_UPVALUES` upvalues free. The counts are
``lupa.lua51``'s compiler's; :func:`test_the_counts_are_redis_own` checks them against a real
redis-server (the chunk at its counted room loads, one more local does not).
"""

from __future__ import annotations

import uuid

import pytest
import redis

from fleetgate.scripts import SCRIPT_NAMES, gate_library, script_source

from ._lua_limits import MAX_LOCALS, MAX_UPVALUES, compile_error, free_locals, functions
from ._lua_limits import with_locals as _with_locals

FREE_LOCALS = 30
FREE_UPVALUES = 15


def library_chunk() -> str:
    """The library as Redis compiles it: FUNCTION LOAD drops the ``#!lua`` line."""
    shebang, rest = gate_library().source.split("\n", 1)
    assert shebang.startswith("#!lua name=")
    return rest


@pytest.mark.parametrize("name", SCRIPT_NAMES)
def test_each_eval_chunk_keeps_room_for_locals(name: str) -> None:
    free = free_locals(script_source(name))
    print(f"EVAL {name}: main chunk {MAX_LOCALS - free}/{MAX_LOCALS} locals")
    assert free >= FREE_LOCALS, f"EVAL {name}: {free} locals free, want {FREE_LOCALS}"


def test_the_library_main_chunk_keeps_room_for_locals() -> None:
    free = free_locals(library_chunk())
    print(f"library: main chunk {MAX_LOCALS - free}/{MAX_LOCALS} locals")
    assert free >= FREE_LOCALS, f"library: {free} locals free, want {FREE_LOCALS}"


def _upvalues_report(form: str, source: str) -> list[str]:
    fns = sorted(functions(source), key=lambda f: -f.upvalues)
    print(f"{form}: most upvalues " + ", ".join(f"{f.name} {f.upvalues}" for f in fns[:3]))
    return [
        f"{form}: {f.name} (line {f.line}) closes over {f.upvalues}/{MAX_UPVALUES} upvalues"
        for f in fns
        if f.upvalues > MAX_UPVALUES - FREE_UPVALUES
    ]


@pytest.mark.parametrize("name", SCRIPT_NAMES)
def test_every_function_of_each_eval_chunk_keeps_room_for_upvalues(name: str) -> None:
    bad = _upvalues_report(f"EVAL {name}", script_source(name))
    assert not bad, bad


def test_every_function_of_the_library_keeps_room_for_upvalues() -> None:
    bad = _upvalues_report("library", library_chunk())
    assert not bad, bad


# -- the counting itself ------------------------------------------------------------------------


def test_free_locals_and_upvalues_are_counted_exactly() -> None:
    a = "local a, b, c = 1, 2, 3\nlocal function f() return a + b end\nreturn f() + c\n"
    assert free_locals(a) == MAX_LOCALS - 4  # a, b, c, f
    # a loop's locals (3 hidden + i) are active together with the chunk's, inside it only
    loop = "local a = 1\nfor i = 1, 2 do local b = i end\nlocal c = 2\n"
    assert free_locals(loop) == MAX_LOCALS - 6
    fns = {f.name: f.upvalues for f in functions(a)}
    assert fns == {"main": 0, "f": 2}
    nested = (
        "local x, y\nlocal function g()\n  local function h() return x, y end\n  return h\nend\n"
    )
    assert {f.name: f.upvalues for f in functions(nested)} == {"main": 0, "g": 2, "h": 2}


def _upvalue_chunk(k: int) -> str:
    names = [f"u_{j}" for j in range(k)]
    return f"local {', '.join(names)}\nlocal function f()\n  return {', '.join(names)}\nend\n"


def test_the_limits_are_lua_51s() -> None:
    assert compile_error(_with_locals("", MAX_LOCALS)) is None
    assert "local variables" in (compile_error(_with_locals("", MAX_LOCALS + 1)) or "")
    assert [f.upvalues for f in functions(_upvalue_chunk(MAX_UPVALUES)) if f.name == "f"] == [60]
    assert "upvalues" in (compile_error(_upvalue_chunk(MAX_UPVALUES + 1)) or "")


def test_the_counts_are_redis_own(r: redis.Redis) -> None:
    """A real redis-server loads each form with the room counted filled, and refuses one more
    local; it refuses a function of 61 upvalues and loads one of 60."""
    name = "release"
    free = free_locals(script_source(name))
    r.script_load(_with_locals(script_source(name), free))
    with pytest.raises(redis.ResponseError, match="local variables"):
        r.script_load(_with_locals(script_source(name), free + 1))

    lib = gate_library()
    probe = uuid.uuid4().hex[:12]
    shebang, body = lib.source.replace(lib.name[len("fleetgate_") :], probe).split("\n", 1)
    free = free_locals(library_chunk())
    try:
        r.execute_command("FUNCTION LOAD", f"{shebang}\n{_with_locals(body, free)}")
    finally:
        r.execute_command("FUNCTION DELETE", f"fleetgate_{probe}")
    with pytest.raises(redis.ResponseError, match="local variables"):
        r.execute_command("FUNCTION LOAD", f"{shebang}\n{_with_locals(body, free + 1)}")

    r.script_load(_upvalue_chunk(MAX_UPVALUES))
    with pytest.raises(redis.ResponseError, match="upvalues"):
        r.script_load(_upvalue_chunk(MAX_UPVALUES + 1))
