"""Whether this process has ever reached Redis: a wrong URL is a configuration error.

A pod whose Redis URL names the wrong host or port looks, from inside, like a pod in an outage:
nothing answers. The fair-share fallback serves it the same way (the bound does not change), but
what it says differs: an outage is a warning when it starts, a process that has never had an
answer from Redis is an ERROR that repeats while it lasts, naming the URL (redacted), and
:attr:`Fleet.reached_redis <fleetgate.client.Fleet.reached_redis>` stays False (the proxy's
``/healthz`` answers 503 then, so an orchestrator does not send it traffic).
"""

from __future__ import annotations

import asyncio
import logging
import math

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential

from fleetgate._redis import error_text, redact

from ._runtime import OUTAGE_ERRORS, Runtime

__all__ = ["FIRST_TRY_S", "NEVER_REACHED_EVERY_S", "FirstContact"]

log = logging.getLogger("fleetgate.client")

#: how long Fleet.start waits for Redis' first answer before it returns (and keeps trying)
FIRST_TRY_S = 1.0
#: while Redis has never answered, the ERROR line is repeated this often (seconds)
NEVER_REACHED_EVERY_S = 30.0
#: what a PING that got no answer raises
_NO_ANSWER: tuple[type[BaseException], ...] = (*OUTAGE_ERRORS, TimeoutError)


class FirstContact:
    """Pings Redis until its first answer, then sets ``runtime.reached_redis`` and ends."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.task: asyncio.Task[None] | None = None
        self._since = 0.0
        self._said_at = -math.inf

    async def start(self) -> None:
        """Wait up to :data:`FIRST_TRY_S` for a PING's answer; if none came, keep trying in
        the background (exponential back-off up to 5 s)."""
        loop = asyncio.get_running_loop()
        self._since = loop.time()
        try:
            await asyncio.wait_for(self.runtime.redis.ping(), FIRST_TRY_S)
        except _NO_ANSWER as exc:
            self._say(exc)
            self.task = asyncio.create_task(self._until_reached(), name="fleetgate-first-contact")
        else:
            self.runtime.reached_redis = True

    async def _until_reached(self) -> None:
        retrying = AsyncRetrying(
            wait=wait_exponential(multiplier=0.25, max=5.0),
            retry=retry_if_exception_type(_NO_ANSWER),
            # redis-py may turn a cancellation into a connection error: closing ends the loop
            stop=lambda _state: self.runtime.closing,
            before_sleep=self._failed,
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    await asyncio.wait_for(self.runtime.redis.ping(), 5.0)
        except _NO_ANSWER:
            return  # the fleet is closing
        self.runtime.reached_redis = True
        log.info("Redis at %s answered: reached for the first time", redact(self.runtime.url))

    def _failed(self, state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        if exc is not None:
            self._say(exc)

    def _say(self, exc: BaseException) -> None:
        now = asyncio.get_running_loop().time()
        if now - self._said_at < NEVER_REACHED_EVERY_S:
            return
        self._said_at = now
        log.error(
            "Redis at %s has not answered since this process started %.0f s ago (%s): a wrong "
            "URL, host or port looks like this, or Redis is not up yet; calls run under the "
            "local fair-share bound meanwhile",
            redact(self.runtime.url),
            now - self._since,
            error_text(exc),
        )
