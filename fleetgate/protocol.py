"""The constants the gate scripts and their callers share, named once, and their Lua.

The scripts' statuses, the wake grammar and the gate's stats fields are defined here; the Lua
that names them (``lua/lib_proto.lua``, the first part of the shared library: tables ``ST``,
``WAKE`` and ``STAT``) is generated from this module, so the two sides cannot drift:

    python -m fleetgate.protocol --write    # rewrite lua/lib_proto.lua
    python -m fleetgate.protocol            # print it; exit 1 when the file differs

(tests/core/test_protocol.py fails when the committed file is not what this module generates.)
"""

from __future__ import annotations

import argparse
import enum
import importlib.resources
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Final, NamedTuple

__all__ = [
    "GRANTED_WAKE",
    "LUA_FILE",
    "AcquireStatus",
    "PruneState",
    "ResizeStatus",
    "Stat",
    "Wake",
    "WakeNews",
    "decode_wake",
    "lua_source",
]


class AcquireStatus(enum.IntEnum):
    """``acquire.lua``'s status of one request (its header says what comes with each)."""

    REJECTED = 0  # the wait list is full (n: max_queued)
    GRANTED = 1
    PARKED = 2
    REJECTED_TENANT = 3  # the tenant's waiters reached max_queued_per_tenant
    SHED = 4  # below shed_below and not grantable at once
    TOO_HEAVY = 5  # heavier than the ceiling: never grantable
    TOO_MANY_TOKENS = 6  # more tokens than the token ceiling: never grantable
    TOO_LATE = 7  # by the drain of its band it would start (or end) past its deadline
    OVER_SHARE = 8  # heavier than its band's share of the ceiling: never grantable


class ResizeStatus(enum.IntEnum):
    """``resize.lua``'s status."""

    RESIZED = 1
    RESIZE_REFUSED = 0  # growth that does not fit now
    RESIZE_LOST = -1  # no such lease
    RESIZE_TOO_MANY = -2  # more tokens than the token ceiling


class PruneState(enum.IntEnum):
    """``prune.lua``'s state of a gate."""

    PRUNED = 1
    IDLE = 2
    IN_USE = 0
    PRUNE_REFUSED = -1  # a newer epoch owns the gate


class Wake:
    """The wake grammar: a wake is ``'<id>=<value>'``; a grant's value is its fencing token,
    every other value starts with one of these codes (then the bound that refused it)."""

    EVICTED: Final = "x"  # evicted by a higher band (Overloaded)
    TOO_HEAVY: Final = "c"  # then the ceiling C now in force (ConfigError)
    TOO_MANY_TOKENS: Final = "k"  # then the token ceiling K
    OVER_SHARE: Final = "s"  # then its band's share S of the ceiling


class WakeNews(NamedTuple):
    """A wake, decoded: what happened to the waiter ``lease_id``. ``kind`` is ``"granted"``
    (``value``: its fencing token), :attr:`Wake.EVICTED` (``value`` 0) or one of the refusal
    codes :attr:`Wake.TOO_HEAVY`, :attr:`Wake.TOO_MANY_TOKENS`, :attr:`Wake.OVER_SHARE`
    (``value``: the bound that refused it)."""

    lease_id: str
    kind: str
    value: int


GRANTED_WAKE: Final = "granted"
_REFUSAL_CODES: Final = (Wake.TOO_HEAVY, Wake.TOO_MANY_TOKENS, Wake.OVER_SHARE)


def decode_wake(wake: str) -> WakeNews | None:
    """The wake ``'<id>=<value>'`` (the grammar of :class:`Wake`) decoded; None for a value
    the grammar has no word for (a newer script's: ignored, the heartbeat tells the rest)."""
    lease_id, _, value = wake.rpartition("=")
    if not lease_id:
        return None
    if value == Wake.EVICTED:
        return WakeNews(lease_id, Wake.EVICTED, 0)
    if value[:1] in _REFUSAL_CODES and value[1:].isdigit():
        return WakeNews(lease_id, value[0], int(value[1:]))
    if value.isdigit():
        return WakeNews(lease_id, GRANTED_WAKE, int(value))
    return None


class Stat:
    """The fields of a gate's stats hash (``fg:{G}:stats``): fleet-wide counters."""

    GRANTED: Final = "granted"
    PARKED: Final = "parked"
    REJECTED: Final = "rejected"  # every refusal of an arrival
    REJECTED_TENANT: Final = "rejected_tenant"
    SHED: Final = "shed"
    TOO_HEAVY: Final = "too_heavy"  # ceiling, token ceiling or band share (arrivals and waiters)
    TOO_LATE: Final = "too_late"
    EVICTED: Final = "evicted"
    RELEASED: Final = "released"
    CANCELLED: Final = "cancelled"
    HANDED_OFF: Final = "handed_off"
    EXPIRED_LEASES: Final = "expired_leases"
    ABANDONED_WAITERS: Final = "abandoned_waiters"
    ADOPTED: Final = "adopted"
    RESIZED: Final = "resized"
    REVOKED: Final = "revoked"


def _constants(cls: type) -> list[tuple[str, str]]:
    return [(k, v) for k, v in vars(cls).items() if k.isupper() and isinstance(v, str)]


def _lua_table(name: str, items: Iterable[tuple[str, int | str]]) -> str:
    def lua(v: int | str) -> str:
        return f"'{v}'" if isinstance(v, str) else str(int(v))

    fields = [f"{k} = {lua(v)}" for k, v in items]
    lines, line = [], f"local {name} = {{"
    for j, field in enumerate(fields):
        piece = field + ("," if j < len(fields) - 1 else "}")
        if len(line) + 1 + len(piece) > 99:
            lines.append(line)
            line = "  " + piece
        else:
            line = f"{line}{'' if line.endswith('{') else ' '}{piece}"
    return "\n".join([*lines, line])


_HEADER = """\
-- Generated by `python -m fleetgate.protocol --write` from fleetgate/protocol.py: do not edit.
-- Shared library (lib_*.lua, see lib_gate.lua): the constants the scripts share with their
-- callers, one table each (one local of the chunk's 200). ST: the scripts' statuses (acquire,
-- resize, prune); WAKE: the code after '<id>=' of a wake that is no grant; STAT: the fields of
-- the gate's stats hash (fg:{G}:stats)."""


def lua_source() -> str:
    """``lua/lib_proto.lua`` as this module generates it."""
    statuses = [(s.name, s.value) for e in (AcquireStatus, ResizeStatus, PruneState) for s in e]
    return "\n".join(
        [
            _HEADER,
            _lua_table("ST", statuses),
            _lua_table("WAKE", _constants(Wake)),
            _lua_table("STAT", _constants(Stat)),
            "",
        ]
    )


#: The generated file (in the ``fleetgate.lua`` package).
LUA_FILE: Final = "lib_proto.lua"


def _lua_path() -> Path:
    return Path(str(importlib.resources.files("fleetgate.lua").joinpath(LUA_FILE)))


def main(argv: Sequence[str] | None = None) -> int:
    """Print the generated Lua (exit 1 when the committed file differs), or ``--write`` it."""
    parser = argparse.ArgumentParser(
        prog="python -m fleetgate.protocol",
        description="Generate lua/lib_proto.lua (the protocol's constants in Lua) from "
        "fleetgate/protocol.py.",
    )
    parser.add_argument("--write", action="store_true", help="rewrite lua/lib_proto.lua")
    args = parser.parse_args(argv)
    path, text = _lua_path(), lua_source()
    if args.write:
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path}")
        return 0
    sys.stdout.write(text)
    return 0 if path.exists() and path.read_text(encoding="utf-8") == text else 1


if __name__ == "__main__":
    sys.exit(main())
