"""Drop-in replacements for the per-process model-concurrency functions of ``agent_utilities``.

``agent_utilities`` is the helper package of the adaptive-concurrency design this project grew
from; its ``core.model_concurrency`` module caps calls per model within one process. These
functions keep its names and signatures and make the cap fleet-wide.

Switching is one import::

    # from agent_utilities.core.model_concurrency import map_concurrent, map_concurrent_sync
    from fleetgate.client import map_concurrent, map_concurrent_sync, resolve_capacity
    from fleetgate.client import get_utilization, reset_controllers

The functions share one process-wide default fleet configured from the environment:

=============================  ===================================================================
``FLEETGATE_REDIS_URL``        Redis URL (default ``redis://127.0.0.1:6379/0``)
``FLEETGATE_PREFIX``           key prefix (default ``fg``)
``FLEETGATE_FLOORS``           per-model static capacity (the floor), ``bge-m3=4,rerank=32``
``FLEETGATE_DEFAULT_FLOOR``    floor of models not listed (default 1)
``FLEETGATE_ON_REDIS_ERROR``   ``fair_share`` (default) or ``fail``
=============================  ===================================================================

The gate of a model is the fleet-wide cap: the coordinator's live target, else the floor. As in
``agent_utilities``, ``map_concurrent*`` default to no deadline and no retries (pass
``deadline=``, ``retry=``, ``max_in_flight=`` to opt in; see :meth:`Gate.map`). The async
variant calls ``fn`` on the caller's event loop; only the permits are taken on the default
fleet's background loop.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import AsyncIterable, Iterable
from typing import Any

from fleetgate.ask import Ask
from fleetgate.errors import ConfigError

from ._deadline import Deadline
from ._lease import Lease
from ._map import run_map
from ._metrics import ClientMetrics
from ._sync import SyncFleet, SyncGate, _Portal, release_lease

__all__ = [
    "get_utilization",
    "map_concurrent",
    "map_concurrent_sync",
    "reset_controllers",
    "resolve_capacity",
]

_lock = threading.Lock()
_fleet: SyncFleet | None = None
_COMPAT_DEFAULTS = {"max_in_flight": None, "deadline": None, "retry": False}


def _floors(env: dict[str, str] | os._Environ[str] = os.environ) -> tuple[dict[str, int], int]:
    def as_floor(text: str, where: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ConfigError(f"{where}: expected an integer >= 1, got {text!r}") from None
        if value < 1:
            raise ConfigError(f"{where}: expected an integer >= 1, got {value}")
        return value

    floors: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in env.get("FLEETGATE_FLOORS", "").split(","))):
        model, sep, value = part.rpartition("=")
        if not sep or not model:
            raise ConfigError(f"FLEETGATE_FLOORS: expected 'model=N' entries, got {part!r}")
        floors[model.strip()] = as_floor(value.strip(), f"FLEETGATE_FLOORS[{model.strip()}]")
    default = as_floor(env.get("FLEETGATE_DEFAULT_FLOOR", "1"), "FLEETGATE_DEFAULT_FLOOR")
    return floors, default


def _default_fleet() -> SyncFleet:
    global _fleet
    with _lock:
        if _fleet is None:
            fleet = SyncFleet(  # url and prefix: $FLEETGATE_REDIS_URL, $FLEETGATE_PREFIX
                on_redis_error=os.environ.get("FLEETGATE_ON_REDIS_ERROR", "fair_share"),
            )
            fleet.start()
            _fleet = fleet
        return _fleet


def _gate(model: str) -> SyncGate:
    floors, default = _floors()
    return _default_fleet().gate(model, floor=floors.get(model, default))


class _RemoteLease:
    def __init__(self, lease: Lease, portal: _Portal) -> None:
        self.lease = lease
        self.portal = portal

    async def release(self) -> None:
        # Never abandoned: a cancelled caller still gives the permit back.
        await self.portal.acall(self.lease.release(), shielded=True)

    def report(self, outcome: str, latency: float | None = None) -> None:
        self.lease.report(outcome, latency)  # sets the report the release above carries

    @property
    def is_revoked(self) -> bool:
        return self.lease.is_revoked  # a plain flag: safe to read from this loop's thread


class _RemoteGate:
    """Permits from the default fleet's loop for calls made on the caller's loop."""

    def __init__(self, gate: SyncGate) -> None:
        self.gate = gate.gate
        self.portal = gate.portal
        self.name = gate.name
        self.metrics: ClientMetrics = gate.gate.metrics

    async def acquire_for(self, dl: Deadline, ask: Ask) -> _RemoteLease:
        left = dl.remaining()
        if left is not None and left <= 0:
            raise dl.expired()
        # A caller cancelled as the grant lands on the other loop: the portal releases it.
        lease = await self.portal.acall(
            self.gate.acquire(ask=dataclasses.replace(ask, deadline=left)), undo=release_lease
        )
        return _RemoteLease(lease, self.portal)


async def map_concurrent(
    model: str, fn: Any, items: Iterable[Any] | AsyncIterable[Any], **options: Any
) -> list[Any]:
    """Run ``fn`` over ``items`` under the model's fleet-wide cap; results in input order."""
    return await run_map(_RemoteGate(_gate(model)), fn, items, **{**_COMPAT_DEFAULTS, **options})


def map_concurrent_sync(model: str, fn: Any, items: Iterable[Any], **options: Any) -> list[Any]:
    """Blocking :func:`map_concurrent`; a sync ``fn`` runs in worker threads."""
    return _gate(model).map(fn, items, **{**_COMPAT_DEFAULTS, **options})


def resolve_capacity(model: str) -> int:
    """The model's current fleet-wide cap: the live adaptive target, else its static floor."""
    return _gate(model).capacity()


def get_utilization(model: str) -> dict[str, Any]:
    """``agent_utilities``' snapshot (running, waiting_capacity, current_target, floor,
    ceiling, metrics_ok, saturated, last_poll, metrics_url) plus fleet in-flight, queue depth and
    the limit."""
    _gate(model)
    return _default_fleet().utilization(model).to_dict()


def reset_controllers() -> None:
    """Drop the default fleet (its gates and connections); the next call builds a fresh one."""
    global _fleet
    with _lock:
        fleet, _fleet = _fleet, None
    if fleet is not None:
        fleet.close()
