"""One gate's script calls as its batch carries them, and the one place they are encoded.

A process's acquires and releases of a gate go to Redis in batches (:class:`~._batch.Batcher`,
group commit). Each entry of a batch is an :class:`AcquireCall` (a lease id, the ms it may wait,
its :class:`~fleetgate.ask.Ask`) or a :class:`ReleaseCall` (a lease id and its report).
:func:`send_calls` sends one batch as one script call: its releases first, then its acquires,
each ask encoded for the scripts here (the weight is in the lease id, the priority and tenant
in the lane class: :mod:`fleetgate.admission`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

from fleetgate.ask import Ask
from fleetgate.keys import GateKeys
from fleetgate.observed import tally
from fleetgate.scripts import AcquireReply
from fleetgate.settings import GateSettings

from ._runtime import Runtime

__all__ = ["AcquireCall", "GateCall", "ReleaseCall", "send_calls"]


@dataclass(frozen=True, slots=True)
class AcquireCall:
    """Acquire ``ask`` as ``lease_id`` (:meth:`Ask.lease_id`), parking up to ``wait_ms``."""

    lease_id: str
    wait_ms: int
    ask: Ask


@dataclass(frozen=True, slots=True)
class ReleaseCall:
    """Release ``lease_id``, counting its ``report`` (:func:`fleetgate.observed.encode_report`;
    ``""``: none)."""

    lease_id: str
    report: str = ""


#: one entry of a gate's batch (the answer: an ``AcquireReply`` for an acquire, None otherwise)
GateCall: TypeAlias = AcquireCall | ReleaseCall


async def send_calls(
    runtime: Runtime, keys: GateKeys, defaults: GateSettings, calls: Sequence[GateCall]
) -> list[AcquireReply | None]:
    """One batch of the gate's calls (``keys``, with ``defaults``) in one script call of
    ``runtime``'s scripts: its releases, then its acquires (release.lua alone when there is
    nothing to acquire); one answer per call, in order. The batcher's send: the gate binds the
    first three arguments once."""
    scripts, fence_ms = runtime.scripts, runtime.fence_ms
    released = [c for c in calls if isinstance(c, ReleaseCall)]
    releases = [c.lease_id for c in released]
    observed = tally(c.report for c in released)
    requests = [(c.lease_id, c.wait_ms, c.ask.lane) for c in calls if isinstance(c, AcquireCall)]
    if not requests:
        await scripts.release_many(keys, releases, observed)
        return [None] * len(calls)
    replies = iter(
        await scripts.acquire_many(
            keys, requests, defaults, releases=releases, observed=observed, fence_ms=fence_ms
        )
    )
    return [next(replies) if isinstance(c, AcquireCall) else None for c in calls]
