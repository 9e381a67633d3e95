"""When Redis refuses instead of failing: replies that mean "cannot write here now".

Nothing is cut here: the clients reach Redis, which answers every call, but with a refusal:

* ``NOREPLICAS``: the master runs ``min-replicas-to-write 1`` (what Redis recommends against
  split brain) and its one replica is frozen (SIGSTOP) for longer than a lease TTL. Every pod
  takes the outage path (the fair-share fallback), as for a cut link: no caller error, no lease
  lost on a pod that was never cut off, the fallback bound held, and the leases the refused
  writes could not renew are kept when writes return (nobody took their units).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import redis

from fleetgate.stamp import init_prefix
from fleetgate.tools.redisproc import RedisProcess

from ._harness import Control, LimitSampler, Sim, Workers, figure, poll

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

HB = 0.5
LEASE_MS = 2000


def caller_errors(status: dict[str, object]) -> dict[str, int]:
    return {k: int(str(v)) for k, v in status.items() if k.startswith(("err:", "http:"))}


def writes_refused(r: redis.Redis) -> bool:
    try:
        r.set("chaos:probe", 1)
    except redis.ResponseError as exc:
        if str(exc).startswith("NOREPLICAS"):
            return True
        raise
    return False


@contextmanager
def master_with_replica(*master_args: str) -> Iterator[tuple[RedisProcess, RedisProcess]]:
    """A master (``master_args`` added) and one replica in sync, both private processes."""
    master = RedisProcess(extra_args=list(master_args))
    replica = RedisProcess()
    try:
        master.start()
        replica.extra_args += ["--replicaof", "127.0.0.1", str(master.port)]
        replica.start()
        with redis.Redis.from_url(replica.url, decode_responses=True) as rr:
            poll(lambda: rr.info("replication")["master_link_status"] == "up", 15, 0.05,
                 "replica in sync")  # fmt: skip
        with redis.Redis.from_url(master.url) as r:
            poll(lambda: not writes_refused(r), 15, 0.05, "writes accepted")
        # stamped, as own_redis is: no recovery fence until a wipe
        outcome = asyncio.run(init_prefix(master.url, "fg"))
        assert outcome.result == "stamped", outcome.message()
        yield master, replica
    finally:
        if replica.proc is not None and replica.proc.poll() is None:
            os.kill(replica.proc.pid, signal.SIGCONT)
        replica.close()
        master.close()


@pytest.mark.timeout(120)
def test_noreplicas_takes_the_outage_path(
    control: Control,
    workers: Callable[..., Workers],
    record_property: Callable[[str, object], None],
) -> None:
    limit, pods, loops = 4, 3, 4
    share = -(-limit // pods)
    prefix, gate = "fg", "norepl"
    with master_with_replica("--min-replicas-to-write", "1", "--min-replicas-max-lag", "2") as (
        master,
        replica,
    ):
        r = redis.Redis.from_url(master.url, decode_responses=True, socket_timeout=2)
        assert replica.proc is not None
        # 20 ms + 20 ms per passage: load calls of 2 passages take 60 ms, long ones 8 s.
        with (
            Sim(base_ms=20, per_passage_ms=20) as sim,
            LimitSampler(master.url, prefix, gate) as sampler,
        ):
            pool = workers(
                url=master.url, prefix=prefix, gate=gate, limit=limit, lease_ms=LEASE_MS,
                waiter_ms=3000, hb=HB, sim=sim.url, passages=2,  # 2x demand
            )  # fmt: skip
            procs = [pool.spawn(role="load", loops=loops) for _ in range(pods - 1)]
            # One permit at a time, each around an 8 s call: held across the whole refusal.
            procs.append(pool.spawn(role="load", loops=1, passages=400))
            pool.wait_ready()
            names = pool.pods()
            poll(lambda: sim.running >= limit, 20, 0.01, "gate full")
            try:
                poll(lambda: procs[-1].pod in str(sim.running_tags()), 20, 0.01, "long call runs")
            except TimeoutError:
                print(sim.running_tags(), control.statuses(names), procs[-1].tail())
                raise
            t0 = time.monotonic()
            time.sleep(1.0)

            os.kill(replica.proc.pid, signal.SIGSTOP)
            t_freeze = time.monotonic()
            poll(lambda: writes_refused(r), 15, 0.005, "NOREPLICAS")
            t_refused = time.monotonic()
            # Refused for longer than a lease TTL: no lease can be renewed meanwhile.
            time.sleep(LEASE_MS / 1000 + 1.5)
            os.kill(replica.proc.pid, signal.SIGCONT)
            t_thaw = time.monotonic()
            poll(lambda: not writes_refused(r), 15, 0.005, "writes accepted again")
            t_writes = time.monotonic()
            time.sleep(3.0)
            t_end = time.monotonic()
            statuses = control.statuses(names)
            pool.stop_all()
            finals = {w.pod: control.result(w.pod) or {} for w in procs}
        held = sampler.held(names, t_refused - 0.1, t_refused + 0.02).values()
        logs = {w.pod: w.log.read_text(errors="replace") for w in procs}
        r.close()

    transition_bound = sum(max(h, share) for h in held)
    steady = sim.max_between(t0, t_refused)
    during = sim.max_between(t_refused, t_writes)
    after = sim.max_between(t_writes + 1.0, t_end)
    recovery = sim.max_between(t_writes, t_end)
    errs = {p: caller_errors(f) for p, f in finals.items()}
    lost = {p: int(f.get("lost", 0)) + int(f.get("lost_stop", 0)) for p, f in finals.items()}
    fell_back = {p: int(f.get("fallback_on", 0)) for p, f in finals.items()}
    in_fleet = {p: s.get("fallback") for p, s in statuses.items()}
    state_errors = {p: text.count("GateStateError") for p, text in logs.items()}
    tag = "noreplicas"
    figure(record_property, f"{tag}.limit", limit)
    figure(record_property, f"{tag}.refused_after_freeze_s", round(t_refused - t_freeze, 3))
    figure(record_property, f"{tag}.refused_s", round(t_writes - t_refused, 3))
    figure(record_property, f"{tag}.writes_after_thaw_s", round(t_writes - t_thaw, 3))
    figure(record_property, f"{tag}.max_running_steady", steady)
    figure(record_property, f"{tag}.transition_bound", transition_bound)
    figure(record_property, f"{tag}.max_running_refused", during)
    figure(record_property, f"{tag}.max_running_recovery", recovery)
    figure(record_property, f"{tag}.max_running_after", after)
    figure(record_property, f"{tag}.caller_errors", errs)
    figure(record_property, f"{tag}.gate_state_errors_logged", state_errors)
    figure(record_property, f"{tag}.leases_lost", lost)
    figure(record_property, f"{tag}.fallbacks", fell_back)

    assert steady <= limit
    assert all(not e for e in errs.values()), errs
    assert not any(state_errors.values()), state_errors
    # No pod was cut off: none of its leases is lost (they were kept, not revived).
    assert not any(lost.values()), lost
    # Every pod took the outage path, and is back in fleet mode 3 s after writes returned.
    assert all(n >= 1 for n in fell_back.values()), fell_back
    assert all(v == "0" for v in in_fleet.values()), in_fleet
    # The fallback's bound while refused, and the shares' while the pods come back.
    assert during <= transition_bound
    assert recovery <= share * pods and after <= limit


@pytest.mark.timeout(120)
def test_out_of_memory_is_one_outage(
    own_redis: RedisProcess,
    control: Control,
    workers: Callable[..., Workers],
    record_property: Callable[[str, object], None],
) -> None:
    """maxmemory reached (noeviction): every script that writes is refused (OOM), acquire,
    adopt, the heartbeats, release and cancel alike. Every pod falls back within a heartbeat --
    also one whose callers are all parked or running, which calls no acquire -- and none is
    handed the units another pod's fallback no longer counts."""
    limit, pods = 4, 2
    share = -(-limit // pods)
    prefix, gate = "fg", "oom"
    r = redis.Redis.from_url(own_redis.url, decode_responses=True)
    # 20 ms + 20 ms per passage: A's calls of 2 passages take 60 ms, B's of 300 passages 6 s.
    with (
        Sim(base_ms=20, per_passage_ms=20) as sim,
        LimitSampler(own_redis.url, prefix, gate) as sampler,
    ):
        pool = workers(
            url=own_redis.url, prefix=prefix, gate=gate, limit=limit, lease_ms=10_000,
            waiter_ms=3000, hb=HB, sim=sim.url,
        )  # fmt: skip
        a = pool.spawn(role="load", loops=4, passages=2)
        b = pool.spawn(role="load", loops=4, passages=300)
        pool.wait_ready()
        names = pool.pods()
        poll(lambda: sim.running >= limit, 20, 0.01, "gate full")
        time.sleep(1.0)
        t_oom, t_oom_wall = time.monotonic(), time.time()
        r.config_set("maxmemory", 1)  # below what Redis uses: every deny-oom write refused
        at_oom = set(sim.running_tags())
        poll(lambda: not at_oom & set(sim.running_tags()), 10, 0.005, "calls at the refusal end")
        t_drained = time.monotonic()
        time.sleep(max(0.0, 8.0 - (t_drained - t_oom)))  # longer than B's calls: they end
        r.config_set("maxmemory", 0)
        t_freed = time.monotonic()
        poll(lambda: all(s.get("fallback") == "0" for s in control.statuses(names).values()),
             15, 0.02, "every pod back in fleet mode")  # fmt: skip
        t_back = time.monotonic()
        time.sleep(1.0)
        t_end = time.monotonic()
        pool.stop_all()
        finals = {w.pod: control.result(w.pod) or {} for w in (a, b)}
        held = sampler.held(names, t_oom - 0.1, t_oom + 0.02).values()
    r.close()

    def fell_back_after(pod: str) -> float | None:
        on = [e["t"] for e in control.events(pod) if e["ev"] == "fallback" and e["on"]]
        return round(min(on) - t_oom_wall, 3) if on else None

    fallback_s = {p: fell_back_after(p) for p in names}
    transition_bound = sum(max(h, share) for h in held)
    transition = sim.max_between(t_oom, t_drained)
    during = sim.max_between(t_drained, t_freed)
    recovery = sim.max_between(t_freed, t_end)
    errs = {p: caller_errors(f) for p, f in finals.items()}
    tag = "oom"
    figure(record_property, f"{tag}.limit", limit)
    figure(record_property, f"{tag}.fallback_after_s", fallback_s)
    figure(record_property, f"{tag}.transition_bound", transition_bound)
    figure(record_property, f"{tag}.max_running_oom_transition", transition)
    figure(record_property, f"{tag}.max_running_oom", during)
    figure(record_property, f"{tag}.max_running_recovery", recovery)
    figure(record_property, f"{tag}.back_after_freed_s", round(t_back - t_freed, 3))
    figure(record_property, f"{tag}.caller_errors", errs)

    assert all(not e for e in errs.values()), errs
    # No pod stays in fleet mode while it cannot acquire there: each falls back within about
    # a heartbeat of the refusal (renewals every min(HB, lease TTL / 3)).
    assert all(t is not None and t <= HB + 0.5 for t in fallback_s.values()), fallback_s
    # The fallback's bound: what each pod held at the refusal (or its share) until those calls
    # end, then the shares, while memory is full and while the pods come back.
    assert transition <= transition_bound
    assert during <= share * pods and recovery <= share * pods


@pytest.mark.timeout(150)
def test_a_write_pause_serves_from_the_fallback_like_a_full_pause(
    own_redis: RedisProcess,
    control: Control,
    sim: Sim,
    workers: Callable[..., Workers],
    record_property: Callable[[str, object], None],
) -> None:
    """``CLIENT PAUSE ms WRITE`` (a failover's or an operator's): PING answers, every write
    waits. A pod in the fallback must not take the answered PING for Redis being back (and
    stop its local permits while its adoption waits out the pause): it serves from the
    fallback as under ``CLIENT PAUSE ms ALL`` of the same length."""
    limit, pods, pause_ms = 4, 2, 6000
    share = -(-limit // pods)
    prefix, gate = "fg", "paused"
    r = redis.Redis.from_url(own_redis.url, decode_responses=True)
    with LimitSampler(own_redis.url, prefix, gate) as sampler:
        pool = workers(
            url=own_redis.url, prefix=prefix, gate=gate, limit=limit, lease_ms=10_000,
            waiter_ms=3000, hb=HB, sim=sim.url, passages=180,  # 200 ms calls, 2x demand
        )  # fmt: skip
        for _ in range(pods):
            pool.spawn(role="load", loops=4)
        pool.wait_ready()
        names = pool.pods()
        poll(lambda: sim.running >= limit, 20, 0.01, "gate full")
        # Each pod's share is ceil(limit / live pods) once it has counted its peers (1 before).
        poll(
            lambda: all(s.get("live_pods") == str(pods) for s in control.statuses(names).values()),
            20, 0.05, "every pod sees the others",
        )  # fmt: skip
        time.sleep(1.5)
        local: dict[str, int] = {}
        peaks: dict[str, tuple[int, int]] = {}
        walls: dict[str, float] = {}

        def local_grants() -> int:
            return sum(int(s.get("local_grants", 0)) for s in control.statuses(names).values())

        for kind in ("WRITE", "ALL"):
            time.sleep(1.0)
            before = local_grants()
            t_pause = time.monotonic()
            held = sampler.held(names, t_pause - 0.1, t_pause).values()
            walls[kind] = time.time()
            r.execute_command("CLIENT", "PAUSE", pause_ms, kind)
            time.sleep(pause_ms / 1000)
            poll(lambda: all(s.get("fallback") == "0" for s in control.statuses(names).values()),
                 15, 0.02, "every pod back in fleet mode")  # fmt: skip
            local[kind] = local_grants() - before
            peaks[kind] = (sim.max_between(t_pause), sum(max(h, share) for h in held))
        pool.stop_all()
        events = [e for p in names for e in control.events(p) if e["ev"] == "fallback"]
    r.close()

    def seen(kind: str, on: bool) -> list[float]:
        t0, t1 = walls[kind], walls.get("ALL" if kind == "WRITE" else "", 1e18)
        return sorted(round(e["t"] - t0, 2) for e in events if e["on"] == on and t0 < e["t"] < t1)

    figure(record_property, "pause_write.limit", limit)
    for kind in walls:
        figure(record_property, f"pause_write.{kind}.fallback_on_s", seen(kind, True))
        figure(record_property, f"pause_write.{kind}.fallback_off_s", seen(kind, False))
    figure(record_property, "pause_write.local_grants", local)
    figure(record_property, "pause_write.max_running_and_bound", peaks)
    assert local["ALL"] > 0
    assert local["WRITE"] >= 0.8 * local["ALL"], local
    assert all(peak <= bound for peak, bound in peaks.values()), peaks
