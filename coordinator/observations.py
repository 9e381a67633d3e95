"""Reading the client-observed counters each poll and turning them into windows.

One ``HGETALL {prefix}:{G}:obs`` per gate, all in one pipeline, run while the scrapes are in
flight (no extra wait per poll). :class:`ObsWindows` keeps the last reading per gate and hands
the controllers two windows (:class:`fleetgate.observed.Reading` differences):

* the **outcomes** since the last poll (overloads cut at once; None after a counter reset or
  on the first poll of a term: no difference is known);
* the **latencies** since the last window that had at least ``min_samples`` of them: a gate
  with few or slow calls gets a window over several polls rather than a median of two calls
  (as Envoy aggregates a request count before it summarises latencies), bounded by
  ``max_polls`` so an old sample never lingers.
"""

from __future__ import annotations

from collections.abc import Sequence

from redis.client import NEVER_DECODE

from fleetgate._redis import AnyRedis
from fleetgate.keys import GateKeys
from fleetgate.observed import Reading, delta

__all__ = ["MIN_SAMPLES", "ObsWindows", "read_observations"]

#: latencies a window needs before its median is used
MIN_SAMPLES = 10
#: a latency window never spans more than this many polls
MAX_WINDOW_POLLS = 10


async def read_observations(
    client: AnyRedis, keys: Sequence[GateKeys], at: float
) -> list[Reading | None]:
    """Each gate's obs counters at ``at`` (one pipeline). A gate whose key cannot be read (the
    wrong type, say) is None: its windows restart, the other gates are unaffected."""
    if not keys:
        return []
    pipe = client.pipeline(transaction=False)
    for k in keys:
        # as bytes, whatever the client decodes: a field that is no UTF-8 (anyone with the
        # client ACL can write one) failed the whole pipeline's decoding, every gate's reading
        pipe.execute_command("HGETALL", k.obs, **{NEVER_DECODE: True})
    replies = await pipe.execute(raise_on_error=False)
    return [None if isinstance(r, Exception) else Reading.parse(r, at=at) for r in replies]


class ObsWindows:
    """The last reading of every gate, and the windows a new reading closes."""

    def __init__(self, min_samples: int = MIN_SAMPLES, max_polls: int = MAX_WINDOW_POLLS) -> None:
        self.min_samples = min_samples
        self.max_polls = max_polls
        self._last: dict[str, Reading] = {}
        self._latency_from: dict[str, tuple[Reading, int]] = {}

    def clear(self) -> None:
        """Forget every reading (a new term: the old leader's polls are not ours)."""
        self._last.clear()
        self._latency_from.clear()

    def update(self, gate: str, reading: Reading | None) -> tuple[Reading | None, Reading | None]:
        """``(outcomes, latency)`` windows closed by ``reading`` (see the module doc)."""
        if reading is None:
            self._last.pop(gate, None)
            self._latency_from.pop(gate, None)
            return None, None
        prev = self._last.get(gate)
        self._last[gate] = reading
        outcomes = delta(prev, reading)
        if outcomes is None:
            self._latency_from[gate] = (reading, 0)
            return None, None
        assert prev is not None  # (a difference was known)
        base, polls = self._latency_from.get(gate, (prev, 0))
        latency = delta(base, reading)
        polls += 1
        if latency is None or (polls >= self.max_polls and latency.lat_n < self.min_samples):
            self._latency_from[gate] = (reading, 0)
            return outcomes, None
        if latency.lat_n >= self.min_samples:
            self._latency_from[gate] = (reading, 0)
            return outcomes, latency
        self._latency_from[gate] = (base, polls)
        return outcomes, None
