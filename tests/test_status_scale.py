"""`fleetgate status` and the inspect script stay O(1) per gate in the queue length (issue 9).

The work is measured inside Redis, deterministically: the ZSCORE calls the inspect script makes
(one per listed waiter, from ``INFO commandstats``) and the bytes Redis sends back
(``total_net_output_bytes``), around one status read of a gate with 50,000 parked waiters and
50,000 holders. Before the fix ``inspect`` with n=0 ran ``ZRANGE queue 0 -1``: it listed every
waiter (50,000 ZSCORE calls, megabytes of reply) inside one script, blocking Redis.
"""

from __future__ import annotations

import redis.asyncio as aredis

from fleetgate.keys import GateKeys
from fleetgate.scripts import GateScripts
from fleetgate.status import gather_status

from .conftest import RedisUnderTest

N = 50_000
HOUR_MS = 3_600_000


async def _park_many(r: aredis.Redis, keys: GateKeys, n: int) -> None:
    """n parked waiters and n holders, written straight into the gate's keys (an hour's TTL)."""
    sec, usec = await r.time()
    expiry = sec * 1000 + usec // 1000 + HOUR_MS
    await r.hset(keys.cfg, mapping={"floor": 1, "ceiling": 1, "max_queued": 10 * n})
    for start in range(0, n, 10_000):
        ids = [f"pod{i % 7}:{i}" for i in range(start, min(n, start + 10_000))]
        pipe = r.pipeline(transaction=False)
        pipe.zadd(keys.queue, {w: i for i, w in enumerate(ids, start)})
        pipe.zadd(keys.waiters, dict.fromkeys(ids, expiry))
        pipe.zadd(keys.holders, {f"h{w}": expiry for w in ids})
        await pipe.execute()


async def _server_work(r: aredis.Redis) -> tuple[int, int]:
    """(ZSCORE calls so far, bytes sent to clients so far) of the server."""
    stats = await r.info("commandstats")
    out = await r.info("stats")
    return int(stats.get("cmdstat_zscore", {}).get("calls", 0)), int(out["total_net_output_bytes"])


async def test_status_reads_a_huge_queue_in_constant_work(
    rut: RedisUnderTest, async_redis: aredis.Redis
) -> None:
    keys = GateKeys.of(rut.prefix, "big")
    await _park_many(async_redis, keys, N)
    await async_redis.sadd(f"{rut.prefix}:gates", "big")

    zscore0, bytes0 = await _server_work(async_redis)
    status = await gather_status(async_redis, rut.prefix)
    zscore1, bytes1 = await _server_work(async_redis)

    [gate] = status.gates
    assert (gate.queued, gate.in_flight) == (N, N)  # counted, not listed
    zscores, sent = zscore1 - zscore0, bytes1 - bytes0
    print(f"status of a gate with {N} waiters: {zscores} ZSCORE calls, {sent} bytes sent")
    assert zscores == 0, f"status listed {zscores} waiters inside one script"
    assert sent < 16_384, f"status read {sent} bytes: it listed the queue or the holders"


async def test_inspect_lists_at_most_what_is_asked_and_never_everything(
    rut: RedisUnderTest, async_redis: aredis.Redis
) -> None:
    keys = GateKeys.of(rut.prefix, "big")
    await _park_many(async_redis, keys, N)
    scripts = GateScripts(async_redis)
    for n in (0, -1, -N):  # "nothing"; negative counts must not turn into ZRANGE 0 -2 (all)
        snap = await scripts.snapshot(keys, n)
        assert (snap.head, snap.leases) == ([], []), n
        assert (snap.queued, snap.holders) == (N, N)
    snap = await scripts.snapshot(keys, 3)
    assert [w.id for w in snap.head] == ["pod0:0", "pod1:1", "pod2:2"]
    assert len(snap.leases) == 3 and all(w.expires_at for w in snap.head)
    # An absurd count is capped: one script never lists the whole queue.
    zscore0, _ = await _server_work(async_redis)
    snap = await scripts.snapshot(keys, 10 * N)
    zscore1, _ = await _server_work(async_redis)
    assert len(snap.head) == len(snap.leases) == zscore1 - zscore0 == 1000
