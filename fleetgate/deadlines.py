"""The settings of admission that knows time, as the scripts take them: ``deadline_admission``
(refuse at once what cannot start -- or end -- before its deadline; docs/admission.md
"Deadline-aware admission") and ``revoke_after`` (ask lower bands for units back once a higher
band's head has waited that long; "Revocation"). Their types, bounds, checks and encodings;
:mod:`fleetgate.settings` holds them in a gate's settings.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

from msgspec import Meta

from fleetgate.errors import ConfigError

__all__ = [
    "MAX_REVOKE_AFTER",
    "MIN_REVOKE_AFTER",
    "DeadlineAdmission",
    "RevokeAfter",
    "admission_code",
    "check_deadline_admission",
    "check_revoke_after",
    "revoke_ms",
]

#: Bounds of ``revoke_after`` (seconds): below a heartbeat's reach it means "at once", above an
#: hour it is no plan.
MIN_REVOKE_AFTER: Final = 0.1
MAX_REVOKE_AFTER: Final = 3600.0
RevokeAfter = Annotated[
    float,
    Meta(
        ge=MIN_REVOKE_AFTER,
        le=MAX_REVOKE_AFTER,
        description="seconds a higher band's head waits before lower bands are asked to give back",
    ),
]


#: ``deadline_admission``: True or ``"start"`` (the deadline must cover the expected wait),
#: ``"finish"`` (the wait and the band's mean hold), False (off).
DeadlineAdmission = bool | Literal["start", "finish"]


def admission_code(value: DeadlineAdmission) -> int:
    """``deadline_admission`` as the scripts take it: 0 off, 1 start, 2 finish."""
    return 2 if value == "finish" else 1 if value is True or value == "start" else 0


def check_deadline_admission(value: object) -> None:
    """Raise a :class:`ConfigError` naming the field unless ``value`` is a bool, ``"start"``
    or ``"finish"``."""
    if not isinstance(value, bool) and value not in ("start", "finish"):
        raise ConfigError(
            f'deadline_admission: expected true, false, "start" or "finish", got {value!r}'
        )


def revoke_ms(seconds: float | None) -> int | str:
    """``revoke_after`` as the scripts take it: ms, ``''`` for None."""
    return "" if seconds is None else max(1, round(seconds * 1000))


def check_revoke_after(value: object) -> None:
    """Raise a :class:`ConfigError` naming the field unless ``value`` is None or seconds in
    [MIN_REVOKE_AFTER, MAX_REVOKE_AFTER]."""
    if value is None:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not MIN_REVOKE_AFTER <= value <= MAX_REVOKE_AFTER
    ):
        raise ConfigError(
            f"revoke_after: expected None or seconds in [{MIN_REVOKE_AFTER}, "
            f"{MAX_REVOKE_AFTER:.0f}], got {value!r}"
        )
