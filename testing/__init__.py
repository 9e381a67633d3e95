"""In-process fleets on fakeredis, for an application's own unit tests.

::

    from fleetgate.testing import fake_fleet

    async def test_my_handler() -> None:
        async with fake_fleet() as fleet:  # no Redis server anywhere
            gate = fleet.gate("bge-m3", floor=2)
            async with gate.permit(deadline=5.0) as lease:
                ...

The fleet is a real :class:`fleetgate.client.Fleet`: the same client code and the same Lua
scripts, run by fakeredis' Lua interpreter (``lupa``) on an in-memory server instead of a
``redis-server``. It models one Redis server shared by the fleets of one process; it does not
model several processes, a fake clock, outages or Redis Cluster (see the README, "Testing your
code with fleetgate.testing").

* :func:`fake_fleet` -- a started ``Fleet``; :func:`fake_sync_fleet` -- a started ``SyncFleet``;
* :func:`fake_default_fleet` -- the compat functions (``map_concurrent``, ...) on one;
* :func:`set_target` -- publish a target as the coordinator would;
* :func:`fake_redis_options` -- the ``redis_options`` behind them, to build a ``Fleet`` yourself.

Needs the ``testing`` extra: ``pip install 'fleetgate[testing]'`` (fakeredis and lupa).

How it plugs in: no hook in the client. :func:`fake_redis_options` are redis-py options that make
every connection the fleet opens (its pool and each wake listener's dedicated connection) a
fakeredis connection to one :class:`fakeredis.FakeServer` (redis-py's ``connection_class``
option); the URL is never dialled.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Iterator
from typing import Any

try:
    import lupa  # type: ignore[import-untyped]  # noqa: F401  (fakeredis needs it for scripts)
    from fakeredis import FakeServer
    from fakeredis.aioredis import FakeAsyncRedisConnection
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        "fleetgate.testing needs fakeredis and lupa: pip install 'fleetgate[testing]'"
    ) from exc

from fleetgate.client import Fleet, SyncFleet, compat
from fleetgate.errors import ConfigError

__all__ = [
    "FAKE_URL",
    "FakeServer",
    "fake_default_fleet",
    "fake_fleet",
    "fake_redis_options",
    "fake_sync_fleet",
    "set_target",
]

#: The URL a fake fleet reports (``fleet.url``, logs). It is never connected to.
FAKE_URL = "redis://fleetgate-fake:6379/0"

# Keyword arguments of Fleet that name the server; a fake fleet chooses them itself.
_OURS = ("url",)
_OUR_OPTIONS = ("connection_class", "server")


def fake_redis_options(
    server: FakeServer, redis_options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``redis_options`` for :class:`~fleetgate.client.Fleet` (or ``SyncFleet``) that connect
    every connection of the fleet to the in-memory ``server`` instead of a Redis server.

    Other redis-py options in ``redis_options`` are kept. Use :func:`fake_fleet` unless you need
    to build the ``Fleet`` yourself: ``Fleet(FAKE_URL, redis_options=fake_redis_options(srv))``.
    """
    options = dict(redis_options or {})
    clash = [k for k in _OUR_OPTIONS if k in options]
    if clash:
        raise ConfigError(f"redis_options: {', '.join(clash)} is set by fleetgate.testing")
    options["connection_class"] = FakeAsyncRedisConnection
    options["server"] = server
    return options


def _fleet_kwargs(server: FakeServer, fleet_kwargs: dict[str, Any]) -> dict[str, Any]:
    for name in _OURS:
        if name in fleet_kwargs:
            raise ConfigError(f"{name}: a fake fleet has no Redis URL (pass server= to share one)")
    kwargs = dict(fleet_kwargs)
    kwargs["redis_options"] = fake_redis_options(server, kwargs.get("redis_options"))
    # The recovery fence waits for pods of other processes to count work that a wiped Redis
    # forgot; an in-memory server is never wiped under its fleets and no other process uses it,
    # so a fake fleet grants a new gate at once (unless the caller asks for a fence).
    kwargs.setdefault("recovery_fence", 0.0)
    return kwargs


@contextlib.asynccontextmanager
async def fake_fleet(
    *, server: FakeServer | None = None, **fleet_kwargs: Any
) -> AsyncIterator[Fleet]:
    """A started :class:`~fleetgate.client.Fleet` on an in-memory fakeredis server.

    ``async with fake_fleet(pod_id="test") as fleet:`` -- the keyword arguments are those of
    ``Fleet`` except the URL. ``server`` (a :class:`fakeredis.FakeServer`) shares one in-memory
    Redis between several fake fleets (async or sync) of this process, say to play two pods
    whose permits count against one limit; by default each fake fleet gets a server of its
    own, empty. The fleet is closed (waiters failed, leases released) when the block exits.
    """
    srv = FakeServer() if server is None else server
    fleet = Fleet(FAKE_URL, **_fleet_kwargs(srv, fleet_kwargs))
    async with fleet:
        yield fleet


@contextlib.contextmanager
def fake_sync_fleet(
    *, server: FakeServer | None = None, **fleet_kwargs: Any
) -> Iterator[SyncFleet]:
    """A started :class:`~fleetgate.client.SyncFleet` on an in-memory fakeredis server.

    The blocking twin of :func:`fake_fleet` (same arguments); its fleet runs on the sync face's
    own event-loop thread. A ``server`` may be shared with fake fleets of other event loops of
    this process (a grant on one wakes a caller parked on another).
    """
    srv = FakeServer() if server is None else server
    with SyncFleet(FAKE_URL, **_fleet_kwargs(srv, fleet_kwargs)) as fleet:
        try:
            yield fleet
        finally:
            # SyncFleet.close() (on leaving the block) stops its loop with whatever still runs
            # on it. On a real server nothing does once the fleet is closed; here the fake
            # server's side of each wake listener's blocking pop is a task of that loop, which
            # would be destroyed pending (an error report at interpreter exit). Close first and
            # end those tasks, as asyncio.run() does.
            fleet.portal.call(_close_and_drain(fleet.fleet))


@contextlib.contextmanager
def fake_default_fleet(
    *, server: FakeServer | None = None, **fleet_kwargs: Any
) -> Iterator[SyncFleet]:
    """Run the compat functions (``map_concurrent``, ``map_concurrent_sync``,
    ``resolve_capacity``, ``get_utilization``: :mod:`fleetgate.client.compat`, the names of
    ``agent_utilities``' ``model_concurrency``) on a :func:`fake_sync_fleet` inside the block.

    Those functions share one default fleet built from ``FLEETGATE_REDIS_URL``; here it is a fake
    one instead (``FLEETGATE_FLOORS`` and ``FLEETGATE_DEFAULT_FLOOR`` are still read at each
    call). A default fleet built before is closed first (``reset_controllers()``), and the fake
    one is dropped on leaving the block, so the next call outside builds a real one again.
    """
    # The default fleet is compat's private state, set here and nowhere else outside compat:
    # tests/tools/test_fake_fleet.py::test_default_fleet_runs_the_compat_functions fails if it
    # moves.
    with fake_sync_fleet(server=server, **fleet_kwargs) as fleet:
        compat.reset_controllers()
        with compat._lock:
            compat._fleet = fleet
        try:
            yield fleet
        finally:
            with compat._lock:
                if compat._fleet is fleet:
                    compat._fleet = None


async def _close_and_drain(fleet: Fleet) -> None:
    await fleet.close()  # idempotent: SyncFleet.close() calls it again, harmlessly
    here = asyncio.current_task()
    left = [t for t in asyncio.all_tasks() if t is not here]
    for task in left:
        task.cancel()
    await asyncio.gather(*left, return_exceptions=True)


async def set_target(fleet: Fleet, name: str, value: int, *, ttl: float = 60.0) -> int:
    """Publish ``value`` as the coordinator's target of gate ``name`` for ``ttl`` seconds, as
    the coordinator would, and return the limit now in force (the target clamped to the gate's
    [floor, ceiling]). Parked callers get any new room at once; a lower target stops new grants
    until fewer are held (no lease is revoked).

    For tests of code that must follow a limit that grows or shrinks. A gate with no
    configuration in Redis yet is registered with the settings given to ``fleet.gate(name)``.
    It reuses the epoch already stored, so never call it next to a live coordinator.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"target: expected int >= 1, got {value!r}")
    if not (ttl > 0 and math.isfinite(ttl)):
        raise ConfigError(f"ttl: expected a finite number of seconds > 0, got {ttl!r}")
    gate = fleet.gate(name)
    snap = await fleet.scripts.snapshot(gate.keys, listed=0)
    epoch = snap.epoch or 1
    cfg = {} if snap.cfg else gate.defaults.as_cfg()
    await fleet.scripts.publish(gate.keys, epoch, int(ttl * 1000), value, cfg, {})
    limit: int = (await fleet.scripts.snapshot(gate.keys, listed=0)).limit
    return limit
