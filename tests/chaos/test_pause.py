"""A holder frozen (SIGSTOP) past its lease TTL, then thawed (SIGCONT).

The bound this shows: fleetgate never revokes work. While a holder is frozen its lease expires,
the slot is handed to the next waiter, and the frozen holder's call -- still running at the
model server, which does not know its client is frozen -- is one call over the limit until it
ends there. So the cap is exceeded by at most the number of holders frozen past their TTL whose
server-side work outlives the lease; on thaw the holder's ``lease.lost`` is set within about
one heartbeat, and its late release frees nothing of anyone else's (ids are unique; the release
script only removes its own id).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from fleetgate.keys import GateKeys
from fleetgate.tools.redisproc import RedisProcess

from ._harness import Control, LimitSampler, Sim, Workers, figure, poll

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

LIMIT = 4
LEASE_MS = 2000
HB = 0.3


@pytest.mark.timeout(90)
def test_sigstop_holder_past_ttl(
    own_redis: RedisProcess,
    control: Control,
    workers: Callable[..., Workers],
    record_property: Callable[[str, object], None],
) -> None:
    prefix, gate = "fg", "pause"
    keys = GateKeys.of(prefix, gate)
    r = redis.Redis.from_url(own_redis.url, decode_responses=True)
    # 20 ms + 10 ms per passage: load calls of 2 passages take 40 ms, the victim's single
    # call of 500 passages ~5 s, well past its 2 s lease.
    with Sim(base_ms=20, per_passage_ms=10) as sim, LimitSampler(own_redis.url, prefix, gate):
        pool = workers(
            url=own_redis.url, prefix=prefix, gate=gate, limit=LIMIT, lease_ms=LEASE_MS,
            waiter_ms=3000, hb=HB, sim=sim.url, passages=2,
        )  # fmt: skip
        load = [pool.spawn(role="load", loops=4) for _ in range(3)]
        pool.wait_ready(load)
        poll(lambda: sim.running >= LIMIT - 1, 20, what="load running")
        victim = pool.spawn(role="victim", long_passages=500, lost_wait=10.0)
        lease_id = ""

        def victim_running() -> bool:
            nonlocal lease_id
            lease_id = control.status(victim.pod).get("lease_id", "")
            return bool(lease_id) and lease_id in sim.running_tags()

        poll(victim_running, 30, 0.002, "victim's long call running at the simulator")
        sim.watermark = LIMIT  # snapshot who runs whenever the limit is exceeded
        t_start = time.monotonic()
        victim.pause()
        t_stop = time.monotonic()

        # Its lease expires and is reaped by the next script; the slot goes to a waiter.
        poll(lambda: r.zscore(keys.holders, lease_id) is None, 10, 0.005, "reap")
        t_reaped = time.monotonic()
        poll(lambda: lease_id not in sim.running_tags(), 15, 0.005, "victim call ends")
        t_call_end = time.monotonic()
        over_while_frozen = sim.max_between(t_stop, t_call_end)

        # Freeze the load too, so the holders set can only change by the victim's release.
        for w in load:
            w.pause()
        time.sleep(0.1)  # whatever they had sent is processed
        before = set(r.zrange(keys.holders, 0, -1))
        t_cont_wall = time.time()
        victim.resume()
        poll(
            lambda: any(e["ev"] == "released" for e in control.events(victim.pod)),
            10, 0.005, "victim released",
        )  # fmt: skip
        after = set(r.zrange(keys.holders, 0, -1))
        for w in load:
            w.resume()
        t_after = time.monotonic()
        time.sleep(1.0)
        steady_after = sim.max_between(t_after)
        pool.stop_all()
        t_end = time.monotonic()
        sim_peak = sim.stats()["peak_running"]

    ev = {e["ev"]: e for e in control.events(victim.pod)}
    lost_at = ev["call_returned"]["lost_at"]
    stats: dict[str, Any] = r.hgetall(keys.stats)
    overs = [(t, n, tags) for t, n, tags in sim.snapshots if t_start <= t <= t_end]
    frozen_window = t_call_end - t_reaped
    figure(record_property, "pause.limit", LIMIT)
    figure(record_property, "pause.lease_ttl_ms", LEASE_MS)
    figure(record_property, "pause.reaped_after_s", round(t_reaped - t_stop, 3))
    figure(record_property, "pause.max_running_while_frozen", over_while_frozen)
    figure(record_property, "pause.over_limit_window_s", round(frozen_window, 3))
    figure(record_property, "pause.max_running_after_thaw", steady_after)
    figure(record_property, "pause.lost_set_after_thaw_s", round(lost_at - t_cont_wall, 3))
    figure(record_property, "pause.expired_leases", stats.get("expired_leases"))
    figure(record_property, "pause.sim_peak_running", sim_peak)

    # The cap was exceeded by exactly this one frozen holder, and only while its call ran.
    assert over_while_frozen <= LIMIT + 1
    assert max(n for _, n in sim.series(t_start, t_end)) <= LIMIT + 1 >= sim_peak
    for t, n, tags in overs:
        assert lease_id in tags, f"over the limit ({n}) without the frozen holder: {tags}"
        assert t_reaped - 0.05 <= t <= t_call_end + 0.05, (t - t_stop, n)
    assert steady_after <= LIMIT
    # lease.lost is set in the thawed process within about one heartbeat.
    assert lost_at is not None and lost_at - t_cont_wall <= HB + 1.0
    # Its late release freed nothing: the (frozen) others' leases are all still there.
    assert lease_id not in before and after == before, (before, after)
    assert int(stats.get("expired_leases", 0)) == 1  # only the victim's lease expired
    r.close()
