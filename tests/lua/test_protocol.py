"""fleetgate.protocol: the one home of the scripts' statuses, wake codes and stats fields, and
the Lua generated from it (``lua/lib_proto.lua``, the shared library's first part)."""

from __future__ import annotations

import importlib.resources
import json
import re
from pathlib import Path

import pytest
import redis

import fleetgate.protocol as protocol
from fleetgate import scripts
from fleetgate.protocol import AcquireStatus, PruneState, ResizeStatus, Stat, Wake, lua_source
from fleetgate.scripts import LIB_PARTS, lib_source

_LUA = importlib.resources.files("fleetgate.lua")
_STATUSES = [s for e in (AcquireStatus, ResizeStatus, PruneState) for s in e]


def _constants(cls: type) -> dict[str, str]:
    return {k: v for k, v in vars(cls).items() if k.isupper()}


def test_the_committed_lua_is_what_the_protocol_generates() -> None:
    committed = _LUA.joinpath(protocol.LUA_FILE).read_text(encoding="utf-8")
    assert committed == lua_source(), "stale: run python -m fleetgate.protocol --write"
    assert LIB_PARTS[0] == "lib_proto"


def test_the_command_writes_the_file_and_fails_on_a_stale_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "lib_proto.lua"
    monkeypatch.setattr(protocol, "_lua_path", lambda: target)
    assert protocol.main([]) == 1  # missing
    target.write_text(lua_source().replace("GRANTED = 1", "GRANTED = 9"))
    assert protocol.main([]) == 1  # stale
    assert protocol.main(["--write"]) == 0
    assert target.read_text() == lua_source()
    assert protocol.main([]) == 0
    assert "local ST = {" in capsys.readouterr().out


def test_redis_reads_the_constants_python_names(r: redis.Redis) -> None:
    """The library as Redis runs it holds the same tables as the Python home."""
    out = r.eval(lib_source() + "\nreturn cjson.encode({ST, WAKE, STAT})", 1, "fg:{proto}")
    st, wake, stat = json.loads(out)
    assert st == {s.name: s.value for s in _STATUSES}
    assert wake == _constants(Wake)
    assert stat == _constants(Stat)


def test_the_replies_take_their_statuses_from_the_protocol() -> None:
    for s in _STATUSES:
        assert getattr(scripts, s.name) is s, s.name


def _lua_files() -> dict[str, str]:
    return {
        p.name: p.read_text(encoding="utf-8")
        for p in Path(str(_LUA)).glob("*.lua")
        if p.name != protocol.LUA_FILE
    }


def test_every_name_the_scripts_use_is_defined() -> None:
    """A misspelt ``ST.GRANTD`` is nil in Lua, not an error: every one used must exist."""
    defined = {
        "ST": {s.name for s in _STATUSES},
        "WAKE": set(_constants(Wake)),
        "STAT": set(_constants(Stat)),
    }
    used = {
        (table, name, file)
        for file, text in _lua_files().items()
        for table, name in re.findall(r"\b(ST|WAKE|STAT)\.(\w+)", text)
    }
    assert len({u[0] for u in used}) == 3  # each table is used somewhere
    unknown = sorted(
        f"{file}: {table}.{name}" for table, name, file in used if name not in defined[table]
    )
    assert not unknown, unknown


def test_every_stats_field_the_scripts_write_is_named() -> None:
    fields = {
        field for text in _lua_files().values() for field in re.findall(r"K_STATS, '(\w+)'", text)
    }
    assert fields, "no stats field spelt out found: the pattern is wrong"
    assert fields <= set(_constants(Stat).values()), fields - set(_constants(Stat).values())
