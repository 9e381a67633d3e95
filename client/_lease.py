"""One granted permit: :class:`Lease`, what ``gate.permit()`` yields and ``gate.acquire()`` returns.

A lease knows the :class:`~fleetgate.ask.Ask` it was granted for, its fencing token, whether it
was granted by the fleet or locally (the fair-share fallback), and whether it was lost. It gives
itself back through its gate (:class:`LeaseHolder`: what a lease needs of the gate that granted
it).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Protocol

from fleetgate.admission import validate_tokens
from fleetgate.ask import DEFAULT_ASK, Ask
from fleetgate.errors import LeaseLost, LeaseRevoked

from ._metrics import ClassMetrics, GateMetrics
from ._report import Reporting

__all__ = ["Lease", "LeaseHolder"]


class LeaseHolder(Protocol):
    """What a lease needs of its gate: a name, the metric series, and the two releases."""

    @property
    def name(self) -> str: ...

    @property
    def series(self) -> GateMetrics: ...

    def _release_local(self, lease: Lease) -> None: ...

    def _release_fleet(self, lease: Lease) -> None: ...

    async def _resize_fleet(self, lease: Lease, tokens: int) -> int: ...

    def _resize_local(self, lease: Lease, tokens: int) -> int: ...


class Lease(Reporting):
    """One granted permit. Released by the ``permit()`` context manager or :meth:`release`.

    ``fencing_token`` is monotonic per gate in grant order (a resource that remembers the
    highest it saw can refuse a stale holder; ``token`` is its deprecated name until 0.4);
    ``ask`` what it was asked with, and of it ``weight`` (the units it holds), ``priority`` and
    ``tenant``; ``tokens`` the LLM tokens it holds of the gate's token budget now
    (:meth:`resize` changes it). ``lost`` is set when the lease could not be renewed and Redis
    no longer counts it; ``is_lost`` reads the same from any thread. Leaving a ``permit()``
    block whose lease was lost raises :class:`LeaseLost` (unless the block raised already).
    ``revoked`` is set when the gate asks for the lease back (a higher band waited longer than
    the gate's ``revoke_after``): finish or abandon the work and leave the block; the lease
    holds its units until it is released. ``is_revoked`` reads the same from any thread,
    ``revoked_sync`` is the same as a :class:`threading.Event` (the blocking API hands out these
    leases too); leaving a ``permit()`` block whose lease was revoked raises
    :class:`LeaseRevoked` (unless the block raised already).
    """

    def __init__(
        self,
        gate: LeaseHolder,
        lease_id: str,
        token: int,
        ask: Ask = DEFAULT_ASK,
        *,
        local: bool = False,
        expires_at: int = 0,
    ) -> None:
        self.gate = gate
        self.id = lease_id
        self.fencing_token = token
        self.ask = ask
        self.local = local
        # The metric series it counts in (set when granted; kept, so its release counts there).
        self._series: ClassMetrics | None = None
        # Redis server time (ms) this lease was last seen renewed to (0: not known yet). The
        # heartbeat sends it back, so the gate can tell a lease it lost (restart) from one that
        # expired (see lua/heartbeat.lua).
        self.expires_at = expires_at
        # A plain flag (is_lost reads it from any thread) and the event made on first use: most
        # leases are never asked, and two events cost as much as the rest of the lease.
        self._is_lost = False
        self._lost: asyncio.Event | None = None
        self._is_revoked = False
        self._revoked: asyncio.Event | None = None
        self._revoked_sync: threading.Event | None = None
        self._revoke_hook: Callable[[], None] | None = None
        self._released = False
        self._granted_at = time.monotonic()  # the default latency of report() counts from here
        self._tokens = ask.tokens
        #: the wait (seconds) the gate expected by its measured drain when this call parked
        #: (deadline-aware admission); None when it was granted at once or had no estimate
        self.expected_wait: float | None = None

    @property
    def weight(self) -> int:
        """The units this lease holds against the gate's limit."""
        return self.ask.weight

    @property
    def tokens(self) -> int:
        """The tokens this lease holds of the gate's token budget (0: none)."""
        return self._tokens

    async def resize(self, tokens: int) -> int:
        """Hold ``tokens`` of the gate's token budget from now on; returns the tokens held.

        Shrinking frees the difference to the callers waiting at once. Growing takes only
        tokens nobody waits for: when the budget has room and no caller is parked, the lease
        holds ``tokens``; otherwise nothing changes (no partial growth, no waiting) and the old
        amount is returned. More than the gate's ``token_ceiling`` is a :class:`ConfigError`;
        a released or lost lease raises :class:`LeaseLost`. A lease granted locally while Redis
        was unreachable resizes under the pod's local share of the token budget by the same
        rules (its new amount is counted when Redis is back); a resize that cannot reach Redis
        changes nothing and returns the tokens held.
        """
        validate_tokens(tokens)
        if self._released or self._is_lost:
            raise self.lost_error()
        if tokens == self._tokens:
            return tokens
        if self.local:
            return self.gate._resize_local(self, tokens)
        return await self.gate._resize_fleet(self, tokens)

    def _resized(self, lease_id: str, tokens: int) -> None:
        self.id, self._tokens = lease_id, tokens

    @property
    def priority(self) -> int:
        """The priority band it was granted in."""
        return self.ask.priority

    @property
    def tenant(self) -> str | None:
        """The tenant it was granted for (None: the default tenant)."""
        return self.ask.tenant

    @property
    def lost(self) -> asyncio.Event:
        """An event set when the lease is lost (use it on the fleet's event loop)."""
        event = self._lost
        if event is None:
            # Stored before the flag is read: a _mark_lost in between sets one or the other.
            event = self._lost = asyncio.Event()
            if self._is_lost:
                event.set()
        return event

    def series(self) -> ClassMetrics:
        """The metric series of the lease's class (priority, tenant)."""
        if self._series is None:
            self._series = self.gate.series.of(self)
        return self._series

    @property
    def is_lost(self) -> bool:
        """Whether the lease was lost; safe to read from any thread."""
        return self._is_lost

    def _mark_lost(self) -> None:
        self._is_lost = True
        if self._lost is not None:
            self._lost.set()

    @property
    def revoked(self) -> asyncio.Event:
        """An event set when the gate asks for the lease back (use it on the fleet's event
        loop): give the lease back soon; it holds its units until released."""
        event = self._revoked
        if event is None:
            event = self._revoked = asyncio.Event()
            if self._is_revoked:
                event.set()
        return event

    @property
    def revoked_sync(self) -> threading.Event:
        """:attr:`revoked` as a :class:`threading.Event`, to wait on from any thread."""
        event = self._revoked_sync
        if event is None:
            event = self._revoked_sync = threading.Event()
            if self._is_revoked:
                event.set()
        return event

    @property
    def is_revoked(self) -> bool:
        """Whether the gate asked for the lease back; safe to read from any thread."""
        return self._is_revoked

    def when_revoked(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback`` (on the fleet's event loop, from the heartbeat) when the gate asks
        for this lease back, at once if it did already; None removes it. One callback at a
        time: what a gateway needs to cut the call the lease covers without a task of its own.
        """
        self._revoke_hook = callback
        if callback is not None and self._is_revoked:
            callback()

    def _mark_revoked(self) -> bool:
        """The gate marked this lease revoked; whether that is news."""
        if self._is_revoked:
            return False
        self._is_revoked = True
        if self._revoked is not None:
            self._revoked.set()
        if self._revoked_sync is not None:
            self._revoked_sync.set()
        if self._revoke_hook is not None:
            self._revoke_hook()
        return True

    def revoked_error(self) -> LeaseRevoked:
        """The error for leaving a permit block whose lease was revoked."""
        return LeaseRevoked(
            f"gate {self.gate.name!r}: lease {self.id} (fencing token {self.fencing_token}) "
            "was revoked while its block ran: a call of a higher priority waited longer than "
            "the gate's revoke_after for its units"
        )

    def lost_error(self) -> LeaseLost:
        """The error for leaving a permit block whose lease was lost."""
        return LeaseLost(
            f"gate {self.gate.name!r}: lease {self.id} (fencing token {self.fencing_token}) "
            "was lost while its block ran: it was not renewed in time, so Redis stopped "
            "counting it and the fleet may have run over its limit"
        )

    async def release(self) -> None:
        """Give the permit back (idempotent). Never raises for an unreachable Redis.

        A fleet lease is released without waiting for Redis: the release leaves with this
        process's next script call on the gate (group commit, see ``_batch.py``), ahead of any
        acquire of the gate this process makes after it, so a caller that releases and acquires
        again pays one round trip. :meth:`Fleet.close` waits for releases in flight.
        """
        if self._released:
            return
        self._released = True
        if self.local:
            self.gate._release_local(self)  # synchronous: nothing to cancel, nothing to race
        else:
            self.gate._release_fleet(self)

    @property
    def token(self) -> int:
        """Deprecated (until 0.4): :attr:`fencing_token`."""
        return self.fencing_token

    def __repr__(self) -> str:
        kind = "local" if self.local else "fleet"
        token = self.fencing_token
        return f"Lease(gate={self.gate.name!r}, id={self.id!r}, fencing_token={token}, {kind})"
