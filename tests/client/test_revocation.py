"""Revocation through the client, across OS processes on a real redis-server: a batch process
holds every unit of a gate with long calls; an interactive call (priority 10) arrives. After
``revoke_after`` the holder's process learns within a heartbeat that one lease (only one: the
unit the interactive call lacks) is revoked, the interactive call is granted only once that
lease was released, and the units held never pass the limit -- also when the revoked holder is
frozen and never gives anything back (its lease lapses). ``gate.map`` queues a revoked item
again and completes the batch."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import time
from concurrent.futures import ProcessPoolExecutor

import pytest
import redis
from prometheus_client import CollectorRegistry

from fleetgate.client import Fleet
from fleetgate.keys import GateKeys

from ..conftest import RedisUnderTest
from ..lua._admission import Sampler
from . import _revoke_workers

ctx = mp.get_context("spawn")
FLOOR, REVOKE_AFTER, HB = 2, 0.3, _revoke_workers.HB


def _events(r: redis.Redis, log: str) -> list[tuple[str, str, float]]:
    out = []
    for line in r.lrange(log, 0, -1):
        event, lease_id, at = line.split(" ")
        out.append((event, lease_id, float(at)))
    return out


async def _interactive(rut: RedisUnderTest, gate: str, probe: str) -> tuple[float, float, int]:
    """One call of priority 10: (when it asked, when it was granted, the probe's reading)."""
    r = redis.asyncio.Redis.from_url(rut.url)
    async with Fleet(
        rut.url, prefix=rut.prefix, registry=CollectorRegistry(), heartbeat_interval=HB
    ) as fleet:
        g = fleet.gate(gate, floor=FLOOR, revoke_after=REVOKE_AFTER)
        asked = time.time()
        async with g.permit(deadline=30, priority=10):
            granted = time.time()
            running = int(await r.incr(probe))
            await r.decr(probe)
    await r.aclose()
    return asked, granted, running


@pytest.mark.parametrize("frozen", [False, True], ids=["cooperative", "frozen holder"])
def test_a_revoked_lease_is_given_back_before_the_higher_band_starts(
    rut: RedisUnderTest, frozen: bool
) -> None:
    gate, probe, log, stop = "rv", f"{rut.prefix}:probe", f"{rut.prefix}:log", f"{rut.prefix}:stop"
    keys = GateKeys.of(rut.prefix, gate)
    r = redis.Redis.from_url(rut.url, decode_responses=True)
    lease_ms = 1500 if frozen else 60_000
    with ProcessPoolExecutor(1, mp_context=ctx) as ex, Sampler(rut.url, keys) as units:
        holder = ex.submit(
            _revoke_workers.hold_until_revoked, rut.url, rut.prefix, gate, floor=FLOOR,
            revoke_after=REVOKE_AFTER, lease_ms=lease_ms, probe=probe, log=log, stop=stop,
            release_delay=0.5,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while int(r.get(probe) or 0) < FLOOR:
            assert time.monotonic() < deadline, "the holder never held the gate"
            time.sleep(0.01)
        pid = int(r.get(f"{log}:pid") or 0)
        if frozen:
            os.kill(pid, signal.SIGSTOP)
            frozen_at = time.time()
        try:
            asked, granted, running = asyncio.run(_interactive(rut, gate, probe))
        finally:
            if frozen:
                os.kill(pid, signal.SIGCONT)
        r.set(stop, 1)
        revoked = holder.result(timeout=60)
    events = _events(r, log)
    r.close()
    print(f"[revocation frozen={frozen}] granted {granted - asked:.3f} s after asking; "
          f"events {[(e, round(t - asked, 3)) for e, _, t in events]}; units peak "
          f"{units.peak}")  # fmt: skip
    assert units.peak <= FLOOR  # the cap held throughout
    if frozen:
        # the frozen holder learnt nothing and gave nothing back: the call got its unit only
        # once a lease had lapsed (lease_ms after the holder's last renewal)
        assert granted - frozen_at >= lease_ms / 1000 - HB
        return
    assert running <= FLOOR
    assert revoked == 1  # only the unit the interactive call lacked
    revoked_at = [t for e, _, t in events if e == "revoked"]
    released_at = [t for e, _, t in events if e == "released"]
    assert len(revoked_at) == 1
    # the holder learnt it within a heartbeat of revoke_after (its own beat and the waiter's)
    assert revoked_at[0] - asked < REVOKE_AFTER + 3 * HB + 0.5, (revoked_at, asked)
    # the revoked lease held its unit for its release_delay: the call started after that
    assert granted >= min(released_at)
    assert granted - revoked_at[0] >= 0.5
    assert [e for e, _, _ in events].count("LeaseRevoked") == 1  # leaving its block said so


@pytest.mark.long
def test_map_queues_a_revoked_item_again_and_completes(rut: RedisUnderTest) -> None:
    gate, probe, started = "rvmap", f"{rut.prefix}:probe", f"{rut.prefix}:started"
    r = redis.Redis.from_url(rut.url, decode_responses=True)
    with ProcessPoolExecutor(1, mp_context=ctx) as ex:
        batch = ex.submit(
            _revoke_workers.map_batch, rut.url, rut.prefix, gate, floor=FLOOR,
            revoke_after=REVOKE_AFTER, items=4, hold_s=3.0, probe=probe, started=started,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while int(r.get(probe) or 0) < FLOOR:
            assert time.monotonic() < deadline, "the batch never held the gate"
            time.sleep(0.01)
        asked, granted, running = asyncio.run(_interactive(rut, gate, probe))
        results, revocations = batch.result(timeout=120)
    calls = r.lrange(started, 0, -1)
    r.close()
    print(f"[revocation map] interactive granted after {granted - asked:.3f} s; batch calls "
          f"started {calls}; revocations {revocations}")  # fmt: skip
    assert results == [0, 10, 20, 30]  # the batch completed, in order
    assert revocations == 1 and len(calls) == 5  # one item was cut and ran again
    assert running <= FLOOR
    # without revocation the call would have waited for a 3 s batch call to end
    assert granted - asked < 2.0


def test_the_blocking_api_sees_a_revocation(rut: RedisUnderTest) -> None:
    """A SyncFleet lease's ``revoked_sync`` (a threading.Event) is set when a call of a higher
    priority, on another thread, waits past revoke_after; leaving the block raises
    LeaseRevoked, and the waiting call gets the unit."""
    from concurrent.futures import ThreadPoolExecutor

    from fleetgate.client import LeaseRevoked, SyncFleet

    with SyncFleet(
        rut.url, prefix=rut.prefix, registry=CollectorRegistry(), heartbeat_interval=HB
    ) as fleet, ThreadPoolExecutor(1) as pool:  # fmt: skip
        gate = fleet.gate("rvsync", floor=1, revoke_after=REVOKE_AFTER)
        with pytest.raises(LeaseRevoked), gate.permit(deadline=None) as lease:
            urgent = pool.submit(gate.acquire, 20, priority=10)
            assert lease.revoked_sync.wait(10) and lease.is_revoked
            assert not urgent.done()  # the revoked lease holds its unit until it is released
        high = urgent.result(timeout=10)
        assert not high.is_revoked
        gate.release(high)
