"""The leader's reaper: every second, the expired leases and waiters of every registered gate.

A crashed holder is reclaimed even when no client calls. Gates registered but not configured
here are pruned once idle for ``prune_idle_after`` (deleted, dropped from the registry), looked
at every :attr:`Reaper.prune_check_interval`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from fleetgate._redis import REDIS_ERRORS

from .config import Config
from .election import Election
from .errorlog import Faults
from .metrics import CoordinatorMetrics
from .publisher import Publisher

__all__ = ["REAP_INTERVAL", "Reaper"]

log = logging.getLogger("fleetgate.coordinator")

REAP_INTERVAL = 1.0


class Reaper:
    """The sweeps and prunes of one coordinator (they run while it leads)."""

    def __init__(
        self,
        config: Config,
        metrics: CoordinatorMetrics,
        faults: Faults,
        reap_interval: float = REAP_INTERVAL,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.faults = faults
        self.reap_interval = reap_interval
        # Idle gates are looked at every prune_check_interval (a quarter of the idle period, at
        # least every reaper sweep, at most a minute apart).
        idle = config.coordinator.prune_idle_after
        self.prune_check_interval = min(60.0, max(reap_interval, idle / 4))
        self._next_prune = 0.0

    async def run(
        self, election: Election, publisher: Publisher, stopping: Callable[[], bool]
    ) -> None:
        """Sweep every ``reap_interval`` while leading, until ``stopping()``."""
        while not stopping():
            await asyncio.sleep(self.reap_interval)
            if not election.is_leader:
                continue
            errors = self.faults["reaper"]
            try:
                names = await publisher.registered_gates()
                # A non-transactional pipeline runs every gate's sweep even if one fails.
                await publisher.sweep(names)
                self.metrics.reaped_gates.inc(len(names))
                errors.ok()
            except REDIS_ERRORS as exc:
                self.faults.unreachable("reaper", exc)
                continue
            except Exception as exc:
                if errors.error(f"sweep failed: {self.faults.text(exc)}", trace=True):
                    await self.faults.diagnose(exc)
                continue
            errors = self.faults["prune"]
            try:
                await self._prune(election, publisher, names)
            except REDIS_ERRORS as exc:
                self.faults.unreachable("prune", exc)
            except Exception as exc:
                if errors.error(f"failed: {self.faults.text(exc)}", trace=True):
                    await self.faults.diagnose(exc)

    async def _prune(self, election: Election, publisher: Publisher, names: list[str]) -> None:
        """Drop registered gates that are not configured here and idle for prune_idle_after."""
        idle = self.config.coordinator.prune_idle_after
        now = time.monotonic()
        if idle <= 0 or now < self._next_prune:
            return
        self._next_prune = now + self.prune_check_interval
        term = election.term
        configured = {g.name for g in self.config.gates}
        candidates = [n for n in names if n not in configured]
        if term is None or not term.valid() or not candidates:
            return
        pruned, failed = await publisher.prune(term.epoch, candidates, int(idle * 1000))
        errors = self.faults["prune"]
        for name, exc in failed:
            if errors.error(f"gate {name}: idle check failed: {self.faults.text(exc)}"):
                await self.faults.diagnose(exc)
        if not failed:
            errors.ok()
        if pruned:
            self.metrics.pruned_gates.inc(len(pruned))
            shown = ", ".join(pruned[:10]) + (
                f" (+{len(pruned) - 10} more)" if len(pruned) > 10 else ""
            )
            log.info("pruned %d gates idle for %g s: %s", len(pruned), idle, shown)
