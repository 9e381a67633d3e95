"""Deadline-aware admission through the client, on a real redis-server: while other OS
processes keep a gate busy (so its drain is measured), a call whose deadline the queue ahead
cannot meet gets ``DeadlineUnreachable`` at once (an ``Overloaded``: never retried) naming the
estimate, while a call that can make it waits and is granted; the cap holds meanwhile; a gate
that turned it off lets the call wait out its deadline."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from concurrent.futures import ProcessPoolExecutor

import pytest
import redis
import redis.asyncio
from prometheus_client import CollectorRegistry

from fleetgate.client import DeadlineExceeded, DeadlineUnreachable, Fleet, Overloaded
from fleetgate.keys import GateKeys

from .. import _workers
from ..conftest import RedisUnderTest

ctx = mp.get_context("spawn")


@pytest.mark.parametrize("admission", [True, "finish", False], ids=["on", "finish", "off"])
@pytest.mark.long
def test_a_call_that_cannot_make_its_deadline_is_refused_at_once(
    rut: RedisUnderTest, admission: bool | str
) -> None:
    probe = f"{rut.prefix}:probe"
    keys = GateKeys.of(rut.prefix, "dl")
    kwargs = dict(
        url=rut.url, prefix=rut.prefix, gate="dl", probe_url=rut.url, probe=probe, tasks=4,
        loops=25, hold_s=0.05, floor=2, heartbeat_interval=0.2, deadline_admission=admission,
    )  # fmt: skip
    r = redis.Redis.from_url(rut.url, decode_responses=True)

    registry = CollectorRegistry()
    expected: list[float | None] = []

    async def probe_calls() -> tuple[BaseException | None, float, float]:
        async with Fleet(rut.url, prefix=rut.prefix, registry=registry) as fleet:
            gate = fleet.gate("dl", floor=2, deadline_admission=admission)
            snap = await gate.snapshot()
            assert snap.deadline_admission is bool(admission)
            assert snap.deadline_finish is (admission == "finish")
            t0 = time.monotonic()
            caught: BaseException | None = None
            try:
                async with gate.permit(deadline=0.05):
                    pass
            except (Overloaded, DeadlineExceeded) as exc:
                caught = exc
            short = time.monotonic() - t0
            t0 = time.monotonic()
            async with gate.permit(deadline=20) as lease:  # it can make it: it waits
                expected.append(lease.expected_wait)
            return caught, short, time.monotonic() - t0

    with ProcessPoolExecutor(3, mp_context=ctx) as ex:
        futs = [ex.submit(_workers.hammer_with, **kwargs) for _ in range(3)]
        # 12 callers on 2 units: a queue, and hand-offs that measure the drain (if on)
        for _ in range(500):
            drain = float((r.hget(keys.adm, "dr:100") or "0").split(",")[0])
            if r.zcard(keys.waiters) >= 6 and (drain > 25 or admission is False):
                break
            time.sleep(0.02)
        caught, short, long_wait = asyncio.run(probe_calls())
        peaks = [f.result(timeout=120) for f in futs]
    r.close()
    observed = registry.get_sample_value(
        "fleetgate_client_expected_wait_seconds_count", {"gate": "dl", "priority": "0",
                                                         "tenant": ""}
    )  # fmt: skip
    print(f"[deadline] admission {admission}: {type(caught).__name__} after {short:.3f} s: "
          f"{caught}; the 20 s call waited {long_wait:.3f} s (expected {expected[0]}); "
          f"peaks {peaks}")  # fmt: skip
    assert max(peaks) <= 2, peaks  # the cap held throughout
    assert long_wait < 20
    if admission:
        assert isinstance(caught, DeadlineUnreachable), caught
        assert short < 0.05  # refused at once, not after waiting its deadline out
        assert caught.expected_wait > 0 and caught.deadline == pytest.approx(0.05, abs=0.01)
        assert caught.retry_after is not None and caught.retry_after > 0
        assert "expected wait" in str(caught) and "deadline" in str(caught)
        if admission == "finish":  # the band's mean hold (2 units of 50 ms calls) counted
            assert caught.expected_hold is not None and 0.01 < caught.expected_hold < 1
            assert caught.expected_wait + caught.expected_hold > caught.deadline
        else:
            assert caught.expected_hold is None
            assert caught.expected_wait > caught.deadline
        # the call that waited was told what to expect, and the metric counted it
        assert expected[0] is not None and 0 < expected[0] < 20, expected
        assert observed == 1, observed
    else:
        assert isinstance(caught, DeadlineExceeded), caught  # it waited 0.05 s for nothing
        assert short >= 0.05
        assert expected == [None] and not observed  # no drain kept: no estimate


async def test_a_parked_call_leaves_early_once_its_deadline_is_out_of_reach(
    rut: RedisUnderTest,
) -> None:
    """Parked while the drain said it would make it; the drain then slows (planted here: 1
    grant/s): its heartbeat re-estimates it and it gets DeadlineUnreachable well before its
    deadline, out of the wait list; the calls without that problem stay."""
    async with Fleet(
        rut.url, prefix=rut.prefix, registry=CollectorRegistry(), heartbeat_interval=0.2
    ) as fleet:
        gate = fleet.gate("early", floor=1)
        held = await gate.acquire()
        patient = [asyncio.create_task(gate.acquire(deadline=60)) for _ in range(3)]
        r = redis.asyncio.Redis.from_url(rut.url)
        sec, usec = await r.time()
        now_ms = sec * 1000 + usec // 1000
        await r.hset(gate.keys.adm, "dr:100", f"1000,10000,{now_ms}")  # 100 grants/s
        t0 = time.monotonic()
        hurried = asyncio.create_task(gate.acquire(deadline=3))
        while (await gate.snapshot()).queued < 4:
            await asyncio.sleep(0.02)
        assert not hurried.done()  # it parked: at 100/s it would start in ~40 ms
        await r.hset(gate.keys.adm, "dr:100", f"100,100000,{now_ms + 100}")  # now 1/s
        with pytest.raises(DeadlineUnreachable) as caught:
            await asyncio.wait_for(hurried, 5)
        took = time.monotonic() - t0
        assert took < 1.5, took  # left at a heartbeat, not at its 3 s deadline
        assert caught.value.expected_wait > caught.value.deadline
        assert (await gate.snapshot()).queued == 3 and not any(t.done() for t in patient)
        await held.release()
        for task in patient:
            await (await task).release()
        await r.aclose()
