"""Redis going away: the fair-share fallback and the fail mode (a private server we kill)."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from prometheus_client import CollectorRegistry
from redis.exceptions import ConnectionError, MaxConnectionsError

from fleetgate.client import Fleet, RedisUnavailable
from fleetgate.tools.redisproc import RedisProcess

from ..conftest import RedisUnderTest


async def _wait(predicate, timeout: float) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise TimeoutError("condition not met")
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
    no text (issue 21 item 5: "Redis ... unreachable (): serving with local fair-share
    bounds", 12 times, said nothing of why)."""
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
