"""Headroom between bands through the client, across OS processes on a real redis-server: two
processes flood a gate with batch calls (priority 0) while a third makes interactive calls
(priority 10). With ``band_share={0: 0.5}`` the batch band never holds more than half the
gate fleet-wide, even while no interactive call waits, so the interactive calls start at once;
with strict bands alone the batch fills the gate and the interactive calls park behind it."""

from __future__ import annotations

import multiprocessing as mp
import time
from concurrent.futures import ProcessPoolExecutor

import pytest
import redis

from ..conftest import RedisUnderTest
from . import _band_workers

ctx = mp.get_context("spawn")
FLOOR = 4


@pytest.mark.parametrize("share", [{0: 0.5}, {}], ids=["headroom", "strict"])
@pytest.mark.long
def test_a_batch_flood_leaves_the_share_it_may_not_hold_free(
    rut: RedisUnderTest, share: dict[int, float]
) -> None:
    start = f"{rut.prefix}:start"
    common = dict(url=rut.url, prefix=rut.prefix, gate="flood", floor=FLOOR, band_share=share,
                  start=start)  # fmt: skip
    batch = dict(priority=0, tasks=4, loops=8, hold_s=0.15, probe=f"{rut.prefix}:batch")
    interactive = dict(priority=10, tasks=2, loops=12, hold_s=0.02, probe=f"{rut.prefix}:inter")
    r = redis.Redis.from_url(rut.url, decode_responses=True)
    with ProcessPoolExecutor(3, mp_context=ctx) as ex:
        floods = [ex.submit(_band_workers.band_calls, **common, **batch) for _ in range(2)]
        time.sleep(1.5)  # the processes are up (spawned), their gates registered
        r.set(start, 1)
        # the interactive caller starts once the batch band holds what it may
        held = FLOOR // 2 if share else FLOOR
        deadline = time.monotonic() + 30
        while int(r.get(batch["probe"]) or 0) < held and time.monotonic() < deadline:
            time.sleep(0.005)
        fast = ex.submit(_band_workers.band_calls, **common, **interactive)
        (batch_peak, _), (batch_peak2, _) = (f.result(timeout=120) for f in floods)
        inter_peak, inter_parked = fast.result(timeout=120)
    r.close()
    print(f"[band share {share}] batch peaks {batch_peak}, {batch_peak2}; interactive peak "
          f"{inter_peak}, parked {inter_parked} of 24")  # fmt: skip
    if share:
        # fleet-wide, the batch band held at most its half of the gate ...
        assert max(batch_peak, batch_peak2) <= FLOOR // 2
        # ... and the half it may not hold was free for the interactive calls: none parked
        assert inter_parked == 0
    else:
        assert max(batch_peak, batch_peak2) > FLOOR // 2  # the batch filled the gate
        assert inter_parked > 0  # and the interactive calls waited behind it
