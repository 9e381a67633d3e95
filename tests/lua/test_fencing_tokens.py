"""Fencing tokens exceed every token the gate ever issued: after Redis restarts empty and after
a failover to a replica that missed the last grants.

Pod X (a child process) holds a lease with token *a*; pod Y (this process) takes and releases
*a+1 … a+5*; then the gate loses its counter. Raising the counter only to the highest token
still *held* (X's *a*, by X's adoption or heartbeat) would give Y *a+1* again: issued twice.
Tokens never fall below server time × 1000 (``lua/lib_tokens.lua`` next_tokens), which is past
every earlier token however the counter was lost. Also here: the counter rolled back below the
tokens of leases still held, and waiters parked across a rollback.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor

import pytest
import redis
import redis.asyncio as aredis
from prometheus_client import CollectorRegistry

from fleetgate.client import Fleet
from fleetgate.keys import GateKeys
from fleetgate.scripts import GRANTED, PARKED, GateScripts
from fleetgate.settings import GateSettings
from fleetgate.tools.redisproc import RedisProcess

from .. import _workers
from ..chaos._proxy import TcpProxy
from ..conftest import RedisUnderTest

# the scripts against each server of the matrix (tests/_servers.py)
pytestmark = pytest.mark.servers

SPAWN = multiprocessing.get_context("spawn")
HB = 0.2
GATE = "tokens"


@pytest.fixture
def replica(own_redis: RedisProcess) -> Iterator[RedisProcess]:
    """A replica of ``own_redis``, in sync before the test goes on."""
    replica_of = ["--replicaof", "127.0.0.1", str(own_redis.port)]
    with RedisProcess(binary=own_redis.binary, extra_args=replica_of) as proc:
        r = redis.Redis.from_url(proc.url, decode_responses=True)
        deadline = time.monotonic() + 10
        while r.info("replication").get("master_link_status") != "up":
            assert time.monotonic() < deadline, "the replica never synced"
            time.sleep(0.02)
        r.close()
        yield proc


def _x_holds(
    ex: ProcessPoolExecutor, url: str, rut: RedisUnderTest
) -> tuple[Future[None], str, str, int]:
    """Start pod X; return its future, the stop key, its lease id and its token."""
    report, stop = f"{rut.prefix}:x", f"{rut.prefix}:stop"
    fut = ex.submit(_workers.hold_and_report, url, "fg", GATE, rut.url, report, stop, HB)
    ctl = redis.Redis.from_url(rut.url, decode_responses=True)
    got = ctl.blpop([report], timeout=30)
    assert got is not None, "X never got its permit"
    lease_id = got[1]
    token = int(ctl.lpop(report) or 0)
    ctl.close()
    return fut, stop, lease_id, token


async def _y_takes_five(fleet: Fleet) -> list[int]:
    gate = fleet.gate(GATE, floor=4)
    tokens = []
    for _ in range(5):
        async with gate.permit(deadline=10) as lease:
            tokens.append(lease.token)
    await fleet.flush()
    return tokens


async def _until(predicate: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def _next_token_after_loss(
    url: str,
    rut: RedisUnderTest,
    lose: Callable[[], None],
    holders: redis.Redis,
    before_five: Callable[[], None] = lambda: None,
) -> tuple[int, list[int]]:
    """X holds a, ``before_five()``, Y issues five more, ``lose()`` drops the counter, X and Y
    recover; Y's next token and the tokens issued before it (X's first)."""
    with ProcessPoolExecutor(1, mp_context=SPAWN) as ex:
        fut, stop, x_id, a = _x_holds(ex, url, rut)
        async with Fleet(url, registry=CollectorRegistry(), heartbeat_interval=HB) as fleet:
            before_five()
            issued = [a, *await _y_takes_five(fleet)]
            lose()
            # X counts its lease again (adoption after its fallback, or its heartbeat)
            await _until(lambda: holders.zscore(f"fg:{{{GATE}}}:holders", x_id), 10, "X adopted")
            # Y meets the loss, and is back in fleet mode on the server that lost the counter
            # before it asks again: its idle gate's next beat registers Y anew there (its entry
            # was lost with the rest). Whether Y passes through the fallback on the way is the
            # connection pool's business, not what this test is about: redis-py 8.1's pool
            # handed out the connection the server had closed (that beat failed: fallback, then
            # back), 8.2's replaces it (as 7.x and 5.x do) and the beat reaches the new server
            # at once, the restart being invisible to an idle pod (docs/failure-modes.md).
            pods = GateKeys.of("fg", GATE).pods
            await _until(
                lambda: (
                    holders.zscore(pods, fleet.pod_key) is not None and not fleet.fallback_active
                ),
                10,
                "Y registered again after the loss, in fleet mode",
            )
            async with fleet.gate(GATE).permit(deadline=10) as lease:
                fresh = lease.token
        redis.Redis.from_url(rut.url).set(stop, 1)
        fut.result(timeout=30)
    return fresh, issued


async def test_tokens_exceed_every_issued_token_after_an_empty_restart(
    own_redis: RedisProcess, rut: RedisUnderTest
) -> None:
    def restart() -> None:
        own_redis.kill()
        own_redis.start()  # empty

    holders = redis.Redis.from_url(own_redis.url, decode_responses=True)
    fresh, issued = await _next_token_after_loss(own_redis.url, rut, restart, holders)
    holders.close()
    # not a + 1: a token Y had been issued already
    assert fresh > max(issued), (fresh, issued)


async def test_tokens_exceed_every_issued_token_after_a_lossy_failover(
    own_redis: RedisProcess, replica: RedisProcess, rut: RedisUnderTest
) -> None:
    """The replica is promoted before Y's five grants reach it (replication cut first), then
    every client is switched to it, as a failover does."""
    with TcpProxy("127.0.0.1", own_redis.port) as proxy:
        promoted = redis.Redis.from_url(replica.url, decode_responses=True)

        def fail_over() -> None:
            proxy.sever("reset")
            proxy.upstream = ("127.0.0.1", replica.port)
            proxy.heal()

        def cut_replication() -> None:
            # X's grant has reached the replica; Y's five will not
            master = redis.Redis.from_url(own_redis.url)
            master.wait(1, 5000)
            master.close()
            promoted.replicaof("NO", "ONE")

        fresh, issued = await _next_token_after_loss(
            proxy.url, rut, fail_over, promoted, before_five=cut_replication
        )
        counter = promoted.get(f"fg:{{{GATE}}}:seq")
        promoted.close()
    # the promoted replica's counter had rolled back below Y's five tokens
    assert fresh > max(issued), (fresh, issued, counter)


async def test_waiters_parked_across_a_rollback_keep_their_place(rut: RedisUnderTest) -> None:
    """A rollback that keeps the parked entries but not the counter (a lossy failover): a caller
    arriving after it parks behind them, and the hand-offs go in arrival order (its seq
    does not restart below theirs: it would sort first in the lane and be served first)."""
    r = aredis.Redis.from_url(rut.url, decode_responses=True)
    scripts = GateScripts(r)
    keys = GateKeys.of(rut.prefix, "rollback")
    one = GateSettings(floor=1, ceiling=1, max_queued=10, lease_ms=60_000, waiter_ms=60_000)
    assert (await scripts.acquire(keys, "h:1", 60_000, one)).status == GRANTED
    early = [await scripts.acquire(keys, f"w:{i}", 60_000, one) for i in (1, 2)]
    assert [p.status for p in early] == [PARKED, PARKED]
    # The counter rolled back, the wait list survived. A real rollback (a failover) takes far
    # longer than the millisecond the clock rule needs to have passed since the lost grants.
    await asyncio.sleep(0.005)
    await r.set(keys.seq, 5)
    late = await scripts.acquire(keys, "w:3", 60_000, one)
    assert late.status == PARKED and late.token > max(p.token for p in early)
    served = []
    for holder in ("h:1", "w:1", "w:2"):
        await scripts.release(keys, holder)
        served += [v.partition("=")[0] for v in await r.lpop(keys.wake("w"), 10) or []]
    assert served == ["w:1", "w:2", "w:3"]
    await r.aclose()


@pytest.fixture
async def r(own_redis: RedisProcess) -> AsyncIterator[aredis.Redis]:
    client = aredis.Redis.from_url(own_redis.url, decode_responses=True)
    yield client
    await client.aclose()


async def test_tokens_stay_monotonic_across_a_redis_restart(own_redis: RedisProcess) -> None:
    """After a restart the counter is above the tokens of the leases adopted (up to 3), not 1."""
    async with Fleet(own_redis.url, registry=CollectorRegistry(), heartbeat_interval=0.2) as fleet:
        gate = fleet.gate("tokens", floor=4)
        held = [await gate.acquire() for _ in range(3)]
        top = max(lease.token for lease in held)
        own_redis.kill()
        own_redis.start()  # empty
        await asyncio.sleep(0.6)  # the pod meets the restart (fallback, or a heartbeat)
        await _until(lambda: not fleet.fallback_active, 5, "fleet mode")
        fresh = await gate.acquire(deadline=5)
        assert fresh.token > top
        for lease in (*held, fresh):
            await lease.release()


async def test_tokens_stay_monotonic_after_the_counter_rolls_back(
    own_redis: RedisProcess, r: aredis.Redis
) -> None:
    """A lossy failover keeps the gate but rolls its counter back below held tokens."""
    async with Fleet(own_redis.url, registry=CollectorRegistry(), heartbeat_interval=0.2) as fleet:
        gate = fleet.gate("rollback", floor=4)
        held = [await gate.acquire() for _ in range(3)]
        await r.set(gate.keys.seq, 1)
        await asyncio.sleep(0.5)  # the holder's next heartbeat raises the counter again
        fresh = await gate.acquire(deadline=5)
        assert fresh.token > max(lease.token for lease in held)
        for lease in (*held, fresh):
            await lease.release()
