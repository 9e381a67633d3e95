"""10,000 asyncio cancellations at random points of a permit's life, across worker processes.

Each worker cancels its tasks while the acquire is in flight, while parked, just after a
hand-off resolved (before the task resumed: the grant/cancel race), inside the permit (during
the simulator call), plus at random times (``_worker_cancel.cancel_storm``).

Leases and waiters live 60 s here, so TTL expiry cannot hide a leak: Redis is read right after
the storm, while every worker process is still alive and heartbeating, and must hold no lease
but those the workers still hold (none: every task has ended), no waiter, and must never have
expired or abandoned anything (``expired_leases`` = ``abandoned_waiters`` = 0). The counters
must also balance: every grant was released, every parked entry was granted or cancelled.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable

import pytest
import redis

from fleetgate.keys import GateKeys
from fleetgate.tools.redisproc import RedisProcess

from ._harness import Control, LimitSampler, Sim, Workers, figure, poll

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

TOTAL = 10_000
PROCS = 3
LIMIT = 4


@pytest.mark.timeout(180)
def test_ten_thousand_cancellations_leak_nothing(
    own_redis: RedisProcess,
    control: Control,
    sim: Sim,
    workers: Callable[..., Workers],
    record_property: Callable[[str, object], None],
) -> None:
    prefix, gate = "fg", "cancel"
    keys = GateKeys.of(prefix, gate)
    r = redis.Redis.from_url(own_redis.url, decode_responses=True)
    with LimitSampler(own_redis.url, prefix, gate, hz=20):
        pool = workers(
            url=own_redis.url, prefix=prefix, gate=gate, limit=LIMIT, lease_ms=60_000,
            waiter_ms=60_000, sim=sim.url, role="cancel", concurrency=16,
            # Chance of an aimed cancel at each point (parked ones dominate otherwise).
            p={"acquire": 0.15, "parked": 0.15, "granted": 0.5, "permit": 0.25,
               "random": 0.25},
        )  # fmt: skip
        share = [TOTAL // PROCS + (1 if i < TOTAL % PROCS else 0) for i in range(PROCS)]
        procs = [pool.spawn(cancels=n, seed=i) for i, n in enumerate(share)]
        pool.wait_ready()
        t0 = time.monotonic()
        poll(
            lambda: all(s.get("state") == "done" for s in control.statuses(pool.pods()).values()),
            150, 0.05, "every storm finished and drained",
        )  # fmt: skip
        t_storm = time.monotonic() - t0
        # Immediately, with every worker alive and heartbeating.
        pipe = r.pipeline(transaction=True)
        pipe.zrange(keys.holders, 0, -1)
        pipe.zrange(keys.lanes, 0, -1)
        pipe.zrange(keys.waiters, 0, -1)
        pipe.hgetall(keys.stats)
        holders, queue, waiters, stats = pipe.execute()
        statuses = control.statuses(pool.pods())
        assert all(w.alive() for w in procs)
        peak = sim.max_between(t0)
        pool.stop_all()
        after_exit = (r.zcard(keys.holders), r.zcard(keys.waiters), r.zcard(keys.waiters))
    r.close()

    live = {i for s in statuses.values() for i in json.loads(s.get("live_leases", "[]"))}
    hits: Counter[str] = Counter()
    for s in statuses.values():
        hits.update(json.loads(s.get("hits", "{}")))
    sent = sum(int(s.get("cancels_sent", 0)) for s in statuses.values())
    completed = sum(int(s.get("completed", 0)) for s in statuses.values())
    errs = {k: v for s in statuses.values() for k, v in s.items() if k.startswith("err:")}
    st = {k: int(v) for k, v in stats.items()}
    phases = {k: v for k, v in hits.items() if not k.startswith("aim:")}

    figure(record_property, "cancel.cancellations", sent)
    figure(record_property, "cancel.completed_permits", completed)
    figure(record_property, "cancel.by_phase", dict(sorted(phases.items())))
    figure(record_property, "cancel.storm_s", round(t_storm, 1))
    figure(record_property, "cancel.leaked_leases", len(set(holders) - live))
    figure(record_property, "cancel.leaked_waiters", len(set(queue) | set(waiters)))
    figure(record_property, "cancel.expired_leases", st.get("expired_leases", 0))
    figure(record_property, "cancel.abandoned_waiters", st.get("abandoned_waiters", 0))
    figure(record_property, "cancel.stats", st)
    figure(record_property, "cancel.sim_peak_running", peak)

    assert sent >= TOTAL
    assert not errs, errs
    for phase in ("acquire_in_flight", "parked", "just_granted", "in_permit"):
        assert phases.get(phase, 0) >= 50, phases
    # 0 leaked leases and 0 leaked waiters, checked while the owners live.
    assert not live, live
    assert holders == [] and queue == [] and waiters == [], (holders, queue, waiters)
    assert st.get("expired_leases", 0) == 0 and st.get("abandoned_waiters", 0) == 0, st
    # Conservation: every grant was given back; every parked entry was granted or left.
    assert st["granted"] == st.get("released", 0), st
    assert st["parked"] == st.get("handed_off", 0) + st.get("cancelled", 0), st
    assert after_exit == (0, 0, 0)
