"""Every command fleetgate sends stays within MAX_ARGS (3,999 arguments: ElastiCache Serverless
refuses more), however large what it carries: each command whose arguments grow with the load is
driven past the bound against a real server, through a proxy that refuses a command beyond it
(tests/_argcap.py) and records the largest it saw, and its result is checked."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aredis

from fleetgate._redis import MAX_ARGS, connect
from fleetgate.admission import class_member, lane_class, weighted_id
from fleetgate.keys import GateKeys
from fleetgate.observed import encode_report, tally
from fleetgate.registry import read_registry, register, unregister
from fleetgate.scripts import (
    GRANTED,
    HEARTBEAT_UNITS_PER_CALL,
    IDS_PER_CALL,
    MAX_BATCH,
    PARKED,
    GateScripts,
    HeartbeatReply,
    HeartbeatRequest,
)
from fleetgate.settings import GateSettings

from .._argcap import ArgCapProxy
from ..conftest import RedisUnderTest

pytestmark = pytest.mark.servers

LEASES = 2100  # 2 arguments each in a heartbeat: 4,200 > MAX_ARGS in one call
WAITERS = 40
BIG = GateSettings(floor=LEASES, ceiling=LEASES, max_queued=100, lease_ms=60_000)


@pytest.fixture
async def capped(rut: RedisUnderTest) -> AsyncIterator[tuple[ArgCapProxy, aredis.Redis]]:
    """A client whose every command passes the proxy (refused beyond MAX_ARGS)."""
    if rut.process is None:
        pytest.skip("needs a private server: FLEETGATE_TEST_REDIS_URL names one not ours")
    async with ArgCapProxy(rut.process.port, MAX_ARGS) as proxy:
        client = connect(proxy.url)
        try:
            yield proxy, client
        finally:
            await client.aclose()
    assert proxy.refused == 0 and 0 < proxy.largest <= MAX_ARGS, proxy.largest


async def _acquire(
    scripts: GateScripts, keys: GateKeys, ids: list[str]
) -> tuple[list[int], dict[str, int]]:
    """Acquire ``ids`` in batches of MAX_BATCH: their statuses, and their tokens by id (the
    seq of a parked one)."""
    statuses: list[int] = []
    tokens: dict[str, int] = {}
    for i in range(0, len(ids), MAX_BATCH):
        batch = ids[i : i + MAX_BATCH]
        replies = await scripts.acquire_many(keys, [(x, 60_000) for x in batch], BIG)
        statuses += [r.status for r in replies]
        tokens.update({x: r.fencing_token or r.seq for x, r in zip(batch, replies, strict=True)})
    return statuses, tokens


async def test_a_heartbeat_of_more_ids_than_one_call_holds(
    rut: RedisUnderTest, capped: tuple[ArgCapProxy, aredis.Redis]
) -> None:
    proxy, client = capped
    scripts = GateScripts(client)
    keys = GateKeys.of(rut.prefix, "big")
    leases = [f"pod:{i}" for i in range(LEASES)]
    waiters = [f"pod:{LEASES + i}" for i in range(WAITERS)]
    statuses, seqs = await _acquire(scripts, keys, leases + waiters)
    assert statuses == [GRANTED] * LEASES + [PARKED] * WAITERS
    before = dict(await client.zrange(keys.holders, 0, -1, withscores=True))
    members = [(class_member(lane_class(0, None), seqs[w], w), 60_000) for w in waiters]
    request = HeartbeatRequest(keys, "pod", 10_000, [(x, 0) for x in leases], members)
    assert 2 * (LEASES + WAITERS) > MAX_ARGS and len(request.parts()) >= 2

    [reply] = await scripts.heartbeats([request])

    assert not isinstance(reply, Exception)
    assert reply.lost_leases == [] and reply.lost_waiters == [] and reply.granted_waiters == []
    assert (reply.holders, reply.queued, reply.limit) == (LEASES, WAITERS, LEASES)
    after = dict(await client.zrange(keys.holders, 0, -1, withscores=True))
    assert after.keys() == before.keys()
    assert all(after[x] > before[x] and after[x] >= reply.expires_at for x in after)  # renewed
    assert proxy.largest > MAX_ARGS // 2  # the parts were large ones


async def test_an_adoption_of_more_ids_than_one_call_holds(
    rut: RedisUnderTest, capped: tuple[ArgCapProxy, aredis.Redis]
) -> None:
    _, client = capped
    keys = GateKeys.of(rut.prefix, "adopted")
    ids = [weighted_id(f"pod:{i}", 1) for i in range(MAX_ARGS + 10)]
    assert len(ids) > MAX_ARGS
    # local ids, and fleet leases a restart lost before their renewal time (counted again)
    now_ms = (await client.time())[0] * 1000
    leases = [(i, now_ms + 60_000) for i in ids[len(ids) // 2 :]]
    reply = await GateScripts(client).adopt(keys, ids[: len(ids) // 2], leases)
    assert reply.added == len(ids) and await client.zcard(keys.holders) == len(ids)
    assert reply.lapsed == []
    assert min(s for _, s in await client.zrange(keys.holders, 0, 0, withscores=True)) >= (
        reply.expires_at
    )


async def test_the_registry_takes_more_gates_than_one_command_holds(
    rut: RedisUnderTest, capped: tuple[ArgCapProxy, aredis.Redis]
) -> None:
    _, client = capped
    names = [f"gate-{i:05d}" for i in range(MAX_ARGS + 500)]
    await register(client, rut.prefix, names)
    assert (await read_registry(client, rut.prefix)).names == names
    await unregister(client, rut.prefix, names[1:])
    assert (await read_registry(client, rut.prefix)).names == names[:1]


async def test_a_full_acquire_batch_with_every_report_distinct(
    rut: RedisUnderTest, capped: tuple[ArgCapProxy, aredis.Redis]
) -> None:
    """The largest acquire: MAX_BATCH calls, all but one releases, each report of its own
    tenant and band with tokens and a latency (the most fields fleetgate.observed counts)."""
    proxy, client = capped
    scripts = GateScripts(client)
    keys = GateKeys.of(rut.prefix, "reports")
    held = [f"pod:{i}" for i in range(MAX_BATCH - 1)]
    assert (await _acquire(scripts, keys, held))[0] == [GRANTED] * len(held)
    reports = [
        encode_report("ok", 0.001 * (i + 1), (8, 5, lane_class(i % 100, f"tenant-{i}")))
        for i in range(len(held))
    ]
    before = proxy.largest
    [reply] = await scripts.acquire_many(
        keys, [("pod:new", 60_000)], BIG, releases=held, observed=tally(reports)
    )
    assert reply.status == GRANTED
    assert await client.zrange(keys.holders, 0, -1) == ["pod:new"]  # the others released
    assert int(await client.hget(keys.obs, "tn:tenant-7") or 0) == 1
    assert proxy.largest > max(before, 2000)  # this batch was the largest command
    assert proxy.largest - 1 + len(keys.declared_keys()) <= MAX_ARGS  # on Cluster: 17 keys


def test_every_call_shape_fits_on_cluster_too() -> None:
    """On Cluster a gate's call declares all its keys (17, not 1): the largest call of each
    shape still fits. A heartbeat_many call is bounded by its units (HEARTBEAT_UNITS_PER_CALL;
    a gate heavier than that goes alone as a plain heartbeat, in parts of IDS_PER_CALL ids)."""
    keys = GateKeys.of("fg", "g")
    declared = len(keys.declared_keys())
    head = 3  # FCALL, the function, numkeys
    settings = len(BIG.argv())

    def gate_args(ids: int) -> int:  # heartbeat.lua's ARGV of a gate renewing `ids` ids
        return len(HeartbeatRequest(keys, "p", 1, [("x", 0)] * ids, [], 0, BIG).argv())

    assert gate_args(0) == 6 + settings
    assert head + declared + gate_args(IDS_PER_CALL) <= MAX_ARGS  # one part of a heartbeat
    assert head + declared + 3 + 2 * IDS_PER_CALL <= MAX_ARGS  # one part of an adoption
    per_unit = max(
        (1 + declared + 1 + gate_args(ids))
        / HeartbeatRequest(keys, "p", 1, [("x", 0)] * ids, []).units()
        for ids in range(4 * HEARTBEAT_UNITS_PER_CALL)
    )
    assert head + 1 + HEARTBEAT_UNITS_PER_CALL * per_unit <= MAX_ARGS  # a heartbeat_many call


def test_a_heartbeat_in_parts_reads_as_one() -> None:
    """The parts keep the ids' order (leases first, newest first, then waiters), and their
    replies merge into the reply one call would have given: lists joined in order (each id's
    fencing token beside it), the gate's state as the last part saw it, the earliest expiry."""
    keys = GateKeys.of("fg", "g")
    leases = [(f"p:{i}", 0) for i in range(5)]
    waiters = [(f"}}100}}{i:020d}}}p:w{i}", 1000) for i in range(3)]
    parts = HeartbeatRequest(keys, "p", 1, leases, waiters).parts(3)
    assert [(p.leases, p.waiters) for p in parts] == [
        (leases[:3], []),
        (leases[3:], waiters[:1]),
        ([], waiters[1:]),
    ]

    def reply(expires_at: int, granted: list[str], tokens: list[int], queued: int) -> list[Any]:
        return [4, 2, [], granted, [], queued, 3, 1000, 500, expires_at, 0, [], tokens, [], [], 8,
                -1, 0, [], [], [], []]  # fmt: skip

    merged = HeartbeatReply.merge(
        [
            HeartbeatReply.decode(reply(100, [], [], 3)),
            HeartbeatReply.decode(reply(101, ["p:w0"], [7], 2)),
            HeartbeatReply.decode(reply(102, ["p:w2"], [8], 1)),
        ]
    )
    assert merged.granted_waiters == ["p:w0", "p:w2"] and merged.granted_tokens == [7, 8]
    assert (merged.expires_at, merged.queued, merged.pod_new) == (100, 1, False)
