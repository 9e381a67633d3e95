"""How the coordinator's loops report what went wrong without flooding the log.

Bad state in Redis never stops the daemon: every loop catches and logs. :class:`ErrorLog` logs
each distinct error of a loop once, then at most once a minute with a count of the repeats, and
says when the loop recovers. :class:`Faults` holds one per loop, turns an exception into one
line without the Redis password, and after a ``WRONGTYPE`` error names the keys of the wrong
type (:mod:`fleetgate.safety`). Redis being unreachable is not a loop's error but the whole
coordinator's: every loop reports it to the one :class:`~.reach.RedisReach`
(:meth:`Faults.unreachable`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fleetgate._redis import scrub
from fleetgate.safety import find_bad_keys, is_wrongtype

from .config import Config
from .metrics import CoordinatorMetrics
from .reach import RedisReach

__all__ = ["ERROR_LOG_INTERVAL", "LOOPS", "ErrorLog", "Faults"]

log = logging.getLogger("fleetgate.coordinator")

# The same error of one loop is logged at most this often (with a count of the repeats).
ERROR_LOG_INTERVAL = 60.0
#: the loops (and checks) whose errors are logged apart
LOOPS = ("election", "poll", "reaper", "prune", "diagnosis")


class ErrorLog:
    """Log each distinct error of a loop once, then at most every ``interval`` seconds, and say
    when the loop recovers: a broken key must not turn into a line per second."""

    def __init__(self, where: str, interval: float = ERROR_LOG_INTERVAL) -> None:
        self.where = where
        self.interval = interval
        self._last: dict[str, float] = {}
        self._repeats: dict[str, int] = {}

    def error(self, message: str, *, level: int = logging.ERROR, trace: bool = False) -> bool:
        """Log ``message`` unless it was logged less than ``interval`` ago; True if logged."""
        now = time.monotonic()
        last = self._last.get(message)
        if last is not None and now - last < self.interval:
            self._repeats[message] = self._repeats.get(message, 0) + 1
            return False
        repeats = self._repeats.pop(message, 0)
        more = f" (repeated {repeats} times since last logged)" if repeats else ""
        log.log(level, "%s: %s%s", self.where, message, more, exc_info=trace)
        if len(self._last) >= 256:  # messages that never repeat must not pile up
            self._last.clear()
        self._last[message] = now
        return True

    def ok(self) -> None:
        """The loop succeeded: forget past errors (and say so if there were any)."""
        if self._last:
            log.info("%s: recovered", self.where)
            self._last.clear()
            self._repeats.clear()


class Faults:
    """The error logs of one coordinator's loops (:data:`LOOPS`), and what they need to say."""

    def __init__(self, config: Config, metrics: CoordinatorMetrics | None = None) -> None:
        self.config = config
        self.logs = {name: ErrorLog(name) for name in LOOPS}
        #: whether Redis answers (every loop reports to it: one account of an outage)
        self.redis = RedisReach(config.redis.url, metrics)
        #: the Redis client, once the coordinator runs (the diagnosis reads the keys with it)
        self.client: Any = None

    def __getitem__(self, loop: str) -> ErrorLog:
        return self.logs[loop]

    def text(self, exc: BaseException) -> str:
        """``exc`` as one line for a log, never with the Redis password."""
        return scrub(f"{type(exc).__name__}: {exc}", self.config.redis.url)

    def unreachable(self, where: str, exc: BaseException) -> None:
        """A call of loop ``where`` found Redis unreachable (:attr:`redis` tells, rate-limited)."""
        self.redis.failed(where, self.text(exc))

    async def diagnose(self, exc: BaseException) -> None:
        """After a WRONGTYPE error, name the offending keys in the log."""
        if not is_wrongtype(exc):
            return
        try:
            findings = await find_bad_keys(
                self.client, self.config.redis.prefix, [g.name for g in self.config.gates]
            )
        except Exception as diag:
            self["diagnosis"].error(f"could not find the bad key: {self.text(diag)}")
            return
        for finding in findings:
            self["diagnosis"].error(finding.message)
