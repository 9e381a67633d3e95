"""Soak: random faults every few seconds while a fleet of worker processes calls the simulator,
with the invariant checked continuously against what runs at the simulator.

    python -m tests.chaos.soak --minutes 10          # the long mode; prints a summary
    python -m tests.chaos.soak --seconds 60 --seed 7 # the suite's quick mode runs this too

Cast: a private Redis, a coordinator pair (``fleetgate coordinator``: gate config + reaper,
leader election), ``--workers`` worker processes (half of them hold each permit for two
simulator calls, so a holder thawed after its lease expired still has work to do in it), the
rerank simulator on a thread of this process recording every call running at it, and a sampler
reading the gate's limit and holders from Redis at 50 Hz.

Faults, one every ``--every`` seconds (uniform in [every/2, 3·every/2]), chosen at random:

* ``kill``: SIGKILL a worker, start a new one in its place a moment later;
* ``pause_short``: SIGSTOP a worker for 0.2-1 s (well inside its lease), then SIGCONT;
* ``pause_long``: SIGSTOP a worker past its lease TTL (TTL + 0.5-1.5 s), then SIGCONT;
* ``kill_leader``: SIGKILL the coordinator leader, start a new standby;
* ``redis_restart`` (only with ``--redis-restarts``): SIGKILL Redis, start it empty 1-2 s later
  and wait until every worker is back in fleet mode;
* ``oom``, ``write_pause`` (only with ``--refusals``): Redis keeps answering but refuses or
  holds writes for 1-3 s -- ``maxmemory`` set below its use (OOM), ``CLIENT PAUSE ms WRITE`` --
  and the fleet serves from its fallback, under the same allowance as a restart;
* ``wipe`` (only with ``--redis-restarts``): a fresh worker process is started (it leaves by
  itself 8-15 s later), then Redis loses every key -- a restart as above, or a ``FLUSHALL``
  under the running fleet -- and the fresh worker opens its fleet the moment Redis answers (new
  connections, a gate it never used): the recovery fence must keep it from being granted the
  work the wipe forgot. After a FLUSHALL no pod sees an outage, so no allowance applies at all.

With ``--mixed`` every permit draws a weight (1-3 units), a band (priority 0 or 10), a tenant
(one of three) and tokens (40, 100 or 200, under a token budget of ``token_limit``, 300) and
runs ``weight`` simulator calls at once, so what runs at the simulator is the units in use and
the invariant below is the admission order's "units held <= limit" under the same faults; 30 %
of its calls are preceded by a resize of its tokens to another draw (grown only when it fits).
The tokens running at the simulator (each permit's, from the lease id its calls carry, counted
once) are checked the same way against the token budget, with the same allowances counted in
tokens. (In the fair-share fallback a permit heavier than its pod's share, in units or tokens,
is refused at once, by design: with ``--redis-restarts`` those ``Overloaded`` are expected, not
errors.)

The invariant: at every admission at the simulator, the calls running there are at most the
published limit plus the documented allowance -- the permits held by workers frozen past their
lease (counted from Redis during the freeze: a waiter handed a slot while frozen is a frozen
holder too), from the freeze until 2 s after the thaw (the thawed worker may finish the call in
flight and start one more before its heartbeat marks the lease lost); and during a Redis
restart, until every pod is back in fleet mode plus 1 s, the sum over live pods of their fair
share or the permits they held when Redis died, whichever is larger
(``docs/failure-modes.md``). Anything above is an over-admission. At the end (after one
lease TTL for the killed workers' leases to expire) the gate must hold no lease and no waiter.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis

from fleetgate.admission import tokens_of
from fleetgate.keys import GateKeys
from fleetgate.tools.redisproc import RedisProcess

from ._harness import ROOT, Control, LimitSampler, Sim, WorkerProc, Workers, owned_by, poll

__all__ = ["SoakConfig", "main", "run_soak"]


@dataclass
class SoakConfig:
    seconds: float = 60.0
    seed: int = 1
    limit: int = 6
    workers: int = 4
    loops: int = 4
    lease_ms: int = 3000
    waiter_ms: int = 3000
    hb: float = 0.5
    every: float = 3.0
    coordinators: int = 2
    logdir: str = ""
    redis_restarts: bool = False
    refusals: bool = False
    mixed: bool = False
    token_limit: int = 300  # the token budget of --mixed
    weights: dict[str, float] = field(
        default_factory=lambda: {
            "kill": 0.3,
            "pause_short": 0.2,
            "pause_long": 0.3,
            "kill_leader": 0.2,
        }
    )


@dataclass
class Window:
    """An allowance: ``extra`` units (``textra`` tokens) may run over the limit (the token
    budget) in [start, end]."""

    start: float
    end: float
    extra: int
    why: str
    pod: str
    textra: int = 0


def _coordinator_config(path: Path, url: str, prefix: str, gate: str, cfg: SoakConfig) -> None:
    path.write_text(
        f"""
[redis]
url = "{url}"
prefix = "{prefix}"
[coordinator]
poll_interval = 0.5
poll_jitter = 0.0
leader_ttl = 2.0
metrics_listen = "127.0.0.1:0"
scrape_timeout = 0.4
[[gates]]
name = "{gate}"
floor = {cfg.limit}
ceiling = {cfg.limit}
max_queued = 100000
lease_ms = {cfg.lease_ms}
waiter_ms = {cfg.waiter_ms}
"""
        + (f"token_limit = {cfg.token_limit}\n" if cfg.mixed else "")
    )


class _Coordinators:
    def __init__(self, config: Path, logdir: Path) -> None:
        self.config, self.logdir = config, logdir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._n = 0

    def start(self) -> str:
        self._n += 1
        cid = f"coord-{self._n}"
        with open(self.logdir / f"{cid}.log", "wb") as out:
            self.procs[cid] = subprocess.Popen(
                [sys.executable, "-m", "fleetgate.cli", "coordinator", "--config",
                 str(self.config), "--id", cid],
                cwd=ROOT, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        return cid

    def kill(self, cid: str) -> None:
        p = self.procs.pop(cid, None)
        if p is not None:
            p.kill()
            p.wait(10)

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        self.procs.clear()


def _running(tags: list[str], units: bool) -> int:
    """What the calls ``tags`` (one per call, its lease id) hold: units (one per call: a permit
    of weight w runs w calls), or tokens (each permit's once)."""
    return len(tags) if units else sum(tokens_of(tag) for tag in set(tags))


def _check(
    series: list[tuple[float, int]],
    snapshots: list[tuple[float, list[str]]],
    windows: list[Window],
    t_start: float,
    cap: int,
    *,
    units: bool,
) -> tuple[list[tuple[float, int, float]], int, list[tuple[float, int, list[str]]]]:
    """Over-admissions of units (or tokens) at the simulator: the changes of ``series`` above
    ``cap`` plus the allowances in force (violations), the instants above ``cap`` snapped
    (``snapshots``: who ran then), and those of them not explained by the pods that had an
    allowance then (unexplained). Times relative to ``t_start``."""

    def bound(t: float) -> float:
        active = [w for w in windows if w.start <= t <= w.end]
        return cap + sum(w.extra if units else w.textra for w in active)

    violations = [(t - t_start, n, bound(t)) for t, n in series if n > bound(t)]
    over = [(t, tags) for t, tags in snapshots if _running(tags, units) > cap]
    unexplained = []
    for t, tags in over:
        active = [w for w in windows if w.start <= t <= w.end]
        if any(w.why == "redis" for w in active):
            continue  # an outage's allowance is a count (checked above), not per pod
        allowed_pods = {w.pod for w in active}
        paused = [tag for tag in tags if any(owned_by(tag, p) for p in allowed_pods)]
        n = _running(tags, units)
        if n - cap > _running(paused, units):
            unexplained.append((round(t - t_start, 3), n, sorted(tags)))
    return violations, len(over), unexplained


def run_soak(cfg: SoakConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the soak for ``cfg.seconds``; return the summary (see :func:`main`)."""
    rng = random.Random(cfg.seed)
    if cfg.redis_restarts:
        cfg.weights.setdefault("redis_restart", 0.15)
        cfg.weights.setdefault("wipe", 0.15)
    if cfg.refusals:
        cfg.weights.setdefault("oom", 0.1)
        cfg.weights.setdefault("write_pause", 0.1)
    logdir = Path(cfg.logdir or tempfile.mkdtemp(prefix="fleetgate-soak-"))
    logdir.mkdir(parents=True, exist_ok=True)
    prefix, gate = "fg", "soak"
    keys = GateKeys.of(prefix, gate)
    ttl = cfg.lease_ms / 1000
    actions: Counter[str] = Counter()
    windows: list[Window] = []
    mixed: dict[str, Any] = {}
    if cfg.mixed:
        mixed = dict(
            weights=[1, 2, 3], priorities=[0, 10], tenants=["a", "b", "c"],
            tokens=[40, 100, 200], resizes=0.3, token_limit=cfg.token_limit,
        )  # fmt: skip
    with RedisProcess() as red, RedisProcess() as ctl_server, Sim(20, 1) as sim:
        control = Control(ctl_server.url)
        r = redis.Redis.from_url(red.url, decode_responses=True)
        conf = logdir / "coordinator.toml"
        _coordinator_config(conf, red.url, prefix, gate, cfg)
        coords = _Coordinators(conf, logdir)
        try:
            for _ in range(cfg.coordinators):
                coords.start()
            poll(lambda: r.hget(keys.cfg, "floor") == str(cfg.limit), 30, 0.05, "config")
            base = dict(
                url=red.url, prefix=prefix, gate=gate, limit=cfg.limit, lease_ms=cfg.lease_ms,
                waiter_ms=cfg.waiter_ms, hb=cfg.hb, sim=sim.url, role="load", loops=cfg.loops,
            )  # fmt: skip
            with (
                LimitSampler(red.url, prefix, gate) as sampler,
                Workers(control, logdir, base) as pool,
            ):
                n_spawned = 0

                def spawn() -> WorkerProc:
                    nonlocal n_spawned
                    n_spawned += 1
                    two = n_spawned % 2 == 0  # half hold a permit over two calls
                    return pool.spawn(
                        calls_per_permit=2 if two else 1, passages=rng.randint(5, 60), **mixed
                    )

                live = [spawn() for _ in range(cfg.workers)]
                pool.wait_ready()
                # (With weights, the head's reservation can leave up to its weight - 1 free.)
                busy_at = cfg.limit - max(mixed.get("weights", [1])) + 1
                poll(lambda: sim.running >= busy_at, 30, 0.01, "gate busy")
                sim.watermark = cfg.limit
                if cfg.mixed:
                    sim.token_watermark = cfg.token_limit
                t_start = time.monotonic()
                t_stop = t_start + cfg.seconds
                pending_resume: list[tuple[float, WorkerProc, Window | None]] = []
                pending_spawn: list[float] = []
                next_action = t_start + rng.uniform(cfg.every / 2, 1.5 * cfg.every)

                def held_by(pod: str, tokens: bool = False) -> int:
                    now = time.monotonic()
                    return sampler.held([pod], now - 0.2, now, tokens=tokens)[pod]

                def thawed(win: Window, w: WorkerProc, now: float) -> None:
                    # A waiter of the frozen worker may have been handed a slot during the
                    # freeze: it is a frozen holder too.
                    win.extra = max(win.extra, sampler.held([w.pod], win.start, now)[w.pod])
                    held = sampler.held([w.pod], win.start, now, tokens=True)[w.pod]
                    win.textra = max(win.textra, held)
                    win.end = time.monotonic() + 2.0

                def refuse(kind: str) -> None:
                    """Redis refuses (OOM) or holds (CLIENT PAUSE WRITE) writes for 1-3 s."""
                    seconds = rng.uniform(1.0, 3.0)
                    if kind == "oom":
                        r.config_set("maxmemory", 1)
                        time.sleep(seconds)
                        r.config_set("maxmemory", 0)
                    else:
                        r.execute_command("CLIENT", "PAUSE", int(seconds * 1000), "WRITE")
                        time.sleep(seconds)

                def restart_redis(
                    now: float, answered: Callable[[], None] = lambda: None, refusal: str = ""
                ) -> Window:
                    """Kill Redis, start it empty (then ``answered()``), wait for every live pod
                    to be back. ``refusal``: Redis refuses writes instead (see :func:`refuse`),
                    under the same allowance."""
                    pods = [w for w in live if w.alive() and not w.paused]
                    st = control.statuses([w.pod for w in pods])
                    total = tokens = 0
                    for w in pods:
                        n = max(1, int(st[w.pod].get("live_pods", 1) or 1))
                        total += max(held_by(w.pod), -(-cfg.limit // n))
                        tokens += max(held_by(w.pod, True), -(-cfg.token_limit // n))
                    win = Window(now, float("inf"), max(0, total - cfg.limit), "redis", "*")
                    win.textra = max(0, tokens - cfg.token_limit) if cfg.mixed else 0
                    if refusal:
                        refuse(refusal)
                    else:
                        red.kill()
                        time.sleep(rng.uniform(1.0, 2.0))
                        red.start()
                        answered()
                    with contextlib.suppress(TimeoutError):
                        poll(
                            lambda: all(
                                s.get("fallback") == "0"
                                for s in control.statuses([w.pod for w in pods]).values()
                            ),
                            10, 0.02, "fleet mode after the restart",
                        )  # fmt: skip
                    win.end = time.monotonic() + 1.0
                    return win

                def wipe(now: float) -> Window:
                    """A fresh pod ready to open its fleet; Redis loses every key (restart or
                    FLUSHALL); the fresh pod opens as Redis answers."""
                    key = f"{control.run}:open:{time.monotonic_ns()}"
                    # it leaves by itself after a while, so the fleet does not grow with the
                    # wipes (more pods: longer queues, larger fallback bounds)
                    fresh = pool.spawn(
                        calls_per_permit=1, passages=rng.randint(5, 60), open_key=key,
                        duration=rng.uniform(8.0, 15.0), **mixed,
                    )  # fmt: skip
                    poll(
                        lambda: control.statuses([fresh.pod])[fresh.pod].get("state")
                        == "waiting",
                        30, 0.02, "fresh pod up",
                    )  # fmt: skip
                    live.append(fresh)
                    if rng.random() < 0.5:
                        log("[soak]   (FLUSHALL under the running fleet)")
                        r.flushall()
                        control.r.set(key, 1)
                        return Window(now, now, 0, "flushall", "*")  # no allowance at all
                    return restart_redis(now, answered=lambda: control.r.set(key, 1))

                while time.monotonic() < t_stop:
                    now = time.monotonic()
                    for item in [p for p in pending_resume if p[0] <= now]:
                        pending_resume.remove(item)
                        _, w, win = item
                        if w.alive():
                            w.resume()
                        if win is not None:
                            thawed(win, w, now)
                    for t in [t for t in pending_spawn if t <= now]:
                        pending_spawn.remove(t)
                        live.append(spawn())
                    if now >= next_action:
                        next_action = now + rng.uniform(cfg.every / 2, 1.5 * cfg.every)
                        busy = {id(p[1]) for p in pending_resume}
                        candidates = [w for w in live if w.alive() and id(w) not in busy]
                        kind = rng.choices(list(cfg.weights), list(cfg.weights.values()))[0]
                        if kind in ("kill", "pause_short", "pause_long") and not candidates:
                            kind = "kill_leader"
                        if kind == "kill":
                            w = rng.choice(candidates)
                            w.kill()
                            live.remove(w)
                            pending_spawn.append(now + rng.uniform(0.3, 1.5))
                        elif kind == "pause_short":
                            w = rng.choice(candidates)
                            w.pause()
                            pending_resume.append((now + rng.uniform(0.2, 1.0), w, None))
                        elif kind == "pause_long":
                            w = rng.choice(candidates)
                            extra, tokens = held_by(w.pod), held_by(w.pod, True)
                            w.pause()
                            win = Window(now, float("inf"), extra, "pause_long", w.pod, tokens)
                            windows.append(win)
                            pending_resume.append((now + ttl + rng.uniform(0.5, 1.5), w, win))
                        elif kind == "redis_restart":
                            windows.append(restart_redis(now))
                        elif kind in ("oom", "write_pause"):
                            windows.append(restart_redis(now, refusal=kind))
                        elif kind == "wipe":
                            windows.append(wipe(time.monotonic()))
                        else:
                            leader = r.get(f"{prefix}:leader")
                            if leader in coords.procs:
                                coords.kill(leader)
                                coords.start()
                            else:
                                kind = "kill_leader_none"
                        actions[kind] += 1
                        log(f"[soak] t={now - t_start:6.1f}s {kind}")
                    time.sleep(0.01)
                for _, w, win in pending_resume:
                    if w.alive():
                        w.resume()
                    if win is not None:
                        thawed(win, w, time.monotonic())
                t_end = time.monotonic()
                time.sleep(2.0)  # let the last allowances run out before the checker's end
                t_checked = time.monotonic()
                exits = pool.stop_all(timeout=30)
                statuses = {w.pod: control.result(w.pod) or {} for w in pool.procs}
                limits = sampler.limits()
            # After one lease TTL the killed workers' leases are gone: nothing may remain.
            poll(lambda: r.zcard(keys.holders) == 0 and r.zcard(keys.waiters) == 0,
                 ttl + 5, 0.05, "gate empty after the soak")  # fmt: skip
            stats = r.hgetall(keys.stats)
            leaked = r.zcard(keys.holders) + r.zcard(keys.waiters)
        finally:
            coords.close()
            r.close()
            control.close()

        series = sim.series(t_start, t_checked)
        snapshots = [(t, tags) for t, _, tags in sim.snapshots if t_start <= t <= t_checked]
        violations, over, unexplained = _check(
            series, snapshots, windows, t_start, cfg.limit, units=True
        )
        tseries = sim.series(t_start, t_checked, tokens=True)
        tviolations, tover, tunexplained = _check(
            tseries, snapshots, windows, t_start, cfg.token_limit if cfg.mixed else 1 << 62,
            units=False,
        )  # fmt: skip
        errors: Counter[str] = Counter()
        expected: Counter[str] = Counter()
        for s in statuses.values():
            for k, v in s.items():
                if k == "err:Overloaded" and cfg.mixed and cfg.redis_restarts:
                    expected[k] += int(v)  # heavier than a pod's fair share (see above)
                elif k.startswith(("err:", "http:")):
                    errors[k] += int(v)
        summary = {
            "seconds": round(t_end - t_start, 1),
            "seed": cfg.seed,
            "limit": cfg.limit,
            "limits_published": sorted(limits),
            "actions": dict(actions),
            "workers_started": n_spawned,
            "calls_at_sim": sim.calls,
            "admissions_checked": len(series),
            "max_running": max(n for _, n in series),
            "max_over_limit": max(n for _, n in series) - cfg.limit,
            "over_limit_instants": over,
            "over_limit_within_allowance": over - len(unexplained),
            "violations": len(violations),
            "unexplained": unexplained[:5],
            "token_limit": cfg.token_limit if cfg.mixed else None,
            "max_tokens_running": max(n for _, n in tseries),
            "over_budget_instants": tover,
            "over_budget_within_allowance": tover - len(tunexplained),
            "token_violations": len(tviolations),
            "tokens_unexplained": tunexplained[:5],
            "resizes": sum(int(st.get("resized", 0)) for st in statuses.values()),
            "resizes_kept": sum(int(st.get("resize_kept", 0)) for st in statuses.values()),
            "caller_errors": dict(errors),
            "expected_refusals": dict(expected),
            "max_exit_s": round(max(exits.values(), default=0.0), 2),
            "expired_leases": int(stats.get("expired_leases", 0)),
            "abandoned_waiters": int(stats.get("abandoned_waiters", 0)),
            "granted": int(stats.get("granted", 0)),
            "leaked_after": leaked,
            "logdir": str(logdir),
            "config": {k: v for k, v in asdict(cfg).items() if k != "weights"},
        }
        if violations:
            summary["first_violations"] = violations[:5]
        if tviolations:
            summary["first_token_violations"] = tviolations[:5]
        return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tests.chaos.soak",
        description=(__doc__ or "").split("\n\n")[0],
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument("--minutes", type=float, help="run this long (the long mode: 10)")
    g.add_argument("--seconds", type=float, help="run this long (default 60)")
    p.add_argument("--seed", type=int, default=int(time.time()) % 100_000)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--limit", type=int, default=6)
    p.add_argument("--every", type=float, default=3.0, help="mean seconds between faults")
    p.add_argument("--logdir", default="", help="worker and coordinator logs (default: a tmp dir)")
    p.add_argument(
        "--redis-restarts", action="store_true", help="also kill and restart Redis (empty)"
    )
    p.add_argument(
        "--refusals",
        action="store_true",
        help="also make Redis refuse writes for 1-3 s (OOM, CLIENT PAUSE WRITE)",
    )
    p.add_argument(
        "--mixed",
        action="store_true",
        help=(
            "weights 1-3, two priority bands, three tenants, tokens and resizes under a token "
            "budget; both caps are checked at the simulator"
        ),
    )
    ns = p.parse_args(argv)
    seconds = ns.minutes * 60 if ns.minutes else (ns.seconds or 60.0)
    cfg = SoakConfig(
        seconds=seconds, seed=ns.seed, workers=ns.workers, limit=ns.limit, every=ns.every,
        logdir=ns.logdir, redis_restarts=ns.redis_restarts, refusals=ns.refusals, mixed=ns.mixed,
    )  # fmt: skip
    summary = run_soak(cfg)
    print(json.dumps(summary, indent=2))
    ok = (
        summary["violations"] == summary["token_violations"] == 0
        and not summary["unexplained"]
        and not summary["tokens_unexplained"]
        and not summary["caller_errors"]
    )
    tokens = (
        f", max tokens {summary['max_tokens_running']} (budget {summary['token_limit']}, "
        f"{summary['token_violations']} over it beyond the bound, {summary['resizes']} resizes)"
        if summary["token_limit"]
        else ""
    )
    print(f"soak {'PASSED' if ok else 'FAILED'}: {summary['violations']} over-admissions beyond "
          f"the documented bound in {summary['admissions_checked']} checked changes, "
          f"{sum(summary['actions'].values())} faults, max running {summary['max_running']} "
          f"(limit {summary['limit']}){tokens}")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
