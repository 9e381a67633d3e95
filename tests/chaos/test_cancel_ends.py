"""Every cancelled task ends, and nothing leaks.

``test_cancellations.py`` checks that 10,000 cancellations leak nothing in Redis, but its tasks
finish by themselves: a cancellation that is *lost* -- swallowed on its way, e.g. by
``asyncio.wait_for`` inside redis-py 8.1 on Python 3.11 when it races the completion of a
command -- only shows there as a call that completed although it was cancelled. Here every task
waits forever inside its permit, so a lost cancellation is a task that never ends (and holds a
permit meanwhile, or enters its permit after it was cancelled). Both ``gate.permit()`` and
``gate.acquire()`` are used, with no deadline or a long one.

4 processes × 2,500 cancellations, a fleet-wide limit of 2 (parking, hand-offs across processes
and grant races all the time), aimed at the acquire script's round trip (0-6 loop iterations or
0-1 ms after it was issued), at parked waiters, at the hand-off (the grant/cancel race), at the
acquire's reply, inside the permit, and at random times (``_worker_cancel.cancel_ends``).

Afterwards: every task ended, each within ``END_BOUND_S`` of its cancellation; in every process
the gate holds no lease and no waiter; with 60 s TTLs (no leak can hide behind expiry) Redis
holds no lease and no waiter while the processes live, and none once they have closed their
fleets; nothing expired or was abandoned, and the counters balance.
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

from ._harness import Control, Sim, Workers, figure, poll

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

PROCS = 4
PER_PROC = 2_500
LIMIT = 2
# A cancelled task must end within this many seconds (it takes a round trip or two); a task
# still running after it is a hang.
END_BOUND_S = 2.0


@pytest.mark.timeout(240)
def test_every_cancelled_task_ends_and_nothing_leaks(
    own_redis: RedisProcess,
    control: Control,
    sim: Sim,
    workers: Callable[..., Workers],
    record_property: Callable[[str, object], None],
) -> None:
    prefix, gate = "fg", "ends"
    keys = GateKeys.of(prefix, gate)
    r = redis.Redis.from_url(own_redis.url, decode_responses=True)
    pool = workers(
        url=own_redis.url, prefix=prefix, gate=gate, limit=LIMIT, lease_ms=60_000,
        waiter_ms=60_000, sim=sim.url, role="cancel_ends", concurrency=12,
        end_bound_s=END_BOUND_S, budget_s=45.0,
    )  # fmt: skip
    procs = [pool.spawn(cancels=PER_PROC, seed=100 + i) for i in range(PROCS)]
    pool.wait_ready()
    t0 = time.monotonic()
    poll(
        lambda: all(s.get("state") == "done" for s in control.statuses(pool.pods()).values()),
        150, 0.05, "every storm finished and drained",
    )  # fmt: skip
    t_storm = time.monotonic() - t0
    # While every worker is alive and heartbeating.
    pipe = r.pipeline(transaction=True)
    pipe.zrange(keys.holders, 0, -1)
    pipe.zrange(keys.lanes, 0, -1)
    pipe.zrange(keys.waiters, 0, -1)
    pipe.hgetall(keys.stats)
    holders, queue, waiters, stats = pipe.execute()
    statuses = control.statuses(pool.pods())
    assert all(w.alive() for w in procs)
    pool.stop_all()  # each worker closes its fleet and exits
    after_exit = (r.zcard(keys.holders), r.zcard(keys.waiters), r.zcard(keys.waiters))
    r.close()

    def total(field: str) -> int:
        return sum(int(float(s.get(field, 0))) for s in statuses.values())

    hits: Counter[str] = Counter()
    apis: Counter[str] = Counter()
    hung_detail: Counter[str] = Counter()
    lost_where: Counter[str] = Counter()
    for s in statuses.values():
        hits.update(json.loads(s.get("hits", "{}")))
        apis.update(json.loads(s.get("apis", "{}")))
        hung_detail.update(dict(json.loads(s.get("hung_detail", "[]"))))
        lost_where.update(dict(json.loads(s.get("lost_where", "[]"))))
    phases = {k: v for k, v in hits.items() if not k.startswith("aim:")}
    aims = {k[4:]: v for k, v in hits.items() if k.startswith("aim:")}
    errs = {k: v for s in statuses.values() for k, v in s.items() if k.startswith("err:")}
    st = {k: int(v) for k, v in stats.items()}
    end_max = max(float(s.get("end_max_ms", -1)) for s in statuses.values())
    end_p99 = max(float(s.get("end_p99_ms", -1)) for s in statuses.values())

    figure(record_property, "ends.cancellations", total("cancels_sent"))
    figure(record_property, "ends.tasks", total("tasks"))
    figure(record_property, "ends.by_phase", dict(sorted(phases.items())))
    figure(record_property, "ends.by_aim", dict(sorted(aims.items())))
    figure(record_property, "ends.by_api", dict(apis))
    figure(record_property, "ends.storm_s", round(t_storm, 1))
    figure(record_property, "ends.hung", total("hung"))
    figure(record_property, "ends.hung_where", dict(hung_detail))
    figure(record_property, "ends.entered_permit_after_cancel", total("entered_after_cancel"))
    figure(record_property, "ends.lost_where", dict(lost_where))
    figure(record_property, "ends.never_ended", total("stuck"))
    figure(record_property, "ends.end_p99_ms_worst_proc", end_p99)
    figure(record_property, "ends.end_max_ms", end_max)
    figure(record_property, "ends.in_process_left", {
        f: total(f) for f in ("leases_left", "waiters_left", "local_left", "bg_left")
    })  # fmt: skip
    figure(record_property, "ends.redis_while_alive", (len(holders), len(queue), len(waiters)))
    figure(record_property, "ends.redis_after_exit", after_exit)
    figure(record_property, "ends.stats", st)
    figure(record_property, "ends.errors", errs)

    assert total("cancels_sent") >= PROCS * PER_PROC
    assert not errs, errs
    assert total("completed") == 0
    assert total("cancelled") == total("tasks")
    for phase in ("acquire_in_flight", "parked", "just_granted", "in_permit"):
        assert phases.get(phase, 0) >= 50, phases
    for aim in ("acquire_rt", "parked", "just_granted", "reply", "in_permit", "random"):
        assert aims.get(aim, 0) >= 50, aims
    assert set(apis) == {"permit", "acquire"}
    # Every cancelled task ended, promptly, and none entered its permit after its cancellation.
    assert total("entered_after_cancel") == 0, lost_where
    assert total("hung") == 0, hung_detail
    assert total("stuck") == 0
    # Nothing left in any process, nor in Redis (60 s TTLs: nothing expired meanwhile).
    for f in ("leases_left", "waiters_left", "local_left", "bg_left"):
        assert total(f) == 0, (f, statuses)
    assert holders == [] and queue == [] and waiters == [], (holders, queue, waiters)
    assert st.get("expired_leases", 0) == 0 and st.get("abandoned_waiters", 0) == 0, st
    assert st["granted"] == st.get("released", 0), st
    assert st["parked"] == st.get("handed_off", 0) + st.get("cancelled", 0), st
    assert after_exit == (0, 0, 0)
