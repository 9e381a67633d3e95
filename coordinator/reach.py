"""Whether the coordinator reaches Redis, told to the operator for as long as it does not.

Every loop of the coordinator talks to Redis, so a wrong URL or an outage fails all of them at
once. :class:`RedisReach` answers the one question they share -- can this coordinator reach
Redis? -- in one place: the first failure is a WARNING naming the URL (without its password) and
the error, and while Redis stays unreachable a WARNING follows at growing intervals
(:func:`report_delay`: 5, 10, 20, 40 s, then every minute) with how long and how many calls
failed; the first call that reaches Redis again says so at INFO. ``/metrics`` carries it too:
``fleetgate_coordinator_redis_up`` (0 from start-up until Redis first answers, and while it
does not) and ``fleetgate_coordinator_redis_errors_total`` (calls that found it unreachable).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from fleetgate._redis import redact

from .metrics import CoordinatorMetrics

__all__ = ["REPORT_FIRST", "REPORT_MAX", "RedisReach", "report_delay"]

log = logging.getLogger("fleetgate.coordinator")

#: seconds from the first report of an outage to the second; each wait after it doubles ...
REPORT_FIRST = 5.0
#: ... up to this many seconds between two reports of one outage
REPORT_MAX = 60.0


def report_delay(reports: int, first: float = REPORT_FIRST, most: float = REPORT_MAX) -> float:
    """Seconds from the ``reports``-th report of an outage (1 = the first) to the next one."""
    return min(most, first * 2.0 ** max(0, reports - 1))


class RedisReach:
    """Whether the coordinator reaches Redis at ``url``: logged and exported, rate-limited.

    The loops call :meth:`failed` for every call that found Redis unreachable and
    :meth:`reached` for every one that got an answer. ``first`` and ``most`` are the waits of
    :func:`report_delay`; ``clock`` is for tests.
    """

    def __init__(
        self,
        url: str,
        metrics: CoordinatorMetrics | None = None,
        *,
        first: float = REPORT_FIRST,
        most: float = REPORT_MAX,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.shown = redact(url)
        self.metrics = metrics
        self.first, self.most = first, most
        self.clock = clock
        #: Redis answered this coordinator at least once since it started
        self.ever_reached = False
        #: monotonic time the current outage began (None: Redis answers)
        self.down_since: float | None = None
        #: calls that failed in the current outage
        self.failures = 0
        self._reports = 0
        self._next_report = 0.0
        self._started = clock()
        if metrics is not None:
            metrics.redis_up.set(0)

    @property
    def up(self) -> bool:
        """Redis answered the last call (False before the first answer)."""
        return self.ever_reached and self.down_since is None

    def failed(self, where: str, error: str) -> None:
        """A call of loop ``where`` found Redis unreachable (``error``: the scrubbed error)."""
        now = self.clock()
        if self.metrics is not None:
            self.metrics.redis_up.set(0)
            self.metrics.redis_errors.inc()
        if self.down_since is None:
            self.down_since, self.failures, self._reports = now, 0, 0
            self._next_report = now
        self.failures += 1
        if now < self._next_report:
            return
        self._reports += 1
        self._next_report = now + report_delay(self._reports, self.first, self.most)
        if self._reports == 1 and not self.ever_reached:
            log.warning(
                "cannot reach Redis at %s (%s: %s); check the URL ([redis] url, --redis, "
                "FLEETGATE_REDIS_URL); retrying, nothing is published meanwhile",
                self.shown,
                where,
                error,
            )
        elif self._reports == 1:
            log.warning(
                "Redis at %s unreachable (%s: %s); retrying, nothing is published meanwhile "
                "(the targets decay to the floors if this lasts past their lifetime)",
                self.shown,
                where,
                error,
            )
        else:
            log.warning(
                "Redis at %s still unreachable after %.0f s (%d calls failed; last, %s: %s)",
                self.shown,
                now - self.down_since,
                self.failures,
                where,
                error,
            )

    def reached(self) -> None:
        """A call got an answer from Redis."""
        if self.metrics is not None:
            self.metrics.redis_up.set(1)
        if self.down_since is not None:
            now = self.clock()
            if self.ever_reached:
                log.info(
                    "Redis at %s reachable again after %.1f s (%d calls failed)",
                    self.shown,
                    now - self.down_since,
                    self.failures,
                )
            else:
                log.info(
                    "reached Redis at %s, %.1f s after start-up (%d calls failed)",
                    self.shown,
                    now - self._started,
                    self.failures,
                )
            self.down_since = None
            self.failures = 0
        self.ever_reached = True
