"""The local bound of the fair-share fallback: a counting semaphore over units (and tokens),
by priority.

While Redis is unreachable each pod serves its gates under a local share of the limit
(:meth:`Gate.fair_share`). :class:`LocalPermits` keeps the admission order of the fleet-wide
gate inside that share (docs/admission.md):

* a permit holds its **weight** in units; units held (plus ``in_use()``, the fleet leases still
  running from before the outage) never exceed ``budget()``;
* with a token budget (``token_budget()`` not None) a permit holds its **tokens** too, bound
  the same way (``tokens_in_use()``): a grant needs both to fit;
* a weight (or tokens) above the budget could never be granted locally: :class:`Overloaded` at
  once;
* waiters are served strictly by **priority** (higher first), FIFO within a priority;
* **no passing**: a head that does not fit keeps the units freed meanwhile for itself, so nobody
  of its priority or below is granted before it (a heavy call is never starved by light ones);
  a later arrival of a higher priority goes ahead of it;
* :meth:`resize` shrinks a permit's tokens at once (freed to the waiters) and grows them only
  into free tokens nobody waits for, else not at all (as ``resize.lua`` does fleet-wide);
* a cancelled waiter leaves without consuming anything (a grant that raced the cancellation is
  given back) and whoever can go now is granted.

``allowed()`` gates every grant (say, "not while Redis is back and running work is being
adopted"); when ``active()`` turns false (fleet mode is back) every waiter's :meth:`acquire`
returns False so its caller goes back to the fleet. The callables are read again on every
release, cancellation and :meth:`notify`: call :meth:`notify` when one of them changed for
another reason. Every operation costs O(log n) in the waiters (a heap with lazy deletion).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from fleetgate.errors import ConfigError, Overloaded

__all__ = ["LocalPermits"]

# Cancelled entries are left in the heap and skipped when they reach its top; the heap is
# rebuilt without them once they are more than half of it (and more than this many), so a burst
# of cancellations behind a blocked head costs O(1) amortised each and memory stays bounded.
_COMPACT_AT = 64


@dataclass(order=True, slots=True)
class _Waiter:
    # Heap order: higher priority first, then arrival (FIFO within a priority).
    neg_priority: int
    seq: int
    weight: int = field(compare=False)
    tokens: int = field(compare=False)
    future: asyncio.Future[bool] = field(compare=False)
    queued: bool = field(default=True, compare=False)  # still in the heap
    dead: bool = field(default=False, compare=False)  # cancelled, not yet out of the heap


class LocalPermits:
    """A local counting semaphore over units with strict priorities and no passing.

    ``budget()`` is the local share in units; ``in_use()`` (default 0) counts units held outside
    this semaphore that the share must cover too; ``token_budget()`` and ``tokens_in_use()``
    (default: no token budget) are the same for tokens; ``allowed()`` (default always) gates
    grants;
    ``active()`` (default always) turning false makes every waiter return False. ``gate`` names
    the gate in :class:`Overloaded` messages. Use from one event loop only.
    """

    def __init__(
        self,
        budget: Callable[[], int],
        *,
        in_use: Callable[[], int] | None = None,
        token_budget: Callable[[], int | None] | None = None,
        tokens_in_use: Callable[[], int] | None = None,
        allowed: Callable[[], bool] | None = None,
        active: Callable[[], bool] | None = None,
        gate: str = "",
    ) -> None:
        self._budget = budget
        self._in_use = in_use
        self._token_budget = token_budget
        self._tokens_in_use = tokens_in_use
        self._allowed = allowed
        self._active = active
        self.gate = gate
        self._held = 0
        self._tokens = 0
        self._heap: list[_Waiter] = []
        self._dead = 0  # entries of _heap marked dead
        self._seq = itertools.count()

    @property
    def held(self) -> int:
        """Units held by permits granted here and not yet released."""
        return self._held

    @property
    def tokens(self) -> int:
        """Tokens held by permits granted here and not yet released."""
        return self._tokens

    @property
    def waiting(self) -> int:
        """Callers waiting for a grant."""
        return len(self._heap) - self._dead

    async def acquire(self, weight: int = 1, priority: int = 0, tokens: int = 0) -> bool:
        """Wait for ``weight`` units and ``tokens``; True once they are held (give them back
        with :meth:`release`), False if ``active()`` is or turns false first.

        Raises :class:`Overloaded` if ``weight`` exceeds ``budget()`` or ``tokens`` the token
        budget -- at once, or while waiting if a budget shrinks below it. Cancellation at any
        point holds nothing.
        """
        if weight < 1:
            raise ConfigError(f"weight must be an int >= 1, got {weight!r}")
        if not self._is_active():
            return False
        refusal = self._refusal(weight, tokens)
        if refusal is not None:
            raise refusal
        loop = asyncio.get_running_loop()
        waiter = _Waiter(-priority, next(self._seq), weight, tokens, loop.create_future())
        heapq.heappush(self._heap, waiter)
        try:
            self._dispatch()
            # Done already when granted on arrival: no suspension, so no cancellation window.
            return waiter.future.result() if waiter.future.done() else await waiter.future
        except BaseException:
            self._abandon(waiter)
            raise

    def release(self, weight: int = 1, tokens: int = 0) -> None:
        """Give back ``weight`` units and ``tokens`` of a granted permit and grant whoever
        can go now."""
        if weight < 1 or weight > self._held or not 0 <= tokens <= self._tokens:
            raise ValueError(
                f"release of {weight} units and {tokens} tokens, "
                f"{self._held} and {self._tokens} held"
            )
        self._held -= weight
        self._tokens -= tokens
        self._dispatch()

    def resize(self, held: int, tokens: int) -> bool:
        """A granted permit holding ``held`` tokens asks to hold ``tokens``: a shrink is
        done at once (the freed tokens go to the waiters); a growth only when nobody waits
        and the budget's free tokens cover it. True when done (else nothing changed)."""
        if not 0 <= held <= self._tokens:
            raise ValueError(f"resize of {held} tokens, {self._tokens} held")
        if tokens > held:
            tbudget = self._token_budget() if self._token_budget is not None else None
            if self.waiting or (
                tbudget is not None and tokens - held > tbudget - self._tokens_used()
            ):
                return False
        self._tokens += tokens - held
        if tokens < held:
            self._dispatch()
        return True

    def notify(self) -> None:
        """Look at the waiters again: the budget, ``in_use()``, ``allowed()`` or ``active()``
        changed."""
        self._dispatch()

    # -- internals ---------------------------------------------------------------------------

    def _is_active(self) -> bool:
        return self._active is None or self._active()

    def _tokens_used(self) -> int:
        return self._tokens + (self._tokens_in_use() if self._tokens_in_use is not None else 0)

    def _refusal(self, weight: int, tokens: int) -> Overloaded | None:
        """The error for a permit that could never be granted under the budgets now."""
        budget = self._budget()
        if weight > budget:
            what = (
                f"a weight of {weight} units exceeds the local fair-share bound of {budget} units"
            )
        else:
            tbudget = self._token_budget() if self._token_budget is not None else None
            if tbudget is None or tokens <= tbudget:
                return None
            what = f"{tokens} tokens exceed the local fair-share bound of {tbudget} tokens"
        return Overloaded(self.gate, 0, reason=f"{what} that applies while Redis is unreachable")

    def _pop(self) -> _Waiter:
        waiter = heapq.heappop(self._heap)
        waiter.queued = False
        if waiter.dead:
            self._dead -= 1
        return waiter

    def _dispatch(self) -> None:
        """Grant from the top of the heap while the head fits; fail heads that never can."""
        heap = self._heap
        if not heap:
            return
        if not self._is_active():
            while heap:
                waiter = self._pop()
                if not waiter.future.done():
                    waiter.future.set_result(False)
            return
        if self._allowed is not None and not self._allowed():
            return
        free = self._budget() - self._held - (self._in_use() if self._in_use is not None else 0)
        tbudget = self._token_budget() if self._token_budget is not None else None
        tfree = math.inf if tbudget is None else tbudget - self._tokens_used()
        while heap:
            head = heap[0]
            refusal = None if head.dead else self._refusal(head.weight, head.tokens)
            if head.dead or head.future.done():  # cancelled (its task may not know yet)
                self._pop()
            elif refusal is not None:
                self._pop()
                head.future.set_exception(refusal)
            elif head.weight <= free and head.tokens <= tfree:
                self._pop()
                free -= head.weight
                tfree -= head.tokens
                self._held += head.weight
                self._tokens += head.tokens
                head.future.set_result(True)
            else:
                return  # no passing: the units freed so far wait for this head

    def _abandon(self, waiter: _Waiter) -> None:
        """The caller of ``waiter`` left (cancelled, or an error): undo whatever it holds."""
        future = waiter.future
        if future.done() and not future.cancelled():
            if future.exception() is None and future.result():
                # a grant raced the cancellation: give it back
                self.release(waiter.weight, waiter.tokens)
            return
        if waiter.queued and not waiter.dead:
            waiter.dead = True
            self._dead += 1
            if self._dead > _COMPACT_AT and 2 * self._dead > len(self._heap):
                self._compact()
        self._dispatch()  # it may have been the head that held the others back

    def _compact(self) -> None:
        live = []
        for waiter in self._heap:
            if waiter.dead:
                waiter.queued = False
            else:
                live.append(waiter)
        heapq.heapify(live)
        self._heap = live
        self._dead = 0
