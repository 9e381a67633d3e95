"""Cross-thread cancellation of the sync face and the compat functions (``map_concurrent``...).

A call made from another thread (``SyncGate``, ``map_concurrent_sync``) or from another event loop
(``map_concurrent``) runs on the fleet's loop. When the caller gives up just as a grant lands --
an exception raised into the calling thread, a signal in the main thread, a cancelled task on
the caller's loop -- the grant must be given back: nobody will ever release it otherwise, and the
heartbeat would renew it for the life of the process.

The grant is made to land at a chosen moment with a hook on the gate's ``on_granted`` (test
instrumentation): right after the hand-off resolved the parked acquire, the fleet's loop is
paused for 0.1 s while the caller is interrupted. Whether the interruption or the result reaches
the caller's side first then depends on the scheduler; neither order may leak a permit. Leases
and waiters live 60 s, so expiry cannot hide a leak.
"""

from __future__ import annotations

import asyncio
import ctypes
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from prometheus_client import CollectorRegistry

from fleetgate.client import Gate, SyncFleet, SyncGate, compat, map_concurrent, map_concurrent_sync
from fleetgate.keys import GateKeys

from ..conftest import RedisUnderTest

LONG_MS = 60_000


class _Interrupt(BaseException):
    """Raised into the calling thread (as KeyboardInterrupt would be)."""


def raise_in_thread(thread: threading.Thread, exc: type[BaseException]) -> None:
    """Schedule ``exc`` in ``thread``: raised at its next bytecode boundary (a thread blocked in a
    lock gets it as soon as it wakes up)."""
    assert thread.ident is not None
    n = ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread.ident), ctypes.py_object(exc)
    )
    assert n == 1, n


@pytest.fixture
def interrupt_main() -> Iterator[Callable[[], None]]:
    """A function (callable from any thread) that interrupts the main thread with _Interrupt,
    even while it is blocked waiting for a result (the signal wakes it up)."""

    def handler(signum: int, frame: Any) -> None:
        raise _Interrupt()

    old = signal.signal(signal.SIGUSR1, handler)
    main = threading.main_thread().ident
    assert main is not None and threading.current_thread() is threading.main_thread()
    try:
        yield lambda: signal.pthread_kill(main, signal.SIGUSR1)
    finally:
        signal.signal(signal.SIGUSR1, old)


def main_thread_blocked() -> bool:
    """The main thread waits on a lock inside ``threading`` (a blocking call's result)."""
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    return (
        frame is not None
        and frame.f_code.co_filename == threading.__file__
        and (frame.f_code.co_name == "wait")
    )


def pause_loop_after_grant(gate: Gate, at_grant: Callable[[], None]) -> None:
    """On the first hand-off to a parked caller of ``gate``: run ``at_grant`` on the fleet's loop
    right after the acquire has resumed with its lease, then hold that loop for 0.1 s."""
    orig = gate.on_granted
    fired = False

    def blocker() -> None:
        at_grant()
        time.sleep(0.1)

    def on_granted(lease_id: str, token: int) -> None:
        nonlocal fired
        waiting = lease_id in gate.waiters
        orig(lease_id, token)
        if waiting and not fired:
            fired = True
            # After the acquire's own wake-up (scheduled by orig): it returns its lease first.
            asyncio.get_running_loop().call_soon(blocker)

    gate.on_granted = on_granted  # type: ignore[method-assign]


def release_when_parked(r: redis.Redis, keys: GateKeys, sg: SyncGate, held: Any) -> None:
    """In a helper thread: once somebody is parked on the gate, release ``held`` (a hand-off)."""

    def run() -> None:
        deadline = time.monotonic() + 10
        while r.zcard(keys.waiters) == 0:
            if time.monotonic() > deadline:
                return
            time.sleep(0.005)
        sg.release(held)

    threading.Thread(target=run, daemon=True).start()


def settled(r: redis.Redis, keys: GateKeys, timeout: float = 3.0) -> tuple[int, int]:
    """(holders, queued) once both are 0, or as they stand after ``timeout`` s."""
    end = time.monotonic() + timeout
    while True:
        now = (r.zcard(keys.holders), r.zcard(keys.waiters))
        if now == (0, 0) or time.monotonic() > end:
            return now
        time.sleep(0.01)


def local_state(fleet: SyncFleet, sg: SyncGate) -> tuple[list[str], list[str]]:
    async def read() -> tuple[list[str], list[str]]:
        return list(sg.gate.leases), list(sg.gate.waiters)

    return fleet.portal.call(read())


@pytest.fixture
def sync_fleet(rut: RedisUnderTest) -> Iterator[SyncFleet]:
    with SyncFleet(rut.url, prefix=rut.prefix, registry=CollectorRegistry()) as fleet:
        yield fleet


@pytest.fixture
def r(rut: RedisUnderTest) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(rut.url)
    yield client
    client.close()


def _gate(fleet: SyncFleet, name: str) -> SyncGate:
    return fleet.gate(name, floor=1, lease_ms=LONG_MS, waiter_ms=LONG_MS)


def test_exception_raised_into_thread_as_grant_lands_releases(
    sync_fleet: SyncFleet, r: redis.Redis, rut: RedisUnderTest
) -> None:
    """Deterministic: the exception is scheduled while the thread is blocked on its parked
    acquire, so it is raised the moment the hand-off's lease reaches the thread."""
    sg = _gate(sync_fleet, "thread-exc")
    keys = GateKeys.of(rut.prefix, "thread-exc")
    held = sg.acquire(deadline=5)
    outcome: dict[str, Any] = {}

    def caller() -> None:
        try:
            outcome["lease"] = sg.acquire(deadline=None)
        except _Interrupt:
            outcome["interrupted"] = True

    t = threading.Thread(target=caller)
    t.start()
    deadline = time.monotonic() + 10
    while r.zcard(keys.waiters) == 0:
        assert time.monotonic() < deadline, "the caller never parked"
        time.sleep(0.005)
    raise_in_thread(t, _Interrupt)  # pending until the thread wakes up with its lease
    sg.release(held)
    t.join(10)
    assert outcome == {"interrupted": True}
    assert settled(r, keys) == (0, 0)
    assert local_state(sync_fleet, sg) == ([], [])


@pytest.mark.parametrize("entry", ["acquire", "permit", "map", "map_concurrent_sync"])
def test_main_thread_interrupted_as_grant_lands_releases(
    entry: str,
    rut: RedisUnderTest,
    r: redis.Redis,
    interrupt_main: Callable[[], None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A signal (as Ctrl-C) interrupts the blocked main thread right as its grant lands."""
    name = f"main-{entry}".replace("_", "-")
    keys = GateKeys.of(rut.prefix, name)
    if entry == "map_concurrent_sync":
        monkeypatch.setenv("FLEETGATE_REDIS_URL", rut.url)
        monkeypatch.setenv("FLEETGATE_PREFIX", rut.prefix)
        monkeypatch.setenv("FLEETGATE_FLOORS", f"{name}=1")
        compat.reset_controllers()
        sg = compat._gate(name)
        fleet = compat._default_fleet()
    else:
        fleet = SyncFleet(rut.url, prefix=rut.prefix, registry=CollectorRegistry())
        fleet.start()
        sg = _gate(fleet, name)
    try:
        held = sg.acquire(deadline=5)
        pause_loop_after_grant(sg.gate, interrupt_main)
        release_when_parked(r, keys, sg, held)

        async def work(x: int) -> int:
            await asyncio.sleep(0.01)
            return x

        with pytest.raises(_Interrupt):
            if entry == "acquire":
                sg.acquire(deadline=None)
            elif entry == "permit":
                with sg.permit(deadline=None):
                    time.sleep(1.0)  # the interrupt lands here at the latest
            elif entry == "map":
                sg.map(work, [1], deadline=None)
            else:
                map_concurrent_sync(name, work, [1])
        assert settled(r, keys) == (0, 0)
        assert local_state(fleet, sg) == ([], [])
    finally:
        if entry == "map_concurrent_sync":
            compat.reset_controllers()
        else:
            fleet.close()


async def test_map_concurrent_cancelled_as_grant_lands_releases(
    rut: RedisUnderTest, r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The async compat function: permits come from the default fleet's loop (another thread);
    the caller's task is cancelled right as the grant lands there."""
    name = "amap"
    keys = GateKeys.of(rut.prefix, name)
    monkeypatch.setenv("FLEETGATE_REDIS_URL", rut.url)
    monkeypatch.setenv("FLEETGATE_PREFIX", rut.prefix)
    monkeypatch.setenv("FLEETGATE_FLOORS", f"{name}=1")
    compat.reset_controllers()
    try:
        sg = compat._gate(name)
        held = await asyncio.to_thread(sg.acquire, 5)
        entered = threading.Event()

        async def work(x: int) -> int:
            entered.set()
            await asyncio.sleep(30)
            return x

        caller = asyncio.create_task(map_concurrent(name, work, [1]))
        here = asyncio.get_running_loop()

        def cancel_caller() -> None:
            here.call_soon_threadsafe(caller.cancel)

        pause_loop_after_grant(sg.gate, cancel_caller)
        release_when_parked(r, keys, sg, held)
        with pytest.raises(asyncio.CancelledError):
            await caller
        assert not entered.is_set()
        assert await asyncio.to_thread(settled, r, keys) == (0, 0)
        assert local_state(compat._default_fleet(), sg) == ([], [])
    finally:
        await asyncio.to_thread(compat.reset_controllers)


def test_interrupted_release_still_releases(
    sync_fleet: SyncFleet, r: redis.Redis, rut: RedisUnderTest, interrupt_main: Callable[[], None]
) -> None:
    """The caller is interrupted before its release ran on the fleet's loop (the loop is busy):
    the release must still happen (it is never cancelled)."""
    sg = _gate(sync_fleet, "rel")
    keys = GateKeys.of(rut.prefix, "rel")
    lease = sg.acquire(deadline=5)
    assert r.zcard(keys.holders) == 1

    calling = threading.Event()

    def busy() -> None:
        # Holds the fleet's loop until the caller is blocked in its release call (so the
        # release was submitted but cannot start), then interrupts it.
        calling.wait(5)
        end = time.monotonic() + 5
        while not main_thread_blocked() and time.monotonic() < end:
            time.sleep(0.001)
        interrupt_main()
        time.sleep(0.1)

    sync_fleet.portal.loop.call_soon_threadsafe(busy)
    with pytest.raises(_Interrupt):
        calling.set()
        sg.release(lease)
    assert settled(r, keys) == (0, 0)
    assert local_state(sync_fleet, sg) == ([], [])


def test_threads_asking_for_a_new_gate_at_once_get_the_one_registered_gate(
    rut: RedisUnderTest,
) -> None:
    """``SyncFleet.gate``'s check-then-set holds a lock: two threads asking for a new gate at
    once get the same one (a second gate, not stored in the fleet, would never be renewed by the
    heartbeat: its lease would lapse while held, 2 running under a limit of 1). A switch
    interval of 1 µs makes the race likely."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        with SyncFleet(rut.url, prefix=rut.prefix, registry=CollectorRegistry()) as fleet:
            for t in range(100):
                name, n = f"race-{t}", 8
                barrier = threading.Barrier(n)
                got: list[Gate | None] = [None] * n

                def ask(i: int, name: str, barrier: threading.Barrier, got: list[Any]) -> None:
                    barrier.wait()
                    got[i] = fleet.gate(name, floor=1).gate

                threads = [
                    threading.Thread(target=ask, args=(i, name, barrier, got)) for i in range(n)
                ]
                for th in threads:
                    th.start()
                for th in threads:
                    th.join()
                registered = fleet.fleet._gates[name]
                assert all(g is registered for g in got), f"trial {t}: a gate nobody renews"
    finally:
        sys.setswitchinterval(old)
