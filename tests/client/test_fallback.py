"""Redis going away: the fair-share fallback and the fail mode (a private server we kill).

Also: each pod's share while its count of live pods is not trusted yet (pods starting during an
outage), the outage's cause named in the log, and the return to fleet mode once Redis stops
refusing writes."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest
import redis.asyncio as aredis
from prometheus_client import CollectorRegistry
from redis.exceptions import ConnectionError, MaxConnectionsError

from fleetgate.client import Fleet, RedisUnavailable
from fleetgate.tools.redisproc import RedisProcess

from .. import _workers
from ..conftest import RedisUnderTest


async def _wait(predicate, timeout: float, what: str = "the condition") -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise TimeoutError(f"not within {timeout}s: {what}")
        await asyncio.sleep(0.02)


async def test_fair_share_keeps_serving_and_recovers(own_redis: RedisProcess) -> None:
    registry = CollectorRegistry()
    async with Fleet(
        own_redis.url, prefix="fg", registry=registry, heartbeat_interval=0.2
    ) as fleet:
        gate = fleet.gate("fs", floor=4)
        async with gate.permit():
            pass
        await _wait(lambda: gate.last_live_pods == 1, 3)  # a heartbeat registered the pod
        own_redis.kill()

        running = peak = done = 0

        async def call() -> None:
            nonlocal running, peak, done
            async with gate.permit(deadline=10):
                running += 1
                peak = max(peak, running)
                await asyncio.sleep(0.02)
                running -= 1
                done += 1

        await asyncio.gather(*(call() for _ in range(20)))
        assert done == 20  # no caller-visible error during the outage
        assert peak <= gate.fair_share() == 4
        assert fleet.fallback_active
        assert registry.get_sample_value("fleetgate_client_fallback", {"gate": "fs"}) == 1

        own_redis.start()
        await _wait(lambda: not fleet.fallback_active, 5)
        assert registry.get_sample_value("fleetgate_client_fallback", {"gate": "fs"}) == 0
        async with gate.permit() as lease:
            assert not lease.local
            assert await fleet.redis.zcard(gate.keys.holders) == 1


async def test_fail_mode_raises_promptly(own_redis: RedisProcess) -> None:
    async with Fleet(
        own_redis.url, prefix="fg", registry=CollectorRegistry(), on_redis_error="fail"
    ) as fleet:
        gate = fleet.gate("ff", floor=1)
        own_redis.kill()
        t0 = time.monotonic()
        with pytest.raises(RedisUnavailable, match="unreachable"):
            async with gate.permit(deadline=10):
                pytest.fail("must not run")
        assert time.monotonic() - t0 < 3


async def test_fail_mode_parked_caller_does_not_hang(own_redis: RedisProcess) -> None:
    async with Fleet(
        own_redis.url,
        prefix="fg",
        registry=CollectorRegistry(),
        on_redis_error="fail",
        heartbeat_interval=0.2,
    ) as fleet:
        gate = fleet.gate("fp", floor=1)
        held = await gate.acquire()
        parked = asyncio.create_task(gate.acquire(deadline=30))
        await asyncio.sleep(0.2)
        own_redis.kill()
        with pytest.raises(RedisUnavailable):
            await asyncio.wait_for(parked, 5)
        await held.release()


async def test_running_work_is_adopted_when_redis_returns(own_redis: RedisProcess) -> None:
    """Redis restarts empty mid-call: the permits still running (fleet and local) are counted
    as leases again before fleet mode resumes, so new grants respect the cap."""
    async with Fleet(
        own_redis.url, prefix="fg", registry=CollectorRegistry(), heartbeat_interval=0.2
    ) as fleet:
        gate = fleet.gate("adopt", floor=2)
        fleet_lease = await gate.acquire()
        await _wait(lambda: gate.last_live_pods == 1, 3)
        own_redis.kill()
        local_lease = await gate.acquire(deadline=5)  # granted under the local bound
        assert local_lease.local and fleet.fallback_active
        own_redis.start()  # empty: the fleet lease is gone from Redis
        await _wait(lambda: not fleet.fallback_active, 5)
        holders = set(await fleet.redis.zrange(gate.keys.holders, 0, -1))
        assert holders == {fleet_lease.id, local_lease.id}
        assert not local_lease.local
        # Both slots of the cap are taken by running work: a newcomer parks.
        newcomer = asyncio.create_task(gate.acquire(deadline=5))
        await asyncio.sleep(0.3)
        assert not newcomer.done()
        await local_lease.release()
        lease = await asyncio.wait_for(newcomer, 2)
        await lease.release()
        await fleet_lease.release()
        await fleet.flush()
        assert await fleet.redis.zcard(gate.keys.holders) == 0
        assert not fleet_lease.is_lost


@pytest.mark.parametrize(
    ("exc", "cause"),
    [
        # redis-py's cluster client raises it without text: logged "unreachable ()" before
        (MaxConnectionsError(), "(MaxConnectionsError)"),
        (ConnectionError("Connection refused."), "(ConnectionError: Connection refused.)"),
    ],
)
async def test_outage_lines_name_the_cause(
    rut: RedisUnderTest, caplog: pytest.LogCaptureFixture, exc: Exception, cause: str
) -> None:
    """The fallback's line and the fail mode's error name the error's type, also when it has
    no text (never "Redis ... unreachable (): serving with local fair-share bounds", which
    says nothing of why)."""
    async with Fleet(
        rut.url, prefix=rut.prefix, registry=CollectorRegistry(), heartbeat_interval=0.2
    ) as fleet:
        fleet.gate("cause", floor=1)
        with caplog.at_level(logging.WARNING, logger="fleetgate.client"):
            fleet.runtime.redis_failed(exc)  # what a failed script call does
        [line] = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
        assert f"unreachable {cause}: serving with local fair-share bounds" in line
        assert cause[1:-1] in str(fleet.runtime.unreachable(exc))  # the fail mode's error
        await _wait(lambda: not fleet.fallback_active, 5)  # the probe finds Redis up


@pytest.mark.slow
def test_pods_starting_during_an_outage_take_one_permit_each(
    own_redis: RedisProcess, rut: RedisUnderTest
) -> None:
    """4 pods, limit 4, Redis down before any heartbeat: each pod's share is 1, not the limit.

    A pod with no live-pod count taking the whole limit locally would run 16.
    """
    own_redis.kill()
    probe = f"{rut.prefix}:probe"
    peaks = _workers.run_pods(
        4,
        url=own_redis.url,
        prefix="fg",
        gate="outage",
        probe_url=rut.url,
        probe=probe,
        tasks=6,
        loops=2,
        hold_s=0.2,
        floor=4,
        barrier=(f"{rut.prefix}:ready", 4),
    )
    print(f"[fault] outage start: peak {max(peaks)} under limit 4 (pods' peaks {peaks})")
    assert max(peaks) <= 4, f"{max(peaks)} running under a limit of 4 (pods' peaks {peaks})"


async def test_live_pod_count_is_trusted_after_one_registration_period(
    own_redis: RedisProcess,
) -> None:
    async with Fleet(own_redis.url, registry=CollectorRegistry(), heartbeat_interval=0.2) as fleet:
        gate = fleet.gate("trust", floor=4)
        await _wait(lambda: gate.registered_at is not None, 2, "the pod registers")
        # Registered, but not a full period ago: the count may miss peers starting now.
        assert gate.last_live_pods == 0 and gate.fair_share() == 1
        await _wait(lambda: gate.last_live_pods == 1, 3, "the count becomes trusted")
        assert gate.fair_share() == 4
        # Another pod appears: counted after the next beats.
        async with Fleet(
            own_redis.url, registry=CollectorRegistry(), heartbeat_interval=0.2
        ) as other:
            other.gate("trust", floor=4)
            await _wait(lambda: gate.last_live_pods == 2, 3, "the peer is counted")
            assert gate.fair_share() == 2


@pytest.mark.parametrize(
    ("refusal", "heal"),
    [
        (["--maxmemory", "1"], ("CONFIG", "SET", "maxmemory", "0")),
        (["--replicaof", "127.0.0.1", "1"], ("REPLICAOF", "NO", "ONE")),
    ],
    ids=["oom", "readonly"],
)
async def test_pod_resumes_after_redis_refused_writes(
    own_redis: RedisProcess, refusal: list[str], heal: tuple[str, ...]
) -> None:
    """Redis returns from an outage refusing writes (OOM, READONLY), then heals.

    The refusal (a ResponseError) is an outage to the probe, not its end: were it to end the
    probe task during adoption, the pod would stay in fallback for good, every acquire bound by
    the local share, even once Redis was healthy.
    """
    async with Fleet(own_redis.url, registry=CollectorRegistry(), heartbeat_interval=0.2) as fleet:
        gate = fleet.gate("wedge", floor=2)
        running = await gate.acquire()
        own_redis.kill()
        await _wait(lambda: fleet.fallback_active, 5, "the pod falls back")
        own_redis.extra_args = refusal
        own_redis.start()
        await asyncio.sleep(1.0)  # several probes meet the refusal
        assert fleet.fallback_active, "a refusal to write is an outage, not fleet mode"
        admin = aredis.Redis.from_url(own_redis.url)
        await admin.execute_command(*heal)
        await admin.aclose()
        healed = time.monotonic()
        await _wait(lambda: not fleet.fallback_active, 5, "fleet mode resumes")
        print(f"[fault] refused writes: fleet mode {time.monotonic() - healed:.2f} s after heal")
        assert await fleet.redis.zrange(gate.keys.holders, 0, -1) == [running.id]  # adopted
        async with gate.permit(deadline=5) as lease:
            assert not lease.local
            assert await fleet.redis.zcard(gate.keys.holders) == 2
        await running.release()


async def _holders_until_empty(fleet: Fleet, key: str, timeout: float) -> list[str]:
    """The gate's holders once empty, or as they are ``timeout`` s from now."""
    end = time.monotonic() + timeout
    while True:
        held = list(await fleet.redis.zrange(key, 0, -1))
        if not held or time.monotonic() > end:
            return held
        await asyncio.sleep(0.02)


async def test_fleet_lease_released_during_adoption_is_given_back(
    own_redis: RedisProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fleet lease held through an outage is released while the adoption that counts it
    again is in flight, and its release reaches Redis first: the adoption adds it back.

    Were it not given back, nobody would hold its slot until its lease TTL (a slot migration
    on Cluster: every slot in use again only ~lease_ms after the slot moved,
    tests/chaos/test_cluster_faults.py::test_slot_migration_under_load).
    """
    async with Fleet(own_redis.url, registry=CollectorRegistry(), heartbeat_interval=0.2) as fleet:
        gate = fleet.gate("adopt-race", floor=2, lease_ms=30_000)
        lease = await gate.acquire()
        assert not lease.local
        scripts = fleet.runtime.scripts
        adopt = scripts.adopt
        raced = False

        async def release_then_adopt(*args: Any, **kwargs: Any) -> Any:
            nonlocal raced
            if not raced:  # the release overtakes the adoption in flight
                raced = True
                await lease.release()
                await gate.flush()
                assert await fleet.redis.zcard(gate.keys.holders) == 0
            return await adopt(*args, **kwargs)

        monkeypatch.setattr(scripts, "adopt", release_then_adopt)
        fleet.runtime.redis_failed(ConnectionError("a slot migrating"))  # a failed script call
        await _wait(lambda: not fleet.fallback_active, 5, "fleet mode resumes")
        assert raced
        assert await _holders_until_empty(fleet, gate.keys.holders, 2.0) == []


async def test_local_permit_given_back_after_adoption_is_retried(
    own_redis: RedisProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A local permit ends while the adoption that counts it as a fleet lease is in flight,
    and the call that gives the fresh lease back meets Redis unavailable once: it is sent
    again once Redis answers, not left to its lease TTL."""
    async with Fleet(own_redis.url, registry=CollectorRegistry(), heartbeat_interval=0.2) as fleet:
        gate = fleet.gate("adopt-give-back", floor=2, lease_ms=30_000)
        async with gate.permit():
            pass
        await _wait(lambda: gate.last_live_pods == 1, 3, "the pod registers")
        fleet.runtime.redis_failed(ConnectionError("a slot migrating"))
        local = await gate.acquire(deadline=5)  # before the first probe (0.2 s)
        assert local.local
        scripts = fleet.runtime.scripts
        adopt = scripts.adopt
        refusals = 0

        def refuse_once(name: str) -> None:
            real = getattr(scripts, name)

            async def call(*args: Any, **kwargs: Any) -> Any:
                nonlocal refusals
                if armed and refusals == 0:
                    refusals += 1
                    raise ConnectionError("Redis unavailable once")
                return await real(*args, **kwargs)

            monkeypatch.setattr(scripts, name, call)

        armed = False
        for name in ("release", "release_many", "cancel"):
            refuse_once(name)

        async def release_then_adopt(*args: Any, **kwargs: Any) -> Any:
            nonlocal armed
            if not armed:
                await local.release()  # ends under the local bound: the adoption still counts it
                armed = True
            return await adopt(*args, **kwargs)

        monkeypatch.setattr(scripts, "adopt", release_then_adopt)
        await _wait(lambda: not fleet.fallback_active, 5, "fleet mode resumes")
        assert armed
        assert await _holders_until_empty(fleet, gate.keys.holders, 2.0) == []
        assert refusals == 1


async def test_a_broken_registry_does_not_keep_the_pod_in_fallback(own_redis: RedisProcess) -> None:
    """The probe's write (an SADD to the registry) meets a key of the wrong type: an answer,
    not a refusal, so the pod adopts and resumes fleet mode (the heartbeat never lets a broken
    registry stop renewals either)."""
    async with Fleet(own_redis.url, registry=CollectorRegistry(), heartbeat_interval=0.2) as fleet:
        gate = fleet.gate("broken-registry", floor=2, lease_ms=30_000)
        lease = await gate.acquire()
        await fleet.redis.delete(f"{fleet.prefix}:gates")
        await fleet.redis.set(f"{fleet.prefix}:gates", "not a set")
        fleet.runtime.redis_failed(ConnectionError("a cut link"))
        assert fleet.fallback_active
        await _wait(lambda: not fleet.fallback_active, 5, "fleet mode resumes")
        assert await fleet.redis.zscore(gate.keys.holders, lease.id) is not None  # adopted
        await lease.release()
