"""What the demo and its search pod share: the spec the pod is given (in the environment
variable ``SPEC_ENV``) and the stats file it writes. A module of its own: the demo imports it,
and ``python -m fleetgate.demo.interactive`` runs the pod without the package having imported
the pod's module first."""

from __future__ import annotations

import msgspec

__all__ = ["SPEC_ENV", "InteractiveSpec", "InteractiveStats"]

SPEC_ENV = "FLEETGATE_INTERACTIVE_SPEC"


class InteractiveSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What the search pod drives."""

    redis_url: str
    prefix: str
    gate: str
    url: str  # the reranker's base URL, without /v1
    model: str = ""
    rate: float = 4.0  # search calls per second
    passages: int = 16  # per search call
    ramp: float = 8.0  # ingest loops added per second
    max_loops: int = 240
    ingest_passages: int = 64
    stats_path: str = ""
    parent_pid: int | None = None
    pod_id: str = "search-1"


class InteractiveStats(msgspec.Struct, kw_only=True):
    """The stats file: each search call as [asked, waited ms] (asked: monotonic seconds, the
    same clock as the demo's), ingest loops running, outcomes."""

    updated: float = 0.0
    waits: list[tuple[float, float]] = msgspec.field(default_factory=list)
    ingest_loops: int = 0
    search_ok: int = 0
    search_errors: int = 0
    ingest_ok: int = 0
    ingest_errors: int = 0
    stopped: bool = False
