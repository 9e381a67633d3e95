"""Network faults between the clients and Redis: a cut link (through a TCP proxy the test severs
and heals) and killed client connections (``CLIENT KILL``), while worker processes keep calling
the simulator.

* A cut, whether the link resets (RST, refused reconnects) or black-holes (nothing passes,
  clients time out after their 2 s socket timeout): every pod serves under its fair share, no
  caller sees an error; after the heal each pod adopts its running work and resumes fleet mode,
  and from then on no slot stays idle while callers wait for longer than about one heartbeat
  (lost wake-ups are recovered by the listener's reconnect or the heartbeat).
* ``CLIENT KILL`` of the wake-up connections (by id, repeatedly): grants keep flowing, no
  fallback, no slot idle longer than about a heartbeat.
* ``CLIENT KILL TYPE normal`` (every client connection): each kill is an outage of a moment
  for the calls in flight; the pods that met it fall back, recover, and never exceed their
  documented bound.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import redis

from fleetgate.tools.redisproc import RedisProcess

from ._harness import Control, LimitSampler, Sim, Workers, figure, poll
from ._proxy import TcpProxy

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

HB = 0.5


def errors(status: dict[str, str]) -> dict[str, int]:
    return {k: int(v) for k, v in status.items() if k.startswith(("err:", "http:"))}


def all_fallback(control: Control, pods: list[str], on: bool) -> Callable[[], bool]:
    want = "1" if on else "0"
    return lambda: all(s.get("fallback") == want for s in control.statuses(pods).values())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["reset", "blackhole"])
def test_partition_and_heal(
    mode: str,
    own_redis: RedisProcess,
    control: Control,
    sim: Sim,
    workers: Callable[..., Workers],
    record_property: Callable[[str, object], None],
) -> None:
    limit, pods, loops = 8, 4, 4
    share = -(-limit // pods)
    prefix, gate = "fg", "net"
    tag = f"net.{mode}"
    with (
        TcpProxy("127.0.0.1", own_redis.port) as proxy,
        LimitSampler(own_redis.url, prefix, gate) as sampler,
    ):
        pool = workers(
            url=proxy.url, prefix=prefix, gate=gate, limit=limit, lease_ms=5000,
            waiter_ms=3000, hb=HB, sim=sim.url, passages=30,  # 50 ms calls, 2x demand
        )  # fmt: skip
        procs = [pool.spawn(role="load", loops=loops) for _ in range(pods)]
        pool.wait_ready()
        names = pool.pods()
        poll(
            lambda: all(s.get("live_pods") == str(pods) for s in control.statuses(names).values()),
            20, 0.05, "every pod sees the others",
        )  # fmt: skip
        t0 = time.monotonic()
        time.sleep(1.5)
        steady = sim.max_between(t0)
        steady_gap = sim.longest_below(limit, t0)

        before = sampler.last
        t_cut = time.monotonic()
        proxy.sever(mode)  # type: ignore[arg-type]
        at_cut = set(sim.running_tags())
        poll(all_fallback(control, names, True), 15, 0.02, "every pod in fallback")
        t_all_fallback = time.monotonic()
        poll(lambda: not at_cut & set(sim.running_tags()), 10, 0.002, "pre-cut calls end")
        t_drained = time.monotonic()
        time.sleep(2.0)
        t_heal = time.monotonic()
        t_heal_wall = time.time()
        proxy.heal()
        poll(all_fallback(control, names, False), 15, 0.01, "every pod back in fleet mode")
        t_back = time.monotonic()
        poll(lambda: sim.running >= limit, 10, 0.002, "gate full again")
        t_full = time.monotonic()
        time.sleep(2.0)
        t_end = time.monotonic()
        pool.stop_all()
        finals = {w.pod: control.result(w.pod) or {} for w in procs}
        traces = pool.traces()
        full_in_redis = next(s.t for s in sampler.samples if s.t >= t_back and s.holders >= limit)
        notice = sampler.notice_latency(traces, t_back, t_end)

    assert before is not None
    held = sampler.held([w.pod for w in procs], t_cut - 0.06, t_cut + 0.02).values()
    transition_bound = sum(max(h, share) for h in held)
    back = [
        max(e["t"] for e in control.events(w.pod) if e["ev"] == "fallback" and not e["on"])
        - t_heal_wall
        for w in procs
    ]
    errs = {p: errors({k: str(v) for k, v in f.items()}) for p, f in finals.items()}
    transition = sim.max_between(t_cut, max(t_drained, t_cut))
    during = sim.max_between(t_drained, t_heal)
    recovery = sim.max_between(t_heal, t_back)
    after = sim.max_between(t_back, t_end)
    idle_after = sim.longest_below(limit, t_full, t_end)

    figure(record_property, f"{tag}.limit", limit)
    figure(record_property, f"{tag}.max_running_steady", steady)
    figure(record_property, f"{tag}.longest_idle_slot_steady_s", round(steady_gap, 3))
    figure(record_property, f"{tag}.detect_s", round(t_all_fallback - t_cut, 3))
    figure(record_property, f"{tag}.max_running_cut_transition", transition)
    figure(record_property, f"{tag}.transition_bound", transition_bound)
    figure(record_property, f"{tag}.max_running_cut", during)
    figure(record_property, f"{tag}.max_running_recovery", recovery)
    figure(record_property, f"{tag}.back_to_fleet_s", round(max(back), 3))
    figure(record_property, f"{tag}.sim_full_after_heal_s", round(t_full - t_heal, 3))
    figure(record_property, f"{tag}.redis_full_after_back_s", round(full_in_redis - t_back, 3))
    figure(record_property, f"{tag}.longest_idle_slot_at_sim_after_s", round(idle_after, 3))
    figure(record_property, f"{tag}.grants_after_back", len(notice))
    figure(record_property, f"{tag}.max_grant_notice_after_back_s", round(notice[-1][0], 3))
    figure(record_property, f"{tag}.max_running_after", after)
    figure(record_property, f"{tag}.errors", errs)

    assert steady <= limit
    assert all(not e for e in errs.values()), errs
    assert transition <= transition_bound
    assert during <= share * pods <= 1.1 * limit
    assert recovery <= share * pods and after <= limit
    # Back within a probe period (0.25 s), the adoption and the 0.4 s recovery pause: about a
    # heartbeat after the heal.
    assert max(back) <= HB + 0.5
    # Once fleet mode resumes the gate fills at once, and every grant -- hand-offs included,
    # whose wake-up connections were cut too -- reaches its caller within about a heartbeat.
    # (Idle slots measured at the simulator include its own HTTP latency on a busy 2-core box;
    # they are printed, not asserted.)
    assert full_in_redis - t_back <= HB + 0.5
    assert len(notice) > 20 and notice[-1][0] <= HB + 0.5
    # And every slot is used again at the server within about a heartbeat of fleet mode's
    # return (asserted above to come within HB + 0.5 of the heal): permits released during the
    # cut (their release failed) are retried, not left to their lease TTL (5 s). Counted from
    # the return, not the heal, so a slow return under CPU load is not counted twice (seen:
    # back 0.71 s, full 1.43 s after the heal in a loaded full-suite run).
    assert t_full - t_back <= HB + 0.75


@pytest.mark.timeout(120)
def test_client_kill_under_load(
    own_redis: RedisProcess,
    control: Control,
    sim: Sim,
    workers: Callable[..., Workers],
    record_property: Callable[[str, object], None],
) -> None:
    limit, pods, loops = 6, 3, 4
    share = -(-limit // pods)
    prefix, gate = "fg", "kill"
    r = redis.Redis.from_url(own_redis.url, decode_responses=True)
    with LimitSampler(own_redis.url, prefix, gate, hz=100) as sampler:
        pool = workers(
            url=own_redis.url, prefix=prefix, gate=gate, limit=limit, lease_ms=5000,
            waiter_ms=3000, hb=HB, sim=sim.url, passages=30,
        )  # fmt: skip
        procs = [pool.spawn(role="load", loops=loops) for _ in range(pods)]
        pool.wait_ready()
        names = pool.pods()
        poll(lambda: sim.running >= limit, 20, 0.01, "gate full")

        # 1. The wake-up connections (blocked in BLPOP), killed by id every 200 ms for 4 s.
        t0 = time.monotonic()
        kills = 0
        while time.monotonic() - t0 < 4.0:
            for c in r.client_list():
                if c.get("cmd") == "blmpop":
                    kills += r.client_kill_filter(_id=c["id"])
            time.sleep(0.2)
        t1 = time.monotonic()
        time.sleep(0.5)
        st = control.statuses(names)
        fallbacks = sum(int(s.get("fallback_on", 0)) for s in st.values())
        by_id_max = sim.max_between(t0, t1)
        by_id_gap = sim.longest_below(limit, t0, t1)

        # 2. Every normal client connection, three times, 2.5 s apart.
        rounds = []
        for _ in range(3):
            t_k = time.monotonic()
            killed = r.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
            time.sleep(2.5)
            rounds.append((t_k, killed))
        t2 = time.monotonic()
        poll(all_fallback(control, names, False), 10, 0.02, "fleet mode after the kills")
        st2 = control.statuses(names)
        pool.stop_all()
        finals = {w.pod: control.result(w.pod) or {} for w in procs}
        notice = sampler.notice_latency(pool.traces(), t0, t1)
    r.close()

    normal_max = sim.max_between(t1, t2)
    normal_fallbacks = sum(int(s.get("fallback_on", 0)) for s in st2.values()) - fallbacks
    errs = {p: errors({k: str(v) for k, v in f.items()}) for p, f in finals.items()}
    figure(record_property, "client_kill.limit", limit)
    figure(record_property, "client_kill.wake_connections_killed", kills)
    figure(record_property, "client_kill.fallbacks_from_wake_kills", fallbacks)
    figure(record_property, "client_kill.max_running_wake_kills", by_id_max)
    figure(record_property, "client_kill.longest_idle_slot_at_sim_s", round(by_id_gap, 3))
    figure(record_property, "client_kill.grants_during_wake_kills", len(notice))
    figure(record_property, "client_kill.max_grant_notice_s", round(notice[-1][0], 3))
    figure(record_property, "client_kill.p50_grant_notice_s", round(notice[len(notice) // 2][0], 3))
    figure(record_property, "client_kill.normal_kills", [k for _, k in rounds])
    figure(record_property, "client_kill.fallbacks_from_normal_kills", normal_fallbacks)
    figure(record_property, "client_kill.max_running_normal_kills", normal_max)
    figure(record_property, "client_kill.errors", errs)

    assert kills >= 10
    assert fallbacks == 0  # a lost wake-up connection is not an outage
    assert by_id_max <= limit
    # Lost wake-ups are recovered within about a heartbeat (the listener reconnects after a
    # heartbeat interval; the heartbeat reports granted waiters).
    assert len(notice) > 20 and notice[-1][0] <= HB + 0.5
    assert all(not e for e in errs.values()), errs
    # Killing every client connection is a momentary outage for the calls in flight then:
    # bounded by the pods' shares (plus what each pod held beyond its share at the kill, until
    # those calls end). Each kill reached every pod (its wake-up connection at least), but how
    # many pods fall back is up to chance: a connection idle in the pool at the kill is replaced
    # by redis-py 8.2's pool before its next command (8.1's handed it out broken, so every pod
    # fell back), and a pod with no call in flight then does not notice the kill.
    assert all(killed >= pods for _, killed in rounds), rounds
    assert normal_max <= limit + pods * (loops - share)


@pytest.mark.timeout(60)
def test_parked_callers_keep_their_deadline_when_redis_stops_answering(
    record_property: Callable[[str, object], None],
) -> None:
    """The total deadline holds while Redis black-holes: a parked caller whose deadline fires
    does not await its cancel's round trip (bounded only by the socket timeout, 2 s, and the
    pool's 10 s wait for a connection: 30 callers would be late by a median 6 s). The cancel
    still goes, in the background, and is retried until Redis answers."""
    import asyncio

    from fleetgate.client import DeadlineExceeded, Fleet

    async def main(url: str, proxy: TcpProxy) -> list[float]:
        async with Fleet(url, heartbeat_interval=1.0) as fleet:
            gate = fleet.gate("g", floor=1, ceiling=1)
            held = asyncio.Event()

            async def holder() -> None:
                async with gate.permit(deadline=None):
                    held.set()
                    await asyncio.sleep(30)

            task = asyncio.create_task(holder())
            await held.wait()
            late: list[float] = []

            async def waiter() -> None:
                t0 = time.monotonic()
                with pytest.raises(DeadlineExceeded):
                    async with gate.permit(deadline=1.5):
                        pass
                late.append(time.monotonic() - t0 - 1.5)

            waiters = [asyncio.create_task(waiter()) for _ in range(30)]
            await asyncio.sleep(1.0)  # all parked
            assert len(gate.waiters) == 30
            await asyncio.to_thread(proxy.sever, "blackhole")  # 0.5 s before their deadline
            await asyncio.gather(*waiters)
            task.cancel()
            await asyncio.to_thread(proxy.heal)
            return late

    with RedisProcess() as red, TcpProxy("127.0.0.1", red.port) as proxy:
        late = asyncio.run(main(proxy.url, proxy))
    figure(record_property, "deadline.max_late_s", round(max(late), 3))
    assert max(late) < 0.5, sorted(late)
