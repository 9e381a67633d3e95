"""Headroom between bands: a gate's ``band_share`` -- priority -> the fraction of the limit that
band and every band below it may hold together -- checked, encoded for the scripts, and the rule
they apply (``lua/lib_share.lua``), as pure functions.

With ``band_share={0: 0.7}`` the calls of priority 0 and below hold at most 70 % of the limit
between them; the rest stays free for higher priorities even while none of theirs waits, so an
interactive call arriving behind a batch flood starts at once instead of waiting for a batch
call to end. A band is bound by every entry at or above its priority. A share never holds a band
below one unit (:func:`share_cap`), and a call heavier than its band's share of the ceiling can
never be granted (a :class:`~fleetgate.errors.ConfigError` at arrival). docs/admission.md
"Headroom between bands" says how the scripts count what each band holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from fleetgate.admission import MAX_PRIORITY, MIN_PRIORITY, FrozenMap
from fleetgate.errors import ConfigError

__all__ = ["BandShare", "decode_band_share", "permille", "share_cap", "validate_band_share"]

#: the scripts count shares in thousandths of the limit
PER: Final = 1000


def permille(fraction: float) -> int:
    """``fraction`` of the limit as the scripts hold it: thousandths, rounded to the nearest."""
    return round(fraction * PER)


def share_cap(fraction: float, limit: int) -> int:
    """The units a band share lets its bands hold under ``limit``: ``floor(permille x limit /
    1000)``, never below 1 (a share must not shut a band out at a small limit)."""
    return max(1, permille(fraction) * limit // PER)


class BandShare(FrozenMap[int, float]):
    """A gate's ``band_share``: priority -> fraction of the limit, sorted by priority; ``encoded``
    is ``<RRR>=<permille>,...`` (``RRR`` = 100 - priority as three digits, the scripts' band).
    Construction does not validate: see :func:`validate_band_share`."""

    __slots__ = ()

    @staticmethod
    def encode(items: tuple[tuple[int, float], ...]) -> str:
        # highest priority first, as the scripts read them
        return ",".join(f"{MAX_PRIORITY - p:03d}={permille(f)}" for p, f in reversed(items))


def decode_band_share(text: str) -> dict[int, float]:
    """The inverse of :attr:`BandShare.encoded` (as ``fg:{G}:cfg`` holds it): priority ->
    fraction; parts that do not parse are skipped, as the scripts skip them."""
    out: dict[int, float] = {}
    for part in text.split(","):
        rank, _, per = part.partition("=")
        if len(rank) == 3 and rank.isdigit() and per.isdigit() and 1 <= int(per) <= PER:
            out[MAX_PRIORITY - int(rank)] = int(per) / PER
    return out


def validate_band_share(mapping: object) -> BandShare:
    """Return ``mapping`` (priority in [-100, 100] -> fraction in (0, 1], at least 0.001) as a
    :class:`BandShare`; the error names the entry, e.g. ``band_share[0]: expected a fraction
    in (0, 1], got 1.5``."""
    if not isinstance(mapping, Mapping):
        raise ConfigError(
            f"band_share: expected a mapping of priority -> fraction of the limit, got "
            f"{type(mapping).__name__}"
        )
    for priority, fraction in mapping.items():
        if (
            isinstance(priority, bool)
            or not isinstance(priority, int)
            or not MIN_PRIORITY <= priority <= MAX_PRIORITY
        ):
            raise ConfigError(
                f"band_share[{priority!r}]: a priority is an int in [{MIN_PRIORITY}, "
                f"{MAX_PRIORITY}]"
            )
        ok = isinstance(fraction, (int, float)) and not isinstance(fraction, bool)
        if not ok or not 0 < fraction <= 1 or permille(fraction) < 1:
            raise ConfigError(
                f"band_share[{priority}]: expected a fraction of the limit in (0, 1], at least "
                f"{1 / PER}, got {fraction!r}"
            )
    return mapping if isinstance(mapping, BandShare) else BandShare(mapping)
