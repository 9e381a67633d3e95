"""A KV-cache-limited scheduler for the simulated vLLM engine (``--kv-tokens``).

vLLM admits a waiting sequence when a slot is free (``max_num_seqs``) and the KV blocks of its
prompt fit; a running sequence needs one more block each time its tokens cross a block
boundary while it decodes. When no block is free, vLLM preempts the newest running sequence:
its blocks are freed, it goes back to the front of the waiting queue, and when it runs again
its KV is computed anew from its prompt and the tokens it had generated (recompute
preemption: a prefill of all of them), then it goes on decoding. That is what this models,
FIFO and in whole blocks (``ceil(tokens / block_size)``).

A sequence's prefill takes ``prefill_ms_per_token`` per token it holds when admitted, and the
whole batch decodes nothing meanwhile (as a step that prefills without chunking): prefills
queue behind each other and every running sequence's next token moves by as much, so a
recompute after a preemption costs the server, not only the sequence. Then the sequence
decodes its output tokens evenly over its service time. The scheduler has the
attributes of :class:`~fleetgate.tools.sim._server.FifoLimiter` that the engine's counters
and metrics read (running, waiting, in flight, peaks), plus the blocks in use and the
preemptions.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from fleetgate.tools.sim._server import QueueFull

__all__ = ["KvScheduler"]


@dataclass(eq=False)
class _Seq:
    prompt: int
    gen: int
    order: int = 0  # admission order (the newest running one is preempted first)
    done: int = 0  # output tokens generated (kept through a preemption: recomputed)
    blocks: int = 0
    preempted: bool = False
    kicked: asyncio.Event = field(default_factory=asyncio.Event)


class KvScheduler:
    """Slots and KV blocks, FIFO admission, recompute preemption of the newest sequence."""

    def __init__(
        self,
        capacity: int,
        kv_tokens: int,
        block_size: int,
        max_waiting: int | None,
        prefill_ms_per_token: float = 0.0,
    ) -> None:
        self.capacity = capacity
        self.prefill_s_per_token = prefill_ms_per_token / 1000.0
        self.block_size = block_size
        self.total_blocks = kv_tokens // block_size
        self.free_blocks = self.total_blocks
        self.max_waiting = max_waiting
        self._running: list[_Seq] = []
        self._waiting: collections.deque[_Seq] = collections.deque()
        self._orders = itertools.count()
        self.preemptions = 0
        self.peak_running = 0
        self.peak_in_flight = 0
        self.peak_blocks = 0
        self._stalled_until = 0.0  # loop time the prefills scheduled so far end
        self._stalled_total = 0.0  # seconds of prefill so far: decoding is late by as much

    # -- what the engine's counters and metrics read --------------------------------------

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def in_flight(self) -> int:
        return self.running + self.waiting

    @property
    def used_blocks(self) -> int:
        return self.total_blocks - self.free_blocks

    @property
    def usage(self) -> float:
        """KV-cache usage, 1 = every block in use."""
        return self.used_blocks / self.total_blocks if self.total_blocks else 0.0

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def set_capacity(self, capacity: int) -> None:
        """Change the slots (``max_num_seqs``, ``POST /admin/capacity``): growth admits waiting
        sequences now, shrinkage preempts nothing (new admissions wait until fewer run)."""
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self._schedule()

    def reset_peaks(self) -> None:
        """Restart peak tracking from the current running, in-flight and block counts."""
        self.peak_running, self.peak_in_flight = self.running, self.in_flight
        self.peak_blocks = self.used_blocks

    def fits_ever(self, prompt: int, gen: int) -> bool:
        """Whether a sequence of ``prompt + gen`` tokens fits the whole cache at all."""
        return self.blocks_for(prompt + gen) <= self.total_blocks

    # -- one request ------------------------------------------------------------------------

    async def run(self, prompt: int, gen: int, service_s: float) -> None:
        """Wait for a slot and the prompt's blocks (FIFO), decode ``gen`` tokens over
        ``service_s``, growing by a block at each boundary; a preempted sequence waits again
        at the head of the queue and starts over. Raises :class:`QueueFull` past
        ``max_waiting``."""
        if self.max_waiting is not None and self.waiting >= self.max_waiting:
            raise QueueFull(f"{self.waiting} requests already waiting")
        seq = _Seq(prompt, gen)
        self._waiting.append(seq)
        try:
            while True:
                await self._admitted(seq)
                if await self._decode(seq, service_s):
                    return
        finally:
            self._leave(seq)

    async def _admitted(self, seq: _Seq) -> None:
        self._schedule()
        while seq not in self._running:
            seq.kicked.clear()
            await seq.kicked.wait()

    async def _decode(self, seq: _Seq, service_s: float) -> bool:
        """Prefill, then decode; False when preempted (it waits at the head of the queue)."""
        loop = asyncio.get_running_loop()
        per_token = service_s / max(seq.gen, 1)
        # the prefill: its prompt and, after a preemption, the tokens it had made; it stalls
        # the whole batch (a step that prefills decodes nothing), after any prefill before it
        prefill = (seq.prompt + seq.done) * self.prefill_s_per_token
        if prefill > 0:
            self._stall(loop.time(), prefill)
            if not await self._sleep_until(seq, lambda: self._stalled_until):
                return False
        start, stalls = loop.time() - seq.done * per_token, self._stalled_total
        done = seq.done
        while done < seq.gen:
            # the next token that needs a new block (or the last token)
            room = seq.blocks * self.block_size - seq.prompt
            nxt = min(seq.gen, room + 1) if room < seq.gen else seq.gen

            # due after the decode steps, moved by every prefill since (the batch stalled)
            def due(n: int = nxt) -> float:
                return start + n * per_token + self._stalled_total - stalls

            if not await self._sleep_until(seq, due):
                return False
            done = seq.done = nxt
            if seq.prompt + done > seq.blocks * self.block_size and not self._grow(seq):
                return False
        return True

    async def _sleep_until(self, seq: _Seq, due: Callable[[], float]) -> bool:
        """Sleep until ``due()`` (read again whenever ``seq`` is kicked: a stall moved it);
        False when ``seq`` was preempted meanwhile."""
        loop = asyncio.get_running_loop()
        while not seq.preempted:
            wait = due() - loop.time()
            if wait <= 0:
                return True
            seq.kicked.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(seq.kicked.wait(), wait)
        return False

    def _stall(self, now: float, seconds: float) -> None:
        """A prefill of ``seconds``: the batch decodes nothing meanwhile (after the prefills
        already scheduled); every running sequence's next token moves by as much."""
        self._stalled_until = max(now, self._stalled_until) + seconds
        self._stalled_total += seconds
        for other in self._running:
            other.kicked.set()

    def _grow(self, seq: _Seq) -> bool:
        """One more block for ``seq``, preempting the newest running sequences while none is
        free; False when ``seq`` itself was the one preempted."""
        while self.free_blocks == 0:
            victim = max(self._running, key=lambda s: s.order)
            self._preempt(victim)
            if victim is seq:
                return False
        self.free_blocks -= 1
        seq.blocks += 1
        self.peak_blocks = max(self.peak_blocks, self.used_blocks)
        return True

    def _preempt(self, seq: _Seq) -> None:
        self.preemptions += 1
        self._running.remove(seq)
        self.free_blocks += seq.blocks
        seq.blocks = 0
        seq.preempted = True
        self._waiting.appendleft(seq)
        seq.kicked.set()

    def _leave(self, seq: _Seq) -> None:
        """The request is over (served, or its caller gone): its slot and blocks are freed."""
        if seq in self._running:
            self._running.remove(seq)
            self.free_blocks += seq.blocks
            seq.blocks = 0
        elif seq in self._waiting:
            self._waiting.remove(seq)
        self._schedule()

    def _schedule(self) -> None:
        """Admit waiting sequences in order while a slot and their prompt's blocks are free."""
        while self._waiting and len(self._running) < self.capacity:
            head = self._waiting[0]
            need = self.blocks_for(head.prompt + head.done + 1)
            if need > self.free_blocks:
                break
            self._waiting.popleft()
            self.free_blocks -= need
            head.blocks, head.preempted, head.order = need, False, next(self._orders)
            self._running.append(head)
            head.kicked.set()
        self.peak_running = max(self.peak_running, self.running)
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        self.peak_blocks = max(self.peak_blocks, self.used_blocks)
