"""The simulated vLLM engine: FIFO admission under ``capacity`` (vLLM's ``max_num_seqs``), a
sampled service time, the counters of ``/admin/stats`` and the flavour's metrics.

A request admitted to a slot holds it for ``prefill_ms`` (the prefill, which yields the first
token) and then for the sampled service time (the decode of the other tokens, at an even rate).
A streamed request is the same request with its tokens handed out as they are made: the first
after the queue and the prefill, the last when the service time is over."""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fleetgate.tools.sim._server import FifoLimiter, QueueFull
from fleetgate.tools.sim._vllm_config import LOGNORMAL_SIGMA, VllmSimConfig
from fleetgate.tools.sim._vllm_metrics import VllmMetrics
from fleetgate.tools.sim.flavors import make_exposition

__all__ = ["Overloaded", "VllmSim"]


class Overloaded(Exception):
    """TGI/TEI's concurrency limit is reached: the request is refused with 429."""


class VllmSim:
    """The simulated engine: FIFO admission under ``capacity``, service time, counters."""

    def __init__(self, config: VllmSimConfig) -> None:
        """Build the engine state for ``config`` (no event loop needed yet)."""
        self.config = config
        self.limiter = FifoLimiter(config.capacity, config.max_waiting)
        self.metrics = (
            VllmMetrics(config)
            if config.flavor == "vllm"
            else make_exposition(config.flavor, config.model, config.engines, config.capacity)
        )
        self.rng = random.Random(config.seed)
        self.served = 0
        self.rejected = 0
        self.aborted = 0
        self.created = int(time.time())
        self._next_engine = 0

    def service_seconds(self) -> float:
        """Sample one service time, stretched by batch occupancy if configured."""
        mean = self.config.service_ms / 1000.0
        if mean <= 0:
            return 0.0
        if self.config.service_dist == "exp":
            base = self.rng.expovariate(1.0 / mean)
        elif self.config.service_dist == "lognormal":
            mu = math.log(mean) - LOGNORMAL_SIGMA**2 / 2  # keeps the mean at service_ms
            base = self.rng.lognormvariate(mu, LOGNORMAL_SIGMA)
        else:
            base = mean
        occupancy = self.limiter.running / max(self.limiter.capacity, 1)
        return base * (1.0 + self.config.occupancy_slowdown * occupancy)

    async def execute(self, prompt_tokens: int, gen_tokens: int, reason: str) -> None:
        """Wait for a slot (FIFO), hold it for the prefill and a service time, record the outcome.

        Raises :class:`QueueFull` when the waiting cap is exceeded (the caller answers 503) and
        :class:`Overloaded` when TGI/TEI's concurrency limit is reached (the caller answers 429).
        """
        async with self._slot(prompt_tokens, gen_tokens, reason) as service_s:
            await asyncio.sleep(self.config.prefill_ms / 1000.0 + service_s)

    async def stream(
        self, prompt_tokens: int, gen_tokens: int, reason: str, pieces: int
    ) -> AsyncGenerator[int, None]:
        """:meth:`execute`, yielding ``0 .. pieces - 1`` as the reply's pieces are made.

        The ``gen_tokens`` tokens are spread over ``pieces`` pieces (a piece is one token, or a
        few when the reply text is shorter). Token 1 comes when the prefill is over, the last
        when the service time is over too; the slot is held until then. Closing the iterator
        early (the caller gone) aborts the request and frees its slot.
        """
        loop = asyncio.get_running_loop()
        async with self._slot(prompt_tokens, gen_tokens, reason) as service_s:
            first = loop.time() + self.config.prefill_ms / 1000.0
            interval = service_s / max(gen_tokens - 1, 1)
            for i in range(pieces):
                token = -(-(i + 1) * gen_tokens // pieces)  # the piece's last token, 1-based
                await asyncio.sleep(max(0.0, first + (token - 1) * interval - loop.time()))
                yield i
            await asyncio.sleep(max(0.0, first + service_s - loop.time()))

    @contextlib.asynccontextmanager
    async def _slot(self, prompt_tokens: int, gen_tokens: int, reason: str) -> AsyncIterator[float]:
        """Hold a slot (FIFO) while the body runs; gives the request's sampled service time.

        Counts the request as served, rejected or aborted (cancelled or closed early).
        """
        self.metrics.arrived()
        limit = self.config.concurrency_limit
        if limit is not None and self.limiter.in_flight >= limit:
            self.rejected += 1
            self.metrics.rejected()
            raise Overloaded(f"{limit} requests already in flight")
        engine = self._next_engine
        self._next_engine = (engine + 1) % self.config.engines
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        admitted = None
        try:
            await self.limiter.acquire()
            admitted = loop.time()
            yield self.service_seconds()
        except QueueFull:
            self.rejected += 1
            raise
        except (asyncio.CancelledError, GeneratorExit):  # the client went away (or a stop)
            self.aborted += 1
            self.metrics.aborted(engine)
            raise
        finally:
            if admitted is not None:
                self.limiter.release()
        self.served += 1
        assert admitted is not None
        self.metrics.finished(
            engine, prompt_tokens, gen_tokens, reason, loop.time() - arrived, admitted - arrived
        )

    def stats(self) -> dict[str, Any]:
        """The ``/admin/stats`` body."""
        lim = self.limiter
        return {
            "model": self.config.model,
            "flavor": self.config.flavor,
            "capacity": lim.capacity,
            "engines": self.config.engines,
            "running": lim.running,
            "waiting": lim.waiting,
            "in_flight": lim.in_flight,
            "peak_running": lim.peak_running,
            "peak_in_flight": lim.peak_in_flight,
            "served": self.served,
            "rejected": self.rejected,
            "aborted": self.aborted,
            "max_waiting": lim.max_waiting,
        }
