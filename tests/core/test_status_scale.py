"""`fleetgate status` and the inspect script stay O(1) per gate in the queue length and in the
number of tenants.

The work is measured inside Redis, deterministically: the ZSCORE calls the inspect script makes
(one per listed waiter, from ``INFO commandstats``) and the bytes Redis sends back
(``total_net_output_bytes``), around one status read of a gate with 50,000 parked waiters (in
one lane, or over 1,000 tenants' lanes) and 50,000 holders. Status lists STATUS_LANES lanes (for
the queue per band and per tenant) and at most as many head waiters: a constant, where listing
every waiter (``ZRANGE queue 0 -1``) would make 50,000 ZSCORE calls and megabytes of reply
inside one script, blocking Redis.
"""

from __future__ import annotations

import pytest
import redis.asyncio as aredis

from fleetgate.admission import waiter_member
from fleetgate.keys import GateKeys
from fleetgate.scripts import GateScripts
from fleetgate.status import STATUS_LANES, gather_status

from ..conftest import RedisUnderTest

N = 50_000
HOUR_MS = 3_600_000


async def _park_many(r: aredis.Redis, keys: GateKeys, n: int, tenants: int = 1) -> None:
    """n parked waiters and n holders, written straight into the gate's schema-2 keys (an
    hour's TTL): waiter i of tenant ``t<i % tenants>`` at priority 0 (``tenants=1``: the default
    tenant), each tenant's lane in the fair order with a tag of its own (see lua/lib_lanes.lua)."""
    sec, usec = await r.time()
    expiry = sec * 1000 + usec // 1000 + HOUR_MS
    await r.hset(keys.cfg, mapping={"floor": 1, "ceiling": 1, "max_queued": 10 * n, "schema": 2})
    await r.set(keys.queue, "fleetgate schema 2")  # the fence

    def tenant(i: int) -> str | None:
        return None if tenants == 1 else f"t{i % tenants:04d}"

    lanes = {}
    for t in range(tenants):
        name = tenant(t) or ""
        lanes[f"100}}{1000 + t:020d}}}{name}"] = 0  # the fair member '<R>}<tag>}<tenant>'
    await r.zadd(keys.fair, lanes)
    await r.hset(
        keys.adm, mapping={f"f:{tenant(t) or ''}}}100": f"{1000 + t:020d}" for t in range(tenants)}
    )
    for start in range(0, n, 10_000):
        ids = [(i, f"pod{i % 7}:{i}") for i in range(start, min(n, start + 10_000))]
        members = [waiter_member(0, tenant(i), i, w) for i, w in ids]
        pipe = r.pipeline(transaction=False)
        pipe.zadd(keys.lanes, dict.fromkeys(members, 0))
        pipe.zadd(keys.waiters, dict.fromkeys(members, expiry))
        pipe.zadd(keys.holders, {f"h{w}": expiry for _, w in ids})
        await pipe.execute()


async def _server_work(r: aredis.Redis) -> tuple[int, int]:
    """(ZSCORE calls so far, bytes sent to clients so far) of the server."""
    stats = await r.info("commandstats")
    out = await r.info("stats")
    return int(stats.get("cmdstat_zscore", {}).get("calls", 0)), int(out["total_net_output_bytes"])


@pytest.mark.parametrize("tenants", [1, 1000])
async def test_status_reads_a_huge_queue_in_constant_work(
    rut: RedisUnderTest, async_redis: aredis.Redis, tenants: int
) -> None:
    keys = GateKeys.of(rut.prefix, "big")
    await _park_many(async_redis, keys, N, tenants)
    await async_redis.sadd(f"{rut.prefix}:gates", "big")

    zscore0, bytes0 = await _server_work(async_redis)
    status = await gather_status(async_redis, rut.prefix)
    zscore1, bytes1 = await _server_work(async_redis)

    [gate] = status.gates
    assert (gate.queued, gate.in_flight, gate.units) == (N, N, N)  # counted, not listed
    zscores, sent = zscore1 - zscore0, bytes1 - bytes0
    print(f"status of a gate with {N} waiters, {tenants} tenants: {zscores} ZSCORE calls, {sent} B")
    assert zscores <= STATUS_LANES, f"status listed {zscores} waiters inside one script"
    assert sent < 32_768, f"status read {sent} bytes: it listed the queue or the holders"
    # the breakdowns: exact with one lane; with 1,000 only STATUS_LANES lanes are read
    listed = min(tenants, STATUS_LANES) * (N // tenants)
    assert [(b.priority, b.queued) for b in gate.bands] == [(0, listed)]
    assert gate.unlisted == N - listed
    assert sum(t.queued for t in gate.tenants) + gate.tenants_other == N


async def test_inspect_lists_at_most_what_is_asked_and_never_everything(
    rut: RedisUnderTest, async_redis: aredis.Redis
) -> None:
    keys = GateKeys.of(rut.prefix, "big")
    await _park_many(async_redis, keys, N)
    scripts = GateScripts(async_redis)
    for n in (0, -1, -N):  # "nothing"; negative counts must not turn into ZRANGE 0 -2 (all)
        snap = await scripts.snapshot(keys, n)
        assert (snap.head, snap.leases, snap.lanes) == ([], [], []), n
        assert (snap.queued, snap.holders) == (N, N)
    snap = await scripts.snapshot(keys, 3)
    assert [w.id for w in snap.head] == ["pod0:0", "pod1:1", "pod2:2"]
    assert len(snap.leases) == 3 and all(w.expires_at for w in snap.head)
    # An absurd count is capped: one script never lists the whole queue.
    zscore0, _ = await _server_work(async_redis)
    snap = await scripts.snapshot(keys, 10 * N)
    zscore1, _ = await _server_work(async_redis)
    assert len(snap.head) == len(snap.leases) == zscore1 - zscore0 == 1000
