"""Hostile state planted in Redis, seen from the client: keys of the wrong type or garbled
values give the caller a prompt error naming the gate and the key, or the documented fallback
(never a hung caller), and deleting the bad key heals the gate at once. The coordinator's side
is ``tests/coordinator/test_hostile_state.py``."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import redis.asyncio as aredis
from prometheus_client import CollectorRegistry

from fleetgate.client import Fleet, GateStateError
from fleetgate.keys import GateKeys
from fleetgate.safety import find_bad_keys
from fleetgate.tools.redisproc import RedisProcess

pytestmark = pytest.mark.usefixtures("no_gc_during_test")


@pytest.fixture
async def r(own_redis: RedisProcess) -> AsyncIterator[aredis.Redis]:
    client = aredis.Redis.from_url(own_redis.url, decode_responses=True)
    yield client
    await client.aclose()


async def _acquire_outcome(fleet: Fleet, gate: str) -> str:
    """What one acquire does within 3 s: 'granted', or the exception's class and message."""
    start = time.monotonic()
    try:
        async with asyncio.timeout(3):
            async with fleet.gate(gate, floor=2).permit(deadline=2.0):
                pass
        outcome = "granted"
    except TimeoutError as exc:
        outcome = f"HUNG {exc!r}"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    assert time.monotonic() - start < 2.5, f"caller held for {time.monotonic() - start:.1f}s"
    return outcome


Plant = Callable[[aredis.Redis, GateKeys], Awaitable[object]]
PLANTS: dict[str, tuple[str, Plant]] = {
    "holders-as-string": ("holders", lambda r, k: r.set(k.holders, "x")),
    "waiters-as-hash": ("waiters", lambda r, k: r.hset(k.waiters, "a", "1")),
    "cfg-as-list": ("cfg", lambda r, k: r.rpush(k.cfg, "floor", "4")),
    "seq-as-set": ("seq", lambda r, k: r.sadd(k.seq, "1")),
    "target-as-string": ("target", lambda r, k: r.set(k.target, "9")),
}


@pytest.mark.parametrize("plant", sorted(PLANTS))
async def test_wrong_type_gives_the_caller_a_prompt_error(
    own_redis: RedisProcess, r: aredis.Redis, plant: str, caplog: pytest.LogCaptureFixture
) -> None:
    attr, do = PLANTS[plant]
    keys = GateKeys.of("fg", "g")
    await do(r, keys)
    async with Fleet(own_redis.url, registry=CollectorRegistry(), heartbeat_interval=0.2) as fleet:
        outcome = await _acquire_outcome(fleet, "g")
        # A FleetgateError that names the gate and the key (it was redis-py's ResponseError,
        # verbatim, naming neither); find_bad_keys (the coordinator's log, `fleetgate check`)
        # names it too.
        assert outcome.startswith("GateStateError: gate 'g'"), outcome
        assert getattr(keys, attr) in outcome and "WRONGTYPE" in outcome, outcome
        findings = await find_bad_keys(r, "fg", ["g"])
        assert [f.code for f in findings] == ["wrong_type"]
        assert getattr(keys, attr) in findings[0].message and "DEL" in findings[0].message
        # Deleting the key heals the gate at once.
        await r.delete(getattr(keys, attr))
        assert await _acquire_outcome(fleet, "g") == "granted"


async def test_broken_registry_does_not_stop_lease_renewal(
    own_redis: RedisProcess, r: aredis.Redis
) -> None:
    await r.set("fg:gates", "x")
    async with Fleet(own_redis.url, registry=CollectorRegistry(), heartbeat_interval=0.1) as fleet:
        gate = fleet.gate("g", floor=1, lease_ms=500, waiter_ms=500)
        lease = await gate.acquire()
        await asyncio.sleep(1.5)  # three lease lifetimes
        held = await r.zscore(GateKeys.of("fg", "g").holders, lease.id)
        renewed = held is not None and held > time.time() * 1000
        await lease.release()
    assert renewed or lease.is_lost, "the lease lapsed silently: the cap no longer counts it"


async def test_garbled_cfg_falls_back_to_safe_values(
    own_redis: RedisProcess, r: aredis.Redis
) -> None:
    """Non-numbers in cfg: the documented fallback, the safe value of each field (the gate is
    configured, so the caller's floor=2 is not read: every script applies the same values)."""
    keys = GateKeys.of("fg", "g")
    await r.hset(keys.cfg, mapping={"floor": "abc", "ceiling": "", "max_queued": "nan"})
    async with Fleet(own_redis.url, registry=CollectorRegistry()) as fleet:
        assert await _acquire_outcome(fleet, "g") == "granted"
        snap = await fleet.gate("g").snapshot()
        assert (snap.floor, snap.max_queued, snap.ceiling) == (1, 1000, 512)
    findings = await find_bad_keys(r, "fg", ["g"])
    assert sorted(f.message.split()[2].split("=")[0] for f in findings) == [
        "ceiling",
        "floor",
        "max_queued",
    ]


async def _grants_within(fleet: Fleet, gate: str, n: int) -> int:
    """How many of ``n`` concurrent permits of a floor-2 gate are granted within 0.5 s."""
    g = fleet.gate(gate, floor=2, ceiling=2)
    leases = []
    for _ in range(n):
        try:
            leases.append(await g.acquire(deadline=0.3))
        except Exception:
            break
    for lease in leases:
        await lease.release()
    return len(leases)


@pytest.mark.parametrize("value", ["inf", "1e400", "-inf", "nan"])
async def test_non_finite_cfg_falls_back(
    own_redis: RedisProcess, r: aredis.Redis, value: str
) -> None:
    """lua/lib_gate.lua's num() ignores NaN and infinities (Lua's tonumber accepts 'inf' and
    '1e400'): the cap holds and leases still expire."""
    keys = GateKeys.of("fg", "g")
    await r.hset(keys.cfg, mapping={"floor": value, "lease_ms": value})
    async with Fleet(own_redis.url, registry=CollectorRegistry()) as fleet:
        granted = await _grants_within(fleet, "g", 4)
        lease = await fleet.gate("g").acquire(deadline=1)
        expiry = await r.zscore(keys.holders, lease.id)
        await lease.release()
    assert granted <= 2, f"floor={value} in cfg lifted the cap: {granted} of 4 granted"
    assert expiry is not None and expiry < time.time() * 1000 + 3_600_000, "a lease forever"


async def test_absurd_finite_cfg_falls_back(own_redis: RedisProcess, r: aredis.Redis) -> None:
    keys = GateKeys.of("fg", "g")
    await r.hset(keys.cfg, mapping={"floor": "1e18", "lease_ms": "1e18"})
    async with Fleet(own_redis.url, registry=CollectorRegistry()) as fleet:
        granted = await _grants_within(fleet, "g", 4)
        lease = await fleet.gate("g").acquire(deadline=1)
        expiry = await r.zscore(keys.holders, lease.id)
        await lease.release()
    assert granted <= 2 and expiry is not None and expiry < time.time() * 1000 + 86_400_000


async def test_nan_target_falls_back_to_the_floor(own_redis: RedisProcess, r: aredis.Redis) -> None:
    keys = GateKeys.of("fg", "g")
    await r.hset(keys.target, mapping={"value": "nan", "epoch": "1", "expires_at": "1e15"})
    async with Fleet(own_redis.url, registry=CollectorRegistry()) as fleet:
        assert await _acquire_outcome(fleet, "g") == "granted"


async def test_garbled_cfg_is_reported_and_never_hangs(
    own_redis: RedisProcess, r: aredis.Redis
) -> None:
    """Callers are answered at once, and ``find_bad_keys`` (coordinator log, ``fleetgate
    check``) names the field."""
    keys = GateKeys.of("fg", "g")
    await r.hset(keys.cfg, mapping={"floor": "1e400"})
    async with Fleet(own_redis.url, registry=CollectorRegistry()) as fleet:
        outcome = await _acquire_outcome(fleet, "g")
    assert outcome == "granted" or outcome.startswith("GateStateError"), outcome
    [finding] = await find_bad_keys(r, "fg", ["g"])
    assert "floor='1e400' is not finite" in finding.message


# ------------------------------------------------------------- the coordinator keeps running


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
