"""Leader election by a Redis lease, with a fresh epoch on every win (fencing).

A coordinator wins with ``SET fg:leader <id> NX PX ttl``, then takes ``INCR fg:epoch`` and
confirms it still owns the lease before it publishes anything. The confirmation closes the one
race of the two-step win: a winner that stalled between SET and INCR, lost the lease and then
drew a higher epoch than its successor never publishes with it. So the epochs of confirmed
leaders increase in leadership order, and the gate scripts refuse a lower epoch than the one
stored with a gate's target: a paused old leader that wakes up cannot overwrite its successor.

Renewal runs every ttl/3 through an owner-checked script. A renewal that *errors* (network blip)
keeps leadership while the lease is still valid locally (``valid_until``, measured from the
sending time of the last successful renewal, minus a safety margin for clock drift); a renewal
that finds another owner, or no lease, drops leadership at once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import redis.asyncio as aredis

from fleetgate._redis import REDIS_ERRORS
from fleetgate.keys import fleet_keys
from fleetgate.scripts import LeaderScripts

__all__ = ["Election", "Leadership"]

log = logging.getLogger("fleetgate.coordinator.election")

# Fraction of the TTL a leader stops short of, so that it has stopped publishing before a
# standby (whose clock may run slightly fast) can win.
SAFETY = 0.1


@dataclass(frozen=True)
class Leadership:
    """A confirmed term: publish with ``epoch`` while ``valid()``."""

    epoch: int
    valid_until: float  # time.monotonic()

    def valid(self) -> bool:
        return time.monotonic() < self.valid_until


class Election:
    """Campaign for and hold the leadership lease of one prefix."""

    def __init__(self, client: aredis.Redis, prefix: str, coordinator_id: str, ttl: float) -> None:
        if ttl <= 0:
            raise ValueError("ttl must be > 0")
        self.client = client
        self.keys = fleet_keys(prefix)
        self.id = coordinator_id
        self.ttl = ttl
        self.ttl_ms = int(ttl * 1000)
        self.term: Leadership | None = None
        #: what the last renewal met when it could not reach Redis (None: it got an answer);
        #: :meth:`renew` keeps leadership through such an error while the lease is valid
        self.renew_error: BaseException | None = None
        self._scripts = LeaderScripts(client)

    @property
    def is_leader(self) -> bool:
        return self.term is not None and self.term.valid()

    def _valid_from(self, sent_at: float) -> float:
        return sent_at + self.ttl * (1 - SAFETY)

    async def campaign(self) -> Leadership | None:
        """One attempt to win. Returns the new term, or None if someone else leads."""
        sent = time.monotonic()
        won = await self.client.set(self.keys.leader, self.id, nx=True, px=self.ttl_ms)
        if not won:
            return None
        epoch = int(await self.client.incr(self.keys.epoch))
        if not await self._scripts.renew(self.keys.leader, self.id, self.ttl_ms):
            log.warning("won the lease but lost it before confirming epoch %d", epoch)
            return None
        self.term = Leadership(epoch, self._valid_from(sent))
        log.info("coordinator %s is leader with epoch %d", self.id, epoch)
        return self.term

    async def renew(self) -> bool:
        """Extend the lease. False when leadership is lost (stop publishing at once)."""
        if self.term is None:
            return False
        sent = time.monotonic()
        self.renew_error = None
        try:
            owned = await self._scripts.renew(self.keys.leader, self.id, self.ttl_ms)
        except REDIS_ERRORS as exc:
            self.renew_error = exc
            if self.term.valid():
                log.warning("lease renewal failed (%s); still leader for now", exc)
                return True
            log.warning("lease renewal failed (%s) and the lease ran out: stepping down", exc)
            self.term = None
            return False
        if not owned:
            log.warning(
                "leadership lost (epoch %d): another coordinator owns the lease", self.term.epoch
            )
            self.term = None
            return False
        self.term = Leadership(self.term.epoch, self._valid_from(sent))
        return True

    async def resign(self) -> None:
        """Release the lease at once (clean shutdown) so a standby takes over immediately."""
        if self.term is None:
            return
        self.term = None
        try:
            await self._scripts.release(self.keys.leader, self.id)
            log.info("coordinator %s resigned leadership", self.id)
        except REDIS_ERRORS as exc:
            log.warning("could not release the lease (%s); it lapses by TTL", exc)
