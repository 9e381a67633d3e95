"""fleetgate.testing: the public client API on an in-process fakeredis fleet.

No test here starts or dials a Redis server: every connection attempt fails the test (see the
``no_sockets`` fixture), so these pass only if every command the fleet sends -- the gate scripts
on fakeredis' Lua, the wake listener's blocking pop, the heartbeat -- is served in memory.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from fakeredis import FakeServer
from prometheus_client import CollectorRegistry

from fleetgate.admission import member_id
from fleetgate.client import (
    ConfigError,
    DeadlineExceeded,
    Fleet,
    Overloaded,
    get_utilization,
    map_concurrent,
    map_concurrent_sync,
    resolve_capacity,
)
from fleetgate.client import compat as _compat
from fleetgate.testing import (
    FAKE_URL,
    fake_default_fleet,
    fake_fleet,
    fake_sync_fleet,
    set_target,
)


@pytest.fixture(autouse=True)
def no_sockets(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any real connection (TCP or unix socket) fails the test."""

    async def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"a fake fleet opened a real connection: {args} {kwargs}")

    monkeypatch.setattr(asyncio, "open_connection", refuse)
    monkeypatch.setattr(asyncio, "open_unix_connection", refuse)


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
async def fleet(registry: CollectorRegistry) -> AsyncIterator[Fleet]:
    # A heartbeat far slower than any test: a hand-off seen within a test came by the wake
    # listener's blocking pop, not by a heartbeat that recovers lost wake-ups.
    async with fake_fleet(registry=registry, heartbeat_interval=30.0) as f:
        yield f


async def test_permit_acquire_release(fleet: Fleet) -> None:
    assert fleet.url == FAKE_URL
    gate = fleet.gate("bge-m3", floor=2)
    async with gate.permit(deadline=5.0) as a, gate.permit() as b:
        assert a.id != b.id and b.token > a.token
        assert await fleet.redis.zcard(gate.keys.holders) == 2
    await fleet.flush()
    assert await fleet.redis.zcard(gate.keys.holders) == 0
    lease = await gate.acquire(deadline=None)
    assert not lease.is_lost
    await lease.release()
    await lease.release()  # idempotent
    await fleet.flush()
    assert await fleet.redis.zcard(gate.keys.holders) == 0
    assert await gate.capacity() == 2


async def test_cap_holds_among_tasks(fleet: Fleet) -> None:
    gate = fleet.gate("capped", floor=3)
    running = peak = done = 0

    async def call() -> None:
        nonlocal running, peak, done
        async with gate.permit(deadline=10.0):
            running += 1
            peak = max(peak, running)
            await asyncio.sleep(0.01)
            running -= 1
            done += 1

    started = time.monotonic()
    await asyncio.gather(*(call() for _ in range(30)))
    assert (peak, done) == (3, 30)
    # 10 rounds of hand-offs, each by the wake listener (the heartbeat is 30 s away).
    assert time.monotonic() - started < 5.0
    await fleet.flush()
    assert await fleet.redis.zcard(gate.keys.holders) == 0


async def test_fifo_handoff_to_parked_caller(fleet: Fleet) -> None:
    gate = fleet.gate("fifo", floor=1)
    first = await gate.acquire()
    order: list[int] = []

    async def worker(i: int) -> None:
        async with gate.permit(deadline=10.0):
            order.append(i)
            await asyncio.sleep(0.005)

    tasks = []
    for i in range(5):
        tasks.append(asyncio.create_task(worker(i)))
        await asyncio.sleep(0.02)  # park in a known order
    assert (await fleet.utilization("fifo")).queued == 5
    started = time.monotonic()
    await first.release()
    await asyncio.wait_for(asyncio.gather(*tasks), 5.0)
    assert order == [0, 1, 2, 3, 4]
    assert time.monotonic() - started < 2.0


async def test_overloaded_when_queue_full(fleet: Fleet, registry: CollectorRegistry) -> None:
    gate = fleet.gate("small", floor=1, max_queued=1)
    held = await gate.acquire()
    parked = asyncio.create_task(gate.acquire(deadline=5.0))
    await asyncio.sleep(0.05)
    called = False
    with pytest.raises(Overloaded, match="wait list is full"):
        async with gate.permit():
            called = True
    assert not called
    labels = {"gate": "small", "priority": "0", "tenant": ""}  # the default class
    assert registry.get_sample_value("fleetgate_client_rejected_total", labels) == 1
    await held.release()
    lease = await asyncio.wait_for(parked, 5.0)
    await lease.release()


async def test_deadline_exceeded_while_parked(fleet: Fleet) -> None:
    gate = fleet.gate("slow", floor=1)
    held = await gate.acquire()
    with pytest.raises(DeadlineExceeded, match="150 ms") as err:
        async with gate.permit(deadline=0.15):
            pytest.fail("must not run")
    assert isinstance(err.value, TimeoutError)
    util = await fleet.utilization("slow")
    assert (util.in_flight, util.queued) == (1, 0)
    await held.release()


async def test_cancel_while_parked_leaves_the_queue(fleet: Fleet) -> None:
    gate = fleet.gate("cancel", floor=1)
    held = await gate.acquire()
    task = asyncio.create_task(gate.acquire(deadline=10.0))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (await fleet.utilization("cancel")).queued == 0
    await held.release()
    assert (await fleet.utilization("cancel")).in_flight == 0


async def test_gate_map(fleet: Fleet) -> None:
    gate = fleet.gate("map", floor=2)
    running = peak = 0

    async def double(x: int) -> int:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.01)
        running -= 1
        return 2 * x

    assert await gate.map(double, range(10), max_in_flight=8, deadline=10.0) == [
        2 * x for x in range(10)
    ]
    assert peak == 2
    await fleet.flush()
    assert await fleet.redis.zcard(gate.keys.holders) == 0


async def test_utilization(fleet: Fleet) -> None:
    gate = fleet.gate("u", floor=3, ceiling=10, max_queued=7)
    async with gate.permit():
        util = await fleet.utilization("u")
    assert (util.limit, util.in_flight, util.queued) == (3, 1, 0)
    assert (util.floor, util.ceiling, util.max_queued) == (3, 10, 7)
    assert util.target is None


async def test_set_target_grows_the_limit_and_hands_off(fleet: Fleet) -> None:
    gate = fleet.gate("grow", floor=1, ceiling=4)
    held = await gate.acquire()
    parked = asyncio.create_task(gate.acquire(deadline=5.0))
    await asyncio.sleep(0.05)
    assert await set_target(fleet, "grow", 10) == 4  # clamped to the ceiling
    lease = await asyncio.wait_for(parked, 2.0)
    util = await fleet.utilization("grow")
    assert (util.limit, util.target, util.in_flight) == (4, 10, 2)
    await lease.release()
    await held.release()
    with pytest.raises(ConfigError):
        await set_target(fleet, "grow", 0)


async def test_lease_renewed_past_its_ttl(fleet: Fleet) -> None:
    # Renewals are paced by the TTL (every lease_ms / 3), whatever heartbeat_interval says.
    gate = fleet.gate("renew", floor=1, lease_ms=300)
    async with gate.permit(deadline=None) as lease:
        await asyncio.sleep(0.8)
        assert not lease.is_lost
        assert await fleet.redis.zscore(gate.keys.holders, lease.id) is not None


async def test_lost_wakeup_recovered_by_heartbeat() -> None:
    async with fake_fleet(heartbeat_interval=0.1) as fleet:
        gate = fleet.gate("w", floor=1)
        held = await gate.acquire()
        task = asyncio.create_task(gate.acquire(deadline=10.0))
        await asyncio.sleep(0.05)
        [waiter_id] = [member_id(m) for m in await fleet.redis.zrange(gate.keys.lanes, 0, -1)]
        # Grant by hand, bypassing the client, and drop the wake message.
        await fleet.scripts.release(gate.keys, held.id)
        await fleet.redis.delete(gate.keys.wake(fleet.pod_key))
        lease = await asyncio.wait_for(task, 2.0)
        assert lease.id == waiter_id
        await lease.release()
        await held.release()


async def test_two_fleets_on_one_server_share_the_limit() -> None:
    server = FakeServer()
    async with (
        fake_fleet(server=server, heartbeat_interval=30.0) as pod_a,
        fake_fleet(server=server, heartbeat_interval=30.0) as pod_b,
    ):
        a, b = pod_a.gate("shared", floor=2), pod_b.gate("shared", floor=2)
        running = peak = 0

        async def call(gate: Any) -> None:
            nonlocal running, peak
            async with gate.permit(deadline=10.0):
                running += 1
                peak = max(peak, running)
                await asyncio.sleep(0.01)
                running -= 1

        await asyncio.gather(*(call(a if i % 2 else b) for i in range(20)))
        assert peak == 2
        assert (await pod_a.utilization("shared")).live_pods == 2


async def test_sync_and_async_fleets_share_a_server() -> None:
    server = FakeServer()
    async with fake_fleet(server=server, heartbeat_interval=30.0) as pod_a:
        with fake_sync_fleet(server=server, heartbeat_interval=30.0) as pod_b:
            a, b = pod_a.gate("x", floor=1), pod_b.gate("x", floor=1)
            held = await a.acquire()
            parked = asyncio.ensure_future(asyncio.to_thread(b.acquire, 5.0))
            await asyncio.sleep(0.1)
            await held.release()  # hands off to the other loop's parked caller
            lease = await asyncio.wait_for(parked, 2.0)
            assert (await pod_a.utilization("x")).in_flight == 1
            await asyncio.to_thread(b.release, lease)


async def test_fake_fleets_are_isolated_by_default() -> None:
    async with fake_fleet() as one, fake_fleet() as two:
        async with one.gate("iso", floor=1).permit():
            assert (await two.utilization("iso")).in_flight == 0


async def test_refused_connection_outage_serves_fair_share() -> None:
    # Not a model of real outages (no timeouts, no failover): every command fails at once.
    server = FakeServer()
    async with fake_fleet(server=server, heartbeat_interval=0.1) as fleet:
        gate = fleet.gate("out", floor=2)
        async with gate.permit():
            pass
        server.connected = False
        async with gate.permit(deadline=2.0) as lease:
            assert lease.local and fleet.fallback_active
        server.connected = True
        for _ in range(100):
            if not fleet.fallback_active:
                break
            await asyncio.sleep(0.05)
        assert not fleet.fallback_active
        async with gate.permit(deadline=2.0) as lease:
            assert not lease.local


async def test_url_and_connection_options_are_refused() -> None:
    with pytest.raises(ConfigError, match="no Redis URL"):
        async with fake_fleet(url="redis://localhost:6379/0"):
            pass
    with pytest.raises(ConfigError, match="server"):
        async with fake_fleet(redis_options={"server": FakeServer()}):
            pass


def test_sync_fleet() -> None:
    with fake_sync_fleet(heartbeat_interval=30.0) as fleet:
        gate = fleet.gate("sync", floor=1)
        with gate.permit(deadline=5.0) as lease:
            assert not lease.is_lost
            with pytest.raises(DeadlineExceeded):
                gate.acquire(deadline=0.2)
            assert fleet.utilization("sync").in_flight == 1
        assert gate.map(lambda x: x + 1, [1, 2, 3], deadline=5.0) == [2, 3, 4]
        lease = gate.acquire(deadline=5.0)
        gate.release(lease)
        util = fleet.utilization("sync")
        assert (util.in_flight, util.queued) == (0, 0)


def test_default_fleet_runs_the_compat_functions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETGATE_FLOORS", "bge-m3=2")
    running = peak = 0

    async def embed(x: int) -> int:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.01)
        running -= 1
        return x * 10

    async def on_my_loop() -> list[int]:
        return await map_concurrent("bge-m3", embed, range(6))

    with fake_default_fleet(heartbeat_interval=30.0):
        assert map_concurrent_sync("bge-m3", lambda x: x + 1, [1, 2, 3]) == [2, 3, 4]
        assert asyncio.run(on_my_loop()) == [0, 10, 20, 30, 40, 50]
        assert peak == 2
        assert resolve_capacity("bge-m3") == 2
        util = get_utilization("bge-m3")
        assert (util["current_target"], util["in_flight"], util["queued"]) == (2, 0, 0)
    assert _compat._fleet is None  # the next call outside builds a real default fleet


def test_readme_example_runs() -> None:
    readme = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Testing your code with `fleetgate.testing`", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict[str, Any] = {"__name__": "readme_example"}
    exec(compile(code, "README.md", "exec"), namespace)
    tests = [fn for name, fn in namespace.items() if name.startswith("test_")]
    assert len(tests) == 2
    for fn in tests:
        fn()
