"""The client's mode: one state machine, the only place a fleet's mode changes.

::

    CONNECTING ──answered──> FLEET <──────resumed──────┐
        │                      │                       │
        └───────outage─────────┴──outage──> FALLBACK ──writable──> RECOVERING
                                               ^                       │
                                               └────────outage─────────┘
    any ──close──> CLOSING (final)

* **connecting**: started, Redis has not answered yet; calls are sent to Redis (a wrong URL
  looks like an outage, and the first failed call falls back: :mod:`._contact`).
* **fleet**: calls are granted by Redis.
* **fallback**: Redis cannot serve writes here now (unreachable, or refusing: OOM, READONLY,
  NOREPLICAS, a write pause that outlasts the socket timeout, ...); gates serve under their
  local fair share and a probe waits for a *write* to be answered (:mod:`._fallback`). An
  answered PING is not enough: under ``CLIENT PAUSE ... WRITE`` it answers while every write
  waits, and a pod that took it for Redis being back stopped its local permits for nothing.
* **recovering**: a write was answered; the pod adopts its running work and starts no new local
  permit until fleet mode resumes (every other pod adopts meanwhile).
* **closing**: the fleet closes; final.

``reached`` says whether Redis ever answered this process (first contact, or a probe's write):
it is not a mode, a pod may never have reached Redis and serve under its fallback.
"""

from __future__ import annotations

import enum
import logging
from typing import Literal

__all__ = ["TRANSITIONS", "ClientMode", "Event", "Mode"]

log = logging.getLogger("fleetgate.client")


class Mode(enum.Enum):
    """Where the client's permits come from now."""

    CONNECTING = "connecting"
    FLEET = "fleet"
    FALLBACK = "fallback"
    RECOVERING = "recovering"
    CLOSING = "closing"


Event = Literal["answered", "outage", "writable", "resumed", "close"]

#: (mode, event) -> the next mode; an event not listed for a mode leaves it unchanged (an
#: outage met by a second call while in fallback, a late answer of the first contact, ...).
TRANSITIONS: dict[tuple[Mode, Event], Mode] = {
    (Mode.CONNECTING, "answered"): Mode.FLEET,
    (Mode.CONNECTING, "outage"): Mode.FALLBACK,
    (Mode.FLEET, "outage"): Mode.FALLBACK,
    (Mode.FALLBACK, "writable"): Mode.RECOVERING,
    (Mode.RECOVERING, "outage"): Mode.FALLBACK,
    (Mode.RECOVERING, "resumed"): Mode.FLEET,
    **{(m, "close"): Mode.CLOSING for m in Mode if m is not Mode.CLOSING},
}

_OUTAGE = (Mode.FALLBACK, Mode.RECOVERING)


class ClientMode:
    """The mode of one fleet (:class:`Mode`), changed only by :meth:`fire`."""

    def __init__(self) -> None:
        self.mode = Mode.CONNECTING
        #: the mode the fleet was in when it started closing
        self.closed_from: Mode | None = None
        #: Redis has answered this process at least once
        self.reached = False

    def fire(self, event: Event) -> bool:
        """Apply ``event``; whether the mode changed."""
        if event in ("answered", "writable"):
            self.reached = True
        nxt = TRANSITIONS.get((self.mode, event))
        if nxt is None:
            return False
        log.debug("client mode: %s -> %s (%s)", self.mode.value, nxt.value, event)
        if nxt is Mode.CLOSING:
            self.closed_from = self.mode
        self.mode = nxt
        return True

    @property
    def fallback_active(self) -> bool:
        """Gates serve under their local bound (fallback or recovering; also while closing
        from there)."""
        return self.mode in _OUTAGE or (self.mode is Mode.CLOSING and self.closed_from in _OUTAGE)

    @property
    def recovering(self) -> bool:
        """Running work is being adopted: no new local permit starts."""
        return self.mode is Mode.RECOVERING

    @property
    def closing(self) -> bool:
        return self.mode is Mode.CLOSING

    def __repr__(self) -> str:
        return f"ClientMode({self.mode.value}, reached={self.reached})"
