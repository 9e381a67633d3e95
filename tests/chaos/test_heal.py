"""A healed partition: the cut-off pod's leases lapsed and their units went to another pod.

Pod A reaches Redis through a TCP proxy the test black-holes for 6 s, longer than A's 2 s
leases; pod B reaches Redis directly. Redis reaps A's leases and grants their units to B. When
the link heals, A adopts its running work (``adopt.lua``): a lease whose renewal time has passed
and which Redis no longer holds may have gone to another pod, so it is not counted again; A's
holders are told (``lease.lost``, ``LeaseLost`` when the block ends). The count never exceeds
the limit beyond the frozen-holder allowance (A's calls running at the cut: docs/failure-modes.md,
"Frozen holders").

The same holds for a pod in ``on_redis_error="fail"`` mode: its new calls fail while it is cut
off, but the work it runs keeps running (nothing revokes it), over the limit by that work until
it ends; its heartbeat tells the holders when the link heals.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from fleetgate.tools.redisproc import RedisProcess

from ._harness import Control, LimitSampler, Sim, Workers, figure, owned_by, poll
from ._proxy import TcpProxy

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

LIMIT = 4
LEASE_MS = 2000
HB = 0.5


@pytest.mark.timeout(120)
@pytest.mark.parametrize("on_redis_error", ["fair_share", "fail"])
def test_healed_partition_tells_the_holders_of_lapsed_leases(
    on_redis_error: str,
    own_redis: RedisProcess,
    control: Control,
    workers: Callable[..., Workers],
    record_property: Callable[[str, object], None],
) -> None:
    prefix, gate = "fg", "heal"
    # 20 ms + 30 ms per passage: B's calls of 2 passages take 80 ms, A's of 400 passages 12 s
    # (they outlive B's start, the 6 s cut and A's adoption).
    with (
        Sim(base_ms=20, per_passage_ms=30) as sim,
        TcpProxy("127.0.0.1", own_redis.port) as proxy,
        LimitSampler(own_redis.url, prefix, gate) as sampler,
    ):
        pool = workers(
            prefix=prefix, gate=gate, limit=LIMIT, lease_ms=LEASE_MS, waiter_ms=3000, hb=HB,
            sim=sim.url,
        )  # fmt: skip
        a = pool.spawn(
            role="load", url=proxy.url, loops=2, passages=400, on_redis_error=on_redis_error
        )
        pool.wait_ready()
        poll(lambda: sum(owned_by(t, a.pod) for t in sim.running_tags()) == 2, 20, 0.01,
             "A's two long calls run")  # fmt: skip
        b = pool.spawn(role="load", url=own_redis.url, loops=4, passages=2)
        pool.wait_ready()
        poll(lambda: sim.running >= LIMIT, 20, 0.01, "gate full")
        at_cut = [t for t in sim.running_tags() if owned_by(t, a.pod)]
        t_cut = time.monotonic()
        proxy.sever("blackhole")
        time.sleep(6.0)
        t_heal = time.monotonic()
        running_at_heal = set(at_cut) & set(sim.running_tags())
        proxy.heal()
        poll(lambda: control.status(a.pod).get("fallback") == "0", 15, 0.02, "A back")
        t_back = time.monotonic()
        poll(lambda: not set(at_cut) & set(sim.running_tags()), 15, 0.01, "A's calls end")
        t_ended = time.monotonic()
        time.sleep(1.0)
        t_end = time.monotonic()
        pool.stop_all()
        finals = {w.pod: control.result(w.pod) or {} for w in (a, b)}
        revived = [
            s.t - t_heal for s in sampler.samples if s.t > t_heal and set(s.ids) & set(at_cut)
        ]
        b_took = max((sum(owned_by(i, b.pod) for i in s.ids) for s in sampler.samples
                      if t_cut < s.t < t_heal), default=0)  # fmt: skip

    lost = {p: int(f.get("lost", 0)) for p, f in finals.items()}
    errs = {
        p: {k: v for k, v in f.items() if k.startswith(("err:", "http:"))}
        for p, f in finals.items()
    }
    peak = sim.max_between(t_cut, t_end)
    after = sim.max_between(t_ended, t_end)
    tag = f"heal.{on_redis_error}"
    figure(record_property, "heal.limit", LIMIT)
    figure(record_property, f"{tag}.a_running_at_cut", len(at_cut))
    figure(record_property, f"{tag}.b_units_during_cut", b_took)
    figure(record_property, f"{tag}.a_back_after_heal_s", round(t_back - t_heal, 3))
    figure(record_property, f"{tag}.lost", lost)
    figure(record_property, f"{tag}.revived_samples", len(revived))
    figure(record_property, f"{tag}.max_running", peak)
    figure(record_property, f"{tag}.max_running_after_a_calls", after)
    figure(record_property, f"{tag}.errors", errs)

    assert len(at_cut) == 2 and running_at_heal == set(at_cut)  # A's work outlived the cut
    assert b_took == LIMIT  # A's units went to B meanwhile
    # Every lapsed lease's holder was told, and none of them counted again.
    assert lost[a.pod] == len(at_cut) and lost[b.pod] == 0, lost
    assert not revived, revived[:5]
    # The frozen-holder allowance: A's calls running at the cut, until they end.
    assert peak <= LIMIT + len(at_cut)
    assert after <= LIMIT
    # "fail" mode: A's callers get RedisUnavailable while cut off, nothing else; the running
    # work keeps running (the frozen-holder allowance above, not the cap).
    allowed = {"err:RedisUnavailable"} if on_redis_error == "fail" else set()
    assert set(errs[a.pod]) <= allowed and not errs[b.pod], errs
