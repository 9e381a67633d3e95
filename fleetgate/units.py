"""The units a gate's leases hold, counted as the scripts count them.

A lease of weight W holds W units of the gate's limit. The scripts keep one member per lease in
``fg:{G}:holders`` and, in field ``extra`` of ``fg:{G}:adm``, the sum of ``W - 1`` over the
holders (``lua/lib_units.lua``, ``units_held``): weight-1 leases never touch the counter. Every path
that adds a lease raises ``extra`` before the ``ZADD`` and every path that removes one lowers it
after the ``ZREM``, so a script stopped half-way can only overcount, and a counter left without
any lease counts nothing.

:func:`units_held` is that rule for a reader that fetched the two values itself (the
coordinator reads them for every gate in one pipeline); :func:`tokens_held` the same for the
tokens the leases hold (field ``tok``, kept by the same rule).
"""

from __future__ import annotations

from typing import Final

__all__ = ["EXTRA_FIELD", "TOKENS_FIELD", "tokens_held", "units_held"]

#: the field of ``fg:{G}:adm`` with the extra weight of the heavy leases
EXTRA_FIELD: Final = "extra"
#: the field of ``fg:{G}:adm`` with the tokens the leases hold (kept by the same rule)
TOKENS_FIELD: Final = "tok"

_EXACT: Final = 2**53  # the scripts count in doubles: exact below it


def units_held(holders: int, extra: object) -> int:
    """Units held by ``holders`` leases (``ZCARD fg:{G}:holders``) with ``extra`` (the raw
    ``adm`` field: bytes, str or None) on top. An ``extra`` that is garbage, negative or beyond
    exact is 0; without leases nothing is held, whatever the counter says."""
    if holders <= 0:
        return 0
    return holders + _extra(extra)


def tokens_held(holders: int, tok: object) -> int:
    """Tokens held by ``holders`` leases, ``tok`` being the raw ``adm`` field: the same rule as
    :func:`units_held` (garbage, negative or beyond exact is 0; no lease holds nothing)."""
    return _extra(tok) if holders > 0 else 0


def _extra(raw: object) -> int:
    if raw is None:
        return 0
    try:
        value = float(raw.decode() if isinstance(raw, bytes) else str(raw))
    except ValueError:
        return 0
    return int(value) if 0 < value < _EXACT else 0
