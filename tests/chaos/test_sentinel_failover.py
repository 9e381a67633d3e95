"""Redis Sentinel: the master is SIGKILLed under load and the sentinels promote the replica.

Worker processes reach Redis through a ``redis+sentinel://`` URL. While no master answers they
run in fallback (fair share); once the sentinels name the new master each pod finds it through
them, adopts the permits it still runs and returns to fleet mode. What asynchronous replication
lost (the last grants and releases before the kill) is rebuilt by that adoption, so the cap
holds again once a lease TTL has passed. The figures (failover time, gap, peaks) are printed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import redis

from fleetgate.keys import GateKeys

from .._sentinel import SentinelDeployment
from ._harness import Control, LimitSampler, Sim, Workers, figure, poll

pytestmark = [pytest.mark.chaos, pytest.mark.slow]


@pytest.fixture
def sentinel() -> Iterator[SentinelDeployment]:
    with SentinelDeployment(down_after_ms=1000) as deployment:
        yield deployment


@pytest.mark.timeout(150)
def test_master_killed_under_load_fails_over_without_caller_errors(
    sentinel: SentinelDeployment,
    control: Control,
    sim: Sim,
    workers: Callable[..., Workers],
    record_property: Callable[[str, object], None],
) -> None:
    limit, pods, loops, hb, lease_s = 8, 4, 4, 0.3, 3.0
    prefix, gate = "fg", "sentinel"
    keys = GateKeys.of(prefix, gate)
    url = sentinel.url
    with LimitSampler(url, prefix, gate) as sampler:
        pool = workers(
            url=url, prefix=prefix, gate=gate, limit=limit, lease_ms=int(lease_s * 1000),
            waiter_ms=2000, hb=hb, sim=sim.url, passages=60,
        )  # fmt: skip
        procs = [pool.spawn(role="load", loops=loops) for _ in range(pods)]
        pool.wait_ready()
        names = pool.pods()
        poll(
            lambda: all(s.get("live_pods") == str(pods) for s in control.statuses(names).values()),
            20, 0.05, "every pod sees 4 live pods",
        )  # fmt: skip
        t0 = time.monotonic()
        time.sleep(1.5)
        steady = sim.max_between(t0)

        t_kill = time.monotonic()
        failover_s = sentinel.kill_master_and_wait_failover()
        t_failover = time.monotonic()
        poll(
            lambda: all(s.get("fallback") == "0" for s in control.statuses(names).values())
            and all(int(s.get("fleet_grants", 0)) > 0 for s in control.statuses(names).values()),
            20, 0.02, "every pod back in fleet mode on the new master",
        )  # fmt: skip
        t_back = time.monotonic()
        new_master = redis.Redis(port=sentinel.replica.port, decode_responses=True)
        granted_at_back = int(new_master.hget(keys.stats, "granted") or 0)
        time.sleep(lease_s + 2.0)
        t_end = time.monotonic()
        granted_after = int(new_master.hget(keys.stats, "granted") or 0)
        new_master.close()
        pool.stop_all()
        finals = {w.pod: control.result(w.pod) or {} for w in procs}

    errs = {
        pod: {k: v for k, v in f.items() if k.startswith(("err:", "http:"))}
        for pod, f in finals.items()
    }
    share = -(-limit // pods)
    gap = sim.max_between(t_kill, t_back)
    settling = sim.max_between(t_back, t_back + lease_s)
    after = sim.max_between(t_back + lease_s, t_end)
    figure(record_property, "sentinel.max_running_steady", steady)
    figure(record_property, "sentinel.failover_s", round(failover_s, 2))
    figure(record_property, "sentinel.back_after_failover_s", round(t_back - t_failover, 2))
    figure(record_property, "sentinel.gap_s", round(t_back - t_kill, 2))
    figure(record_property, "sentinel.max_running_gap", gap)
    figure(record_property, "sentinel.max_running_first_ttl", settling)
    figure(record_property, "sentinel.max_running_after", after)
    figure(record_property, "sentinel.grants_after_back", granted_after - granted_at_back)
    figure(record_property, "sentinel.sampler_failures", sampler.failures)
    figure(record_property, "sentinel.errors", errs)

    assert steady <= limit
    assert all(not e for e in errs.values()), errs  # 0 caller-visible errors
    # In the gap each pod runs its fair share; the permits it held from the old master end
    # within a call, so the peak is at most what was held plus the shares.
    assert gap <= limit + share * pods
    assert after <= limit  # once a lease TTL has passed, the cap holds on the new master
    assert granted_after - granted_at_back > 20
