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
from prometheus_client import CollectorRegistry

from fleetgate.client import DeadlineExceeded, DeadlineUnreachable, Fleet, Overloaded
from fleetgate.keys import GateKeys

from .. import _workers
from ..conftest import RedisUnderTest

ctx = mp.get_context("spawn")


@pytest.mark.parametrize("admission", [True, False], ids=["on", "off"])
def test_a_call_that_cannot_make_its_deadline_is_refused_at_once(
    rut: RedisUnderTest, admission: bool
) -> None:
    probe = f"{rut.prefix}:probe"
    keys = GateKeys.of(rut.prefix, "dl")
    kwargs = dict(
        url=rut.url, prefix=rut.prefix, gate="dl", probe_url=rut.url, probe=probe, tasks=4,
        loops=25, hold_s=0.05, floor=2, heartbeat_interval=0.2, deadline_admission=admission,
    )  # fmt: skip
    r = redis.Redis.from_url(rut.url, decode_responses=True)

    async def probe_calls() -> tuple[BaseException | None, float, float]:
        async with Fleet(rut.url, prefix=rut.prefix, registry=CollectorRegistry()) as fleet:
            gate = fleet.gate("dl", floor=2, deadline_admission=admission)
            assert (await gate.snapshot()).deadline_admission is admission
            t0 = time.monotonic()
            caught: BaseException | None = None
            try:
                async with gate.permit(deadline=0.05):
                    pass
            except (Overloaded, DeadlineExceeded) as exc:
                caught = exc
            short = time.monotonic() - t0
            t0 = time.monotonic()
            async with gate.permit(deadline=20):  # it can make it: it waits and is granted
                pass
            return caught, short, time.monotonic() - t0

    with ProcessPoolExecutor(3, mp_context=ctx) as ex:
        futs = [ex.submit(_workers.hammer_with, **kwargs) for _ in range(3)]
        # 12 callers on 2 units: a queue, and hand-offs that measure the drain (if on)
        for _ in range(500):
            drain = float((r.hget(keys.adm, "dr:100") or "0").split(",")[0])
            if r.zcard(keys.waiters) >= 6 and (drain > 25 or not admission):
                break
            time.sleep(0.02)
        caught, short, long_wait = asyncio.run(probe_calls())
        peaks = [f.result(timeout=120) for f in futs]
    r.close()
    print(f"[deadline] admission {admission}: {type(caught).__name__} after {short:.3f} s: "
          f"{caught}; the 20 s call waited {long_wait:.3f} s; peaks {peaks}")  # fmt: skip
    assert max(peaks) <= 2, peaks  # the cap held throughout
    assert long_wait < 20
    if admission:
        assert isinstance(caught, DeadlineUnreachable), caught
        assert short < 0.05  # refused at once, not after waiting its deadline out
        assert caught.expected_wait > caught.deadline == pytest.approx(0.05, abs=0.01)
        assert caught.retry_after is not None and caught.retry_after > 0
        assert "expected wait" in str(caught) and "deadline" in str(caught)
    else:
        assert isinstance(caught, DeadlineExceeded), caught  # it waited 0.05 s for nothing
        assert short >= 0.05
