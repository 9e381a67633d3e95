"""The permit one call asks for -- weight, priority, tenant, deadline and tokens -- as one typed
value.

An :class:`Ask` is checked when it is made (the rules of :mod:`fleetgate.admission` for the
weight, priority and tenant, :func:`check_deadline` for the deadline) and immutable after, so
whoever holds one holds a valid request: the caller or the proxy builds it once, and it travels
as it is to the gate's batch, where :attr:`Ask.lane`, :meth:`Ask.lease_id` and
:meth:`Ask.member` give the strings the scripts take (their wire format is defined in
:mod:`fleetgate.admission`).

``deadline`` is in seconds (``None``: none). What it covers is the caller's choice: the queue
wait and the block for ``gate.permit``, the queue wait only for ``gate.acquire``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Final

from fleetgate.admission import (
    lane_class,
    validate_priority,
    validate_tenant,
    validate_tokens,
    validate_weight,
    waiter_member,
    weighted_id,
)
from fleetgate.errors import ConfigError

__all__ = ["DEFAULT_ASK", "DEFAULT_DEADLINE", "Ask", "check_deadline"]

#: seconds a permit may take when the caller names no deadline
DEFAULT_DEADLINE: Final = 30.0


def check_deadline(seconds: object, name: str = "deadline") -> float | None:
    """A deadline argument in seconds, or None for none: ``None`` and ``inf`` mean no deadline;
    NaN, zero, negative numbers and non-numbers are a :class:`ConfigError` naming ``name``."""
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise ConfigError(f"{name}: expected seconds > 0, None or inf, got {seconds!r}")
    if math.isnan(seconds) or seconds <= 0:
        raise ConfigError(f"{name}: expected seconds > 0, None or inf, got {seconds!r}")
    if math.isinf(seconds):
        return None
    return float(seconds)


@dataclass(frozen=True)
class Ask:
    """What one acquire asks for, checked when made (a :class:`ConfigError` names the field).

    ``weight``: units held against the gate's limit (int >= 1); ``priority``: the band, an int in
    [-100, 100], higher first; ``tenant``: a name sharing its band fairly with the others, or
    None for the default tenant; ``deadline``: seconds, or None for none (``inf`` is read as
    None); ``tokens``: what the call holds of the gate's token budget at its peak (prompt +
    output; int >= 0, 0 = none). See README "Priorities, tenants and weights" and "Token
    budgets".
    """

    weight: int = 1
    priority: int = 0
    tenant: str | None = None
    deadline: float | None = DEFAULT_DEADLINE
    tokens: int = 0

    def __post_init__(self) -> None:
        validate_weight(self.weight)
        validate_tokens(self.tokens)
        validate_priority(self.priority)
        validate_tenant(self.tenant)
        object.__setattr__(self, "deadline", check_deadline(self.deadline))

    @classmethod
    def of(
        cls,
        *,
        weight: int = 1,
        priority: int = 0,
        tenant: str | None = None,
        deadline: float | None = DEFAULT_DEADLINE,
        tokens: int = 0,
    ) -> Ask:
        """``Ask(...)``, with the common asks (every field at its default, with the default
        deadline or none) shared rather than made and checked again."""
        plain = type(weight) is type(priority) is type(tokens) is int and (
            weight,
            priority,
            tokens,
        ) == (1, 0, 0)
        if plain and tenant is None:
            if deadline is None:
                return _NO_DEADLINE
            if type(deadline) is float and deadline == DEFAULT_DEADLINE:
                return DEFAULT_ASK
        return cls(weight, priority, tenant, deadline, tokens)

    @functools.cached_property
    def lane(self) -> str:
        """The lane class the scripts take (:func:`fleetgate.admission.lane_class`)."""
        return lane_class(self.priority, self.tenant)

    def lease_id(self, base_id: str) -> str:
        """The lease id that carries this ask's band, weight and tokens
        (:func:`fleetgate.admission.weighted_id`)."""
        return weighted_id(base_id, self.weight, self.tokens, self.priority)

    def member(self, seq: int, lease_id: str) -> str:
        """The waiter member of ``lease_id`` parked under arrival ``seq``
        (:func:`fleetgate.admission.waiter_member`)."""
        return waiter_member(self.priority, self.tenant, seq, lease_id)


#: weight 1, priority 0, the default tenant, the default deadline
DEFAULT_ASK: Final = Ask()
_NO_DEADLINE: Final = Ask(deadline=None)
