"""The cap under faults an adversarial review found (issue "the cap holds under every fault").

Each test reproduced a defect on the code before its fix (the figure in the comment) and guards
the fix: over-admission paths across several OS processes, a pod wedged after an outage,
hand-off to dead waiters, fencing tokens that went backwards, raw Redis errors.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ProcessPoolExecutor

import pytest
import redis
import redis.asyncio as aredis
from prometheus_client import CollectorRegistry

from fleetgate._redis import ServerUnavailable, unavailable_reply
from fleetgate.client import Fleet, GateStateError
from fleetgate.keys import GateKeys
from fleetgate.scripts import PARKED, GateScripts
from fleetgate.settings import GateSettings
from fleetgate.tools.redisproc import RedisProcess

from . import _workers
from .conftest import RedisUnderTest

SPAWN = multiprocessing.get_context("spawn")


def _run_pods(n: int, **kwargs: object) -> list[int]:
    """Run ``n`` hammer_with processes with the same arguments; their probe peaks."""
    with ProcessPoolExecutor(n, mp_context=SPAWN) as ex:
        futs = [ex.submit(_workers.hammer_with, **kwargs) for _ in range(n)]  # type: ignore[arg-type]
        return [f.result(timeout=120) for f in futs]


async def _wait(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise TimeoutError(f"not within {timeout}s: {what}")
        await asyncio.sleep(0.02)


@pytest.fixture
async def r(own_redis: RedisProcess) -> AsyncIterator[aredis.Redis]:
    client = aredis.Redis.from_url(own_redis.url, decode_responses=True)
    yield client
    await client.aclose()


# ----------------------------------------------------------------- 1. fair share, unknown pods


@pytest.mark.slow
def test_pods_starting_during_an_outage_take_one_permit_each(
    own_redis: RedisProcess, rut: RedisUnderTest
) -> None:
    """4 pods, limit 4, Redis down before any heartbeat: each pod's share is 1, not the limit.

    Before the fix a pod with no live-pod count took the whole limit locally: 16 running.
    """
    own_redis.kill()
    probe = f"{rut.prefix}:probe"
    peaks = _run_pods(
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


# ---------------------------------------------------------------- 2. first renewal in time


@pytest.mark.slow
def test_short_lease_from_the_gate_config_is_renewed_from_the_first_grant(
    rut: RedisUnderTest, sync_redis: redis.Redis
) -> None:
    """The coordinator's config says lease_ms=300; clients beat every 1 s by default.

    Before the fix the first renewal was paced by the client's default TTL: the holder's lease
    lapsed after 300 ms and a second process was granted while it still ran (2 under limit 1).
    """
    keys = GateKeys.of(rut.prefix, "short")
    sync_redis.hset(
        keys.cfg,
        mapping={"floor": 1, "ceiling": 1, "max_queued": 10, "lease_ms": 300, "waiter_ms": 1000},
    )
    probe = f"{rut.prefix}:probe"
    common = dict(url=rut.url, prefix=rut.prefix, gate="short", probe_url=rut.url, probe=probe)
    with ProcessPoolExecutor(2, mp_context=SPAWN) as ex:
        holder = ex.submit(_workers.hammer_with, **common, hold_s=2.0)  # type: ignore[arg-type]
        other = ex.submit(_workers.hammer_with, **common, hold_s=0.1, after_probe=1)  # type: ignore[arg-type]
        peaks = [holder.result(timeout=60), other.result(timeout=60)]
    print(f"[fault] lease_ms 300 from the config: peak {max(peaks)} under limit 1")
    assert max(peaks) == 1, f"{max(peaks)} running under a limit of 1"
    assert int(sync_redis.hget(keys.stats, "expired_leases") or 0) == 0


# ------------------------------------------------------------------- 3. a shared pod_id


@pytest.mark.slow
def test_processes_sharing_a_pod_id_keep_the_cap(
    rut: RedisUnderTest, sync_redis: redis.Redis
) -> None:
    """Two processes given the same pod_id ($HOSTNAME with two workers), limit 2.

    Before the fix both minted the same lease ids and shared holder entries: 3 running.
    """
    peaks = _run_pods(
        2,
        url=rut.url,
        prefix=rut.prefix,
        gate="shared-id",
        probe_url=rut.url,
        probe=f"{rut.prefix}:probe",
        tasks=4,
        loops=25,
        hold_s=0.02,
        pod_id="worker",
        floor=2,
        barrier=(f"{rut.prefix}:ready", 2),
    )
    print(f"[fault] shared pod_id: peak {max(peaks)} under limit 2")
    assert max(peaks) <= 2, f"{max(peaks)} running under a limit of 2"
    keys = GateKeys.of(rut.prefix, "shared-id")
    assert sync_redis.zcard(keys.holders) == 0 and sync_redis.zcard(keys.waiters) == 0


async def test_pod_key_is_unique_per_process_whatever_the_label(own_redis: RedisProcess) -> None:
    async with (
        Fleet(own_redis.url, pod_id="worker", registry=CollectorRegistry()) as a,
        Fleet(own_redis.url, pod_id="worker", registry=CollectorRegistry()) as b,
    ):
        assert a.pod_id == b.pod_id == "worker"
        assert a.pod_key != b.pod_key and a.pod_key.startswith("worker")
        la, lb = await a.gate("g", floor=2).acquire(), await b.gate("g", floor=2).acquire()
        assert la.id != lb.id
        assert await a.redis.zcard(a.gate("g").keys.holders) == 2
        await la.release()
        await lb.release()


# ------------------------------------------- 4. a wiped gate: adopt, never "lost" (script level)


async def test_heartbeat_adopts_leases_the_gate_lost_before_they_expired(
    r: aredis.Redis,
) -> None:
    scripts = GateScripts(r)
    keys = GateKeys.of("fg", "wiped")
    d = GateSettings(floor=2, ceiling=2, lease_ms=5000)
    a = await scripts.acquire(keys, "p:1", 1000, d)
    b = await scripts.acquire(keys, "p:2", 1000, d)
    await r.flushall()  # a restart without persistence
    await asyncio.sleep(0.005)  # the renewal below must land in a later millisecond than the grant
    hb = await scripts.heartbeat(
        keys, "p", 10_000, [("p:1", a.expires_at), ("p:2", 0)], [], max_token=b.token, defaults=d
    )
    # p:1 was seen renewed to a time still ahead: the gate lost it, so it counts again. p:2's
    # expiry is unknown to the pod: reported lost (it may have expired).
    assert hb.adopted == ["p:1"] and hb.lost_leases == ["p:2"]
    assert await r.zrange(keys.holders, 0, -1) == ["p:1"]
    assert hb.pod_new and hb.expires_at > a.expires_at
    # A lease whose renewal time has passed is lost, never revived.
    await asyncio.sleep(0.05)
    past = await scripts.heartbeat(keys, "p", 10_000, [("p:3", 1)], [], defaults=d)
    assert past.lost_leases == ["p:3"] and past.adopted == []


# ----------------------------------------------------------- 5. no wedge after an outage


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

    Before the fix the refusal (a ResponseError) ended the probe task during adoption: the pod
    stayed in fallback for good, every acquire bound by the local share, even once Redis was
    healthy.
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


@pytest.mark.parametrize(
    "message",
    [
        "MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist",
        "BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSCRIPT.",
        "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
        "LOADING Redis is loading the dataset in memory",
    ],
)
def test_replies_that_mean_cannot_serve_now_are_outages(message: str) -> None:
    assert unavailable_reply(redis.ResponseError(message))
    assert issubclass(ServerUnavailable, redis.ConnectionError)


def test_data_errors_are_not_outages() -> None:
    assert not unavailable_reply(redis.ResponseError("WRONGTYPE Operation against a key"))
    assert not unavailable_reply(redis.ResponseError("BUSYKEY Target key name already exists"))
    assert unavailable_reply(redis.exceptions.ReadOnlyError("You can't write"))
    assert unavailable_reply(redis.exceptions.OutOfMemoryError("command not allowed"))


# ----------------------------------------------------------- 7. hand-off skips dead heads


async def test_handoff_skips_waiters_that_died_beyond_one_reap(r: aredis.Redis) -> None:
    """100 parked waiters die at once (more than one reap removes), then a slot frees.

    Before the fix the slot went to a dead head and sat idle for a lease TTL.
    """
    scripts = GateScripts(r)
    keys = GateKeys.of("fg", "dead-heads")
    d = GateSettings(floor=1, ceiling=1, max_queued=1000)
    assert (await scripts.acquire(keys, "holder:1", 1000, d)).status == 1
    for i in range(100):
        assert (await scripts.acquire(keys, f"dead:{i}", 100, d)).status == PARKED
    assert (await scripts.acquire(keys, "live:1", 60_000, d)).status == PARKED
    await asyncio.sleep(0.2)  # every dead waiter's entry has expired
    assert await scripts.release(keys, "holder:1")
    assert await r.zrange(keys.holders, 0, -1) == ["live:1"]
    [wake] = await r.lrange(keys.wake("live"), 0, -1)
    assert wake.partition("=")[0] == "live:1"  # <id>=<token>
    assert await r.zcard(keys.waiters) == 0 and await r.zcard(keys.waiters) == 0
    assert int(await r.hget(keys.stats, "abandoned_waiters") or 0) == 100


# -------------------------------------------------------- 8. fencing tokens never go back


async def test_tokens_stay_monotonic_across_a_redis_restart(own_redis: RedisProcess) -> None:
    """Before the fix the counter restarted at 1 while adopted leases held tokens up to 3."""
    async with Fleet(own_redis.url, registry=CollectorRegistry(), heartbeat_interval=0.2) as fleet:
        gate = fleet.gate("tokens", floor=4)
        held = [await gate.acquire() for _ in range(3)]
        top = max(lease.token for lease in held)
        own_redis.kill()
        own_redis.start()  # empty
        await asyncio.sleep(0.6)  # the pod meets the restart (fallback, or a heartbeat)
        await _wait(lambda: not fleet.fallback_active, 5, "fleet mode")
        fresh = await gate.acquire(deadline=5)
        assert fresh.token > top
        for lease in (*held, fresh):
            await lease.release()


async def test_tokens_stay_monotonic_after_the_counter_rolls_back(
    own_redis: RedisProcess, r: aredis.Redis
) -> None:
    """A lossy failover keeps the gate but rolls its counter back below held tokens."""
    async with Fleet(own_redis.url, registry=CollectorRegistry(), heartbeat_interval=0.2) as fleet:
        gate = fleet.gate("rollback", floor=4)
        held = [await gate.acquire() for _ in range(3)]
        await r.set(gate.keys.seq, 1)
        await asyncio.sleep(0.5)  # the holder's next heartbeat raises the counter again
        fresh = await gate.acquire(deadline=5)
        assert fresh.token > max(lease.token for lease in held)
        for lease in (*held, fresh):
            await lease.release()


# ---------------------------------------------------------- 12. data errors name the key


async def test_wrong_type_is_a_gate_state_error_naming_gate_and_key(
    own_redis: RedisProcess, r: aredis.Redis
) -> None:
    name = f"broken-{uuid.uuid4().hex[:6]}"
    keys = GateKeys.of("fg", name)
    await r.set(keys.holders, "x")
    async with Fleet(own_redis.url, registry=CollectorRegistry()) as fleet:
        with pytest.raises(GateStateError) as err:
            async with fleet.gate(name).permit(deadline=2):
                pass
        assert err.value.gate == name and err.value.keys and keys.holders in err.value.keys[0]
        assert name in str(err.value) and keys.holders in str(err.value)
        assert not fleet.fallback_active  # a data error is not an outage
