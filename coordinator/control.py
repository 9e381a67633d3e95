"""What a gate's controller hands the rest of the coordinator, whichever controller it is.

:class:`Observed`: what a decided poll adds to the gate's util snapshot -- the callers' outcome
counts of the poll and, for a latency-driven gate, the latency it read
(:mod:`fleetgate.util_hash` writes them).
"""

from __future__ import annotations

import msgspec

from fleetgate.observed import Reading

__all__ = ["Observed"]


class Observed(msgspec.Struct, frozen=True):
    """The client-observed figures of one decided poll, for the util snapshot.

    ``outcomes``: the calls the releases reported since the last poll (None: no window, e.g.
    the first poll of a term); ``latency_driven``: the gate's target follows the latency, read
    as ``p50`` (the window's median) against ``no_load`` (seconds; None: not known yet).
    """

    outcomes: Reading | None = None
    latency_driven: bool = False
    p50: float | None = None
    no_load: float | None = None
