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
from fleetgate.tools.sim._vllm_kv import KvScheduler
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
        #: with ``kv_tokens``: the KV-limited scheduler that admits instead of ``limiter``
        self.kv = (
            None
            if config.kv_tokens is None
            else KvScheduler(
                config.capacity,
                config.kv_tokens,
                config.block_size,
                config.max_waiting,
                config.prefill_ms_per_token,
            )
        )
        self._preempted = 0  # preemptions already counted in the metrics
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

    def service_seconds(self, gen_tokens: int = 0) -> float:
        """Sample one service time (``ms_per_token`` x ``gen_tokens`` when configured),
        stretched by batch occupancy if configured."""
        mean = self.config.service_ms / 1000.0
        if self.config.ms_per_token is not None:
            mean = self.config.ms_per_token * gen_tokens / 1000.0
        if mean <= 0:
            return 0.0
        if self.config.service_dist == "exp":
            base = self.rng.expovariate(1.0 / mean)
        elif self.config.service_dist == "lognormal":
            mu = math.log(mean) - LOGNORMAL_SIGMA**2 / 2  # keeps the mean at service_ms
            base = self.rng.lognormvariate(mu, LOGNORMAL_SIGMA)
        else:
            base = mean
        lim = self.kv or self.limiter
        occupancy = lim.running / max(lim.capacity, 1)
        return base * (1.0 + self.config.occupancy_slowdown * occupancy)

    async def execute(self, prompt_tokens: int, gen_tokens: int, reason: str) -> None:
        """Wait for a slot (FIFO), hold it for the prefill and a service time, record the outcome.

        Raises :class:`QueueFull` when the waiting cap is exceeded (the caller answers 503) and
        :class:`Overloaded` when TGI/TEI's concurrency limit is reached (the caller answers 429).
        """
        if self.kv is not None:
            await self._execute_kv(self.kv, prompt_tokens, gen_tokens, reason)
            return
        async with self._slot(prompt_tokens, gen_tokens, reason) as service_s:
            await asyncio.sleep(self.config.prefill_ms / 1000.0 + service_s)

    async def _execute_kv(self, kv: KvScheduler, prompt: int, gen: int, reason: str) -> None:
        """:meth:`execute` under the KV cache (``kv_tokens``): admitted while the prompt's
        blocks fit, preempted (and run anew) when decoding runs out of blocks. A sequence
        larger than the whole cache is refused (ValueError: the caller answers 400)."""
        if not kv.fits_ever(prompt, gen):
            raise ValueError(
                f"{prompt + gen} tokens are more than the KV cache holds ({kv.total_blocks} "
                f"blocks of {kv.block_size})"
            )
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        try:
            await kv.run(prompt, gen, self.service_seconds(gen))
        except QueueFull:
            self.rejected += 1
            raise
        except asyncio.CancelledError:
            self.aborted += 1
            self.metrics.aborted(0)
            raise
        finally:
            self._count_preemptions(kv)
        self.served += 1
        self.metrics.finished(0, prompt, gen, reason, loop.time() - arrived, 0.0)

    def _count_preemptions(self, kv: KvScheduler) -> None:
        if isinstance(self.metrics, VllmMetrics) and kv.preemptions > self._preempted:
            self.metrics.preempted(0, kv.preemptions - self._preempted)
            self._preempted = kv.preemptions

    def render_metrics(self) -> bytes:
        """The flavour's metrics text, from the KV scheduler's counts when there is one."""
        if self.kv is not None and isinstance(self.metrics, VllmMetrics):
            self._count_preemptions(self.kv)
            return self.metrics.render(self.kv, kv=self.kv)
        return self.metrics.render(self.limiter)

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
        if self.kv is not None:  # under the KV cache the pieces come when the sequence is done
            await self._execute_kv(self.kv, prompt_tokens, gen_tokens, reason)
            for i in range(pieces):
                yield i
            return
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
            yield self.service_seconds(gen_tokens)
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
        """The ``/admin/stats`` body (with ``kv_tokens``: the blocks and preemptions too)."""
        lim = self.kv or self.limiter
        kv: dict[str, int] = {}
        if self.kv is not None:
            kv = {
                "kv_blocks": self.kv.total_blocks,
                "kv_blocks_used": self.kv.used_blocks,
                "kv_peak_blocks": self.kv.peak_blocks,
                "block_size": self.kv.block_size,
                "preemptions": self.kv.preemptions,
            }
        return {
            **kv,
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
