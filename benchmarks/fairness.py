"""fairness: weights, priority bands and tenants, each figure beside plain FIFO.

Five worker processes (spawned once, started at one instant) run a schedule of phases, one gate
per phase, against a private redis-server; every scenario runs twice in the same run: once with
the admission options (``weight``, ``priority``, ``tenant``) and once as plain FIFO, the same
workload with every call at the defaults (weight 1, priority 0, no tenant). Every call holds its
permit ``HOLD_S`` (sleeping, as a model call would wait for its server).

* ``interactive``: processes 0-3 park 4 x 1000 batch callers (loops: a caller re-parks as soon
  as it releases, so ~4,000 wait all the time) at priority 0, tenant ``ingest``; process 4 sends
  20 calls/s of tenant ``search`` at priority 10. Figures: the interactive wait p50/p99 against
  the mean hold (target p99 <= 1.5 x mean hold; FIFO: the whole backlog, seconds), the units
  utilisation (client-observed time inside permit blocks / (limit x window); target >= 0.95;
  Redis-side units sampled as well), the batch throughput.
* ``tenants``: tenant ``bulk`` has 4 x 1000 callers, tenant ``small`` 40 (100:1 backlog). The
  share of units granted to ``small`` while both are backlogged (sampled per-tenant waiters in
  Redis): 0.5 +- 0.05 with equal weights, 0.75 +- 0.05 with ``tenant_weights`` small 3 : bulk 1
  (written with the coordinator's publish script). FIFO: ``small`` gets its share of the queue.
* ``weights``: limit 64, callers of weight 1 and 16 (per backlog process 40 light and 4 heavy
  loops). The units held, sampled from Redis (``ZCARD holders`` + ``HGET adm extra`` in one
  MULTI) at 100 Hz and from an external counter every caller INCRBYs by its weight once granted
  and DECRBYs before it releases (its exact peak: the largest INCRBY reply), never above 64;
  unit utilisation >= 0.9; weight-16 p99 wait <= 3 x weight-1 p99. FIFO here is today's
  count-based gate: every call asks weight 1, so the units really in use (the external counter)
  are not bounded by the limit at all.
* ``cost``: server time of the scripts (INFO commandstats ``fcall`` usec of the gate library, as
  ``benchmarks/script_cost.py`` measures it, its :class:`~benchmarks.script_cost.Bench` reused)
  per grant cycle (release -> hand-off to the fair head -> a fresh caller parks, queue length
  unchanged) and per park + cancel, with one tenant and with 1,000 tenants (``min(n, 1000)``), at
  10 ... 100,000 waiters. Targets: 1,000 tenants <= 1.5 x one tenant; growth 10 -> 100,000 <= 1.5x.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import redis

from fleetgate.admission import class_member, encode_tenant_weights, lane_class
from fleetgate.keys import GateKeys
from fleetgate.scripts import script_source
from fleetgate.settings import GateSettings

from ._common import Flavor, Headline, Options, figure, log, percentiles, save, table
from ._server import (
    PREFIX,
    configure_gate,
    delta,
    library_functions,
    private_redis,
    redis_counters,
    sleep_until,
    sync_client,
)
from ._workers import Sync, Workers, worker_fleet
from .script_cost import Bench

NAME = "fairness"
PROCS = 5  # 0-3: batch / bulk / weights; 4: interactive / small tenant
HOLD_S = 0.050
BATCH_PER_PROC = 1000
INTERACTIVE_RATE = 20.0
SMALL_TASKS = 40
LIMIT_1, LIMIT_2, LIMIT_3 = 64, 32, 64
LIGHT, HEAVY = 40, 4  # weights scenario, loops per backlog process
W_HEAVY = 16
SMALL_WEIGHT = 3

P99_HOLD_TARGET = 1.5
UTIL_TARGET_1 = 0.95
SHARE_TOL = 0.05
UTIL_TARGET_3 = 0.9
WAIT_RATIO_TARGET = 3.0
COST_TARGET = 1.5
GROWTH_TARGET = 1.5

# -- the workload -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Stream:
    """Callers of one kind in one process: ``tasks`` loops (a backlog), or ``rate`` calls/s."""

    label: str
    tasks: int = 0
    rate: float = 0.0
    weight: int = 1  # units the work really uses (the external counter)
    ask_weight: int = 1  # the weight asked for
    priority: int = 0
    tenant: str | None = None


@dataclass(frozen=True)
class Phase:
    """One gate's run: every process runs its streams from ``at`` (s after the start) for
    ``seconds`` (paced streams stop asking ``tail`` seconds before the end)."""

    key: str
    gate: str
    at: float
    seconds: float
    tail: float
    streams: tuple[tuple[Stream, ...], ...]  # per process
    counter: str | None = None


def callers(sync: Sync, url: str, phases: list[Phase], flavor: Flavor) -> Any:
    """Worker: run every phase in turn; per phase the records (stream, asked, granted, left,
    weight) in ns and the largest INCRBY reply of the external counter."""

    async def main() -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        total = phases[-1].at + phases[-1].seconds
        async with worker_fleet(sync, url, flavor, connections=16, overdue_s=total + 60) as run:
            for ph in phases:
                out.append(await one_phase(run.fleet, run.start, ph, sync.idx))
            sync.publish(out)
        return out

    return flavor.run(main())


async def one_phase(fleet: Any, start: int, ph: Phase, idx: int) -> dict[str, Any]:
    gate = fleet.gate(ph.gate)
    r = fleet.redis
    recs: list[tuple[int, int, int, int, int]] = []
    peak = [0]
    begin = start + int(ph.at * 1e9)
    stop = begin + int(ph.seconds * 1e9)
    ask_stop = stop - int(ph.tail * 1e9)
    late = (time.monotonic_ns() - begin) / 1e9
    await asyncio.sleep(max(0.0, -late))

    async def call(k: int, s: Stream) -> None:
        asked = time.monotonic_ns()
        async with gate.permit(
            deadline=120.0, weight=s.ask_weight, priority=s.priority, tenant=s.tenant
        ):
            granted = time.monotonic_ns()
            if ph.counter is not None:
                peak[0] = max(peak[0], int(await r.incrby(ph.counter, s.weight)))
            try:
                await asyncio.sleep(HOLD_S)
            finally:
                if ph.counter is not None:
                    await r.decrby(ph.counter, s.weight)
            recs.append((k, asked, granted, time.monotonic_ns(), s.weight))

    async def loop(k: int, s: Stream) -> None:
        while time.monotonic_ns() < stop:
            await call(k, s)

    async def paced(k: int, s: Stream) -> None:
        pending: set[asyncio.Task[None]] = set()
        at = time.monotonic_ns()
        while at < ask_stop:
            await asyncio.sleep(max(0.0, (at - time.monotonic_ns()) / 1e9))
            t = asyncio.create_task(call(k, s))
            pending.add(t)
            t.add_done_callback(pending.discard)
            at += int(1e9 / s.rate)
        if pending:
            await asyncio.wait(pending, timeout=max(0.0, (stop - time.monotonic_ns()) / 1e9))
        for t in list(pending):
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    tasks = []
    for k, s in enumerate(ph.streams[idx]):
        if s.rate > 0:
            tasks.append(asyncio.create_task(paced(k, s)))
        else:
            tasks += [asyncio.create_task(loop(k, s)) for _ in range(s.tasks)]
    if tasks:
        await asyncio.wait(tasks, timeout=max(0.0, (stop - time.monotonic_ns()) / 1e9))
        # Whoever is still parked (or holding) leaves now: cancelled, its permit freed.
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    with contextlib.suppress(Exception):
        await gate.flush()
    return {"recs": recs, "peak_counter": peak[0], "late_s": late}


# -- the server side of a phase ---------------------------------------------------------------


def sample(
    url: str, keys: GateKeys, lo: int, hi: int, tenants: Sequence[str], counter: str | None
) -> dict[str, Any]:
    """Sample units held (holders + extra, in one MULTI), waiters, waiters per tenant and the
    external counter at 100 Hz over [lo, hi]; INFO deltas over the window."""
    r = sync_client(url)
    sleep_until(lo)
    before = redis_counters(r, keys)
    rows: list[list[int]] = []
    tick = lo
    while tick < hi:
        with r.pipeline(transaction=True) as p:
            p.zcard(keys.holders)
            p.hget(keys.adm, "extra")
            p.zcard(keys.waiters)
            for t in tenants:
                p.zlexcount(keys.lanes, f"[{t}}}", f"({t}~")
            if counter:
                p.get(counter)
            v = p.execute()
        rows.append([int(x or 0) for x in v])
        tick += 10_000_000
        sleep_until(min(tick, hi))
    counters = delta(before, redis_counters(r, keys))
    r.close()
    a = np.array(rows, dtype=np.int64)
    out: dict[str, Any] = {
        "units": a[:, 0] + a[:, 1],
        "waiters": a[:, 2],
        "per_tenant": {t: a[:, 3 + i] for i, t in enumerate(tenants)},
        "counters": counters,
    }
    if counter:
        out["counter"] = a[:, -1]
    return out


def configure(url: str, gate: str, limit: int, weights: dict[str, int] | None = None) -> GateKeys:
    keys = configure_gate(
        url, gate, floor=limit, ceiling=limit, max_queued=20_000, lease_ms=10_000, waiter_ms=10_000
    )
    if weights:
        # As the coordinator writes them: publish.lua (epoch-fenced), cfg pair tenant_weights.
        r = sync_client(url)
        publish = r.register_script(script_source("publish"))
        tw = encode_tenant_weights(weights)
        assert publish(keys=[keys.base], args=[1, 60_000, "", 1, "tenant_weights", tw])[0] == 1
        assert r.hgetall(f"{keys.base}:tw") == {k: str(v) for k, v in weights.items()}
        r.close()
    return keys


# -- analysis ---------------------------------------------------------------------------------


@dataclass
class PhaseData:
    """One phase's records (all processes) and server samples, cut to its measured window."""

    phase: Phase
    labels: list[str]  # stream label per (process, stream) code
    recs: np.ndarray  # label code, asked, granted, left, weight
    lo: int
    hi: int
    server: dict[str, Any]
    peak_counter: int
    late_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def window(self) -> float:
        return (self.hi - self.lo) / 1e9

    def of(self, label: str) -> np.ndarray:
        codes = [i for i, x in enumerate(self.labels) if x == label]
        return self.recs[np.isin(self.recs[:, 0], codes)]

    def granted_in(self, recs: np.ndarray) -> np.ndarray:
        return recs[(recs[:, 2] >= self.lo) & (recs[:, 2] < self.hi)]

    def asked_in(self, recs: np.ndarray) -> np.ndarray:
        return recs[(recs[:, 1] >= self.lo) & (recs[:, 1] < self.hi)]

    def busy_units(self, recs: np.ndarray | None = None) -> float:
        """Unit-seconds inside permit blocks within the window."""
        rs = self.recs if recs is None else recs
        span = np.clip(np.minimum(rs[:, 3], self.hi) - np.maximum(rs[:, 2], self.lo), 0, None)
        return float((span * rs[:, 4]).sum() / 1e9)

    def waits_ms(self, recs: np.ndarray) -> np.ndarray:
        rs = self.asked_in(recs)
        return cast(np.ndarray, (rs[:, 2] - rs[:, 1]) / 1e6)

    def mean_hold_ms(self) -> float:
        rs = self.granted_in(self.recs)
        return float(((rs[:, 3] - rs[:, 2]) / 1e6).mean())

    def lua_us_per_grant(self) -> float:
        c = self.server["counters"]
        lua = c.get("usec:evalsha", 0.0) + c.get("usec:fcall", 0.0)
        return float(lua / max(1.0, c.get("stat:granted", 0.0)))


def gather(phase: Phase, out: list[list[dict[str, Any]]], lo: int, hi: int, srv: Any) -> PhaseData:
    labels: list[str] = []
    rows: list[tuple[int, int, int, int, int]] = []
    peak, late = 0, 0.0
    for proc, results in enumerate(out):
        res = results[_phase_index[phase.key]]
        base = len(labels)
        labels += [s.label for s in phase.streams[proc]]
        rows += [(base + k, a, g, lft, w) for k, a, g, lft, w in res["recs"]]
        peak = max(peak, res["peak_counter"])
        late = max(late, res["late_s"])
    recs = np.array(rows, dtype=np.int64).reshape(-1, 5)
    return PhaseData(phase, labels, recs, lo, hi, srv, peak, late)


_phase_index: dict[str, int] = {}


# -- the schedule -----------------------------------------------------------------------------


def schedule(opts: Options) -> tuple[list[Phase], float, float]:
    """The phases, and the warm-up and window of each (seconds)."""
    warm, window = opts.pick((3.0, 12.0), (1.5, 3.5))
    gap = 3.0  # cancelling ~4,000 parked callers between phases
    batch = Stream("batch", tasks=BATCH_PER_PROC, tenant="ingest")
    inter = Stream("interactive", rate=INTERACTIVE_RATE, priority=10, tenant="search")
    plain_batch = Stream("batch", tasks=BATCH_PER_PROC)
    plain_inter = Stream("interactive", rate=INTERACTIVE_RATE)
    # small's 40 callers are spread over the backlog processes (10 each): one process granting
    # 16-24 units every hold would be CPU-bound on its own and skew the shares it can take
    bulk, small = (
        Stream("bulk", tasks=BATCH_PER_PROC, tenant="bulk"),
        Stream("small", tasks=SMALL_TASKS // 4, tenant="small"),
    )
    plain_bulk, plain_small = (
        Stream("bulk", tasks=BATCH_PER_PROC),
        Stream("small", tasks=SMALL_TASKS // 4),
    )
    light, heavy = (
        Stream("w1", tasks=LIGHT),
        Stream("w16", tasks=HEAVY, weight=W_HEAVY, ask_weight=W_HEAVY),
    )
    count_heavy = Stream("w16", tasks=HEAVY, weight=W_HEAVY, ask_weight=1)
    # FIFO's interactive calls wait for the whole backlog: its phase runs on past the window
    # until the calls asked in the window are granted (4,000 x hold / limit, plus slack).
    fifo_tail = BATCH_PER_PROC * 4 * HOLD_S / LIMIT_1 + 2.5
    specs: list[tuple[str, str, float, tuple[tuple[Stream, ...], ...], str | None]] = [
        ("interactive_fifo", "fifo", fifo_tail, ((plain_batch,),) * 4 + ((plain_inter,),), None),
        ("interactive_fair", "fair", 0.5, ((batch,),) * 4 + ((inter,),), None),
        ("tenants_fifo", "fifo", 0.0, ((plain_bulk, plain_small),) * 4 + ((),), None),
        ("tenants_equal", "fair", 0.0, ((bulk, small),) * 4 + ((),), None),
        ("tenants_3to1", "fair", 0.0, ((bulk, small),) * 4 + ((),), None),
        ("weights_fifo", "fifo", 0.0, ((light, count_heavy),) * 4 + ((),), "units"),
        ("weights_fair", "fair", 0.0, ((light, heavy),) * 4 + ((),), "units"),
    ]
    phases: list[Phase] = []
    at = 0.5
    for key, _, tail, streams, counter in specs:
        seconds = warm + window + tail
        phases.append(
            Phase(
                key=key,
                gate=f"bench-fair-{key}",
                at=at,
                seconds=seconds,
                tail=tail,
                streams=streams,
                counter=f"{PREFIX}:bench-fair:{key}:units" if counter else None,
            )
        )
        at += seconds + gap
    _phase_index.clear()
    _phase_index.update({p.key: i for i, p in enumerate(phases)})
    return phases, warm, window


LIMITS = {"interactive": LIMIT_1, "tenants": LIMIT_2, "weights": LIMIT_3}


def limit_of(ph: Phase) -> int:
    return LIMITS[ph.key.split("_")[0]]


def run_phases(url: str, opts: Options) -> dict[str, PhaseData]:
    phases, warm, window = schedule(opts)
    keys = {}
    for ph in phases:
        weights = {"small": SMALL_WEIGHT, "bulk": 1} if ph.key == "tenants_3to1" else None
        keys[ph.key] = configure(url, ph.gate, limit_of(ph), weights)
    with Workers(callers, [(url, phases, opts.flavor)] * PROCS) as w:
        start = w.go(timeout=120)
        log(f"{NAME}: {len(phases)} phases, {phases[-1].at + phases[-1].seconds:.0f} s")
        servers = {}
        for ph in phases:
            lo = start + int((ph.at + warm) * 1e9)
            hi = lo + int(window * 1e9)
            tenants = ["bulk", "small"] if ph.key.startswith("tenants") else []
            log(f"{NAME}: {ph.key}: measuring {window:.1f} s after {warm:.1f} s")
            servers[ph.key] = (lo, hi, sample(url, keys[ph.key], lo, hi, tenants, ph.counter))
        out = w.results(timeout=phases[-1].at + phases[-1].seconds + 120)
        stuck = len(w.stuck)
    data = {ph.key: gather(ph, out, *servers[ph.key]) for ph in phases}
    for d in data.values():
        d.extra["workers_stuck_in_close"] = stuck
        if d.late_s > 0.2:
            log(f"{NAME}: WARNING {d.phase.key} started {d.late_s:.2f} s late in a worker")
    return data


# -- cost ---------------------------------------------------------------------------------------


class TenantBench(Bench):
    """script_cost's Bench on schema 2: requests carry a class (priority 0, one of ``tenants``);
    the gate is filled with batched acquires; the fair head is not known in advance, so a grant
    cycle reads the new holder with ZRANGE between its script calls (INFO commandstats still
    counts only the scripts' own time)."""

    def __init__(self, r: redis.Redis, scripts: dict[str, Any], keys: GateKeys, tenants: int):
        self.tenants = [f"t{i:04d}" for i in range(tenants)]
        self.turn = 0
        super().__init__(r, scripts, keys)
        self.n = 0

    def acq_args(self, wid: str, *more: str) -> list[Any]:  # type: ignore[override]
        """acquire.lua's ARGV (the default settings left to the stored config, no fence, no
        releases, no reports)."""
        args: list[Any] = [*[""] * len(GateSettings().argv()), 0, 0, 0]
        for i in (wid, *more):
            args += [i, HOUR_MS, self.cls()]
        return args

    def cls(self) -> str:
        self.turn += 1
        return lane_class(0, self.tenants[self.turn % len(self.tenants)])

    def fill(self, n: int) -> None:
        while self.n < n:
            ids = [self.new_id() for _ in range(min(250, n - self.n))]
            self.timed(("acquire", self.acq_args(*ids)) for _ in (0,))
            self.n += len(ids)

    def _lua(self, fn: Any) -> tuple[float, int]:
        a = self.r.info("commandstats").get("cmdstat_fcall", {"usec": 0, "calls": 0})
        fn()
        b = self.r.info("commandstats")["cmdstat_fcall"]
        return float(b["usec"] - a["usec"]), int(b["calls"] - a["calls"])

    def grant_cycles(self, m: int) -> float:
        """µs per cycle: the holder releases (its unit goes to the fair head), a fresh caller
        parks (queue length unchanged)."""

        def go() -> None:
            for _ in range(m):
                self.s["release"](keys=self.keys, args=[0, self.holder])
                # replies are decoded (the Redis is opened with decode_responses)
                self.holder = cast(str, self.r.zrange(self.gate.holders, 0, 0)[0])
                self.s["acquire"](keys=self.keys, args=self.acq_args(self.new_id()))

        usec, calls = self._lua(go)
        assert calls == 2 * m, f"a script call failed: {calls} calls, {m} cycles"
        return usec / m

    def park_cancels(self, m: int) -> float:
        """µs per pair: a fresh caller parks and leaves again."""

        def go() -> None:
            for _ in range(m):
                wid = self.new_id()
                args = self.acq_args(wid)
                reply = self.s["acquire"](keys=self.keys, args=args)
                assert int(reply[5]) == 2, reply
                self.s["cancel"](keys=self.keys, args=[wid, class_member(args[-1], reply[6], wid)])

        usec, calls = self._lua(go)
        assert calls == 2 * m, f"a script call failed: {calls} calls, {m} cycles"
        return usec / m

    def check(self) -> None:
        assert self.r.zcard(self.gate.waiters) == self.n, (self.r.zcard(self.gate.waiters), self.n)
        assert self.r.zcard(self.gate.holders) == 1


HOUR_MS = 3_600_000


def measure_cost(url: str, opts: Options) -> dict[str, Any]:
    sizes = (10, 100, 1_000, 10_000, 100_000)
    rounds, m = opts.pick((20, 25), (4, 15))
    r = redis.Redis.from_url(url, decode_responses=True)
    scripts = library_functions(r, ("acquire", "release", "cancel"))
    benches: dict[tuple[int, int], TenantBench] = {}
    for n in sizes:
        for tenants in sorted({1, min(n, 1000)}):
            keys = configure_gate(
                url,
                f"bench-fair-cost-{n}-{tenants}",
                floor=1,
                ceiling=1,
                max_queued=10**7,
                lease_ms=HOUR_MS,
                waiter_ms=HOUR_MS,
            )
            b = TenantBench(r, scripts, keys, tenants)
            b.fill(n)
            benches[(n, tenants)] = b
    log(f"{NAME}: cost: filled {len(benches)} gates")
    grant: dict[tuple[int, int], list[float]] = {k: [] for k in benches}
    park: dict[tuple[int, int], list[float]] = {k: [] for k in benches}
    for _ in range(rounds):
        for k, b in benches.items():
            grant[k].append(b.grant_cycles(m))
            park[k].append(b.park_cancels(m))
    for b in benches.values():
        b.check()
    r.close()
    rows = [
        {
            "waiters": n,
            "tenants": t,
            "grant_cycle_us": float(np.median(grant[(n, t)])),
            "park_cancel_us": float(np.median(park[(n, t)])),
        }
        for n, t in benches
    ]
    return {"rows": rows, "rounds": rounds, "cycles_per_round": m}


# -- report -------------------------------------------------------------------------------------


def _verdict(ok: bool | None) -> str:
    return {True: "met", False: "MISSED", None: "-"}[ok]


def run(opts: Options) -> list[Headline]:
    heads: list[Headline] = []
    with private_redis() as rp:
        data = run_phases(rp.url, opts)
        log(f"{NAME}: cost of the scripts")
        cost = measure_cost(rp.url, opts)
        res: dict[str, Any] = {"hold_ms": HOLD_S * 1000}
        rows: list[tuple[Any, ...]] = []

        # 1. interactive vs batch flood
        inter: dict[str, Any] = {}
        for v in ("fifo", "fair"):
            d = data[f"interactive_{v}"]
            iw = d.waits_ms(d.of("interactive"))
            asked = d.asked_in(d.of("interactive"))
            batch = d.granted_in(d.of("batch"))
            hold = d.mean_hold_ms()
            inter[v] = {
                "interactive_calls": len(asked),
                "interactive_wait_ms": {**percentiles(iw), "mean": float(np.mean(iw))},
                # paced calls asked in the window that were never granted (records are grants)
                "interactive_not_granted": max(0, round(INTERACTIVE_RATE * d.window) - len(asked)),
                "interactive_waits_ms_by_ask": [round(float(x), 2) for x in iw],
                "mean_hold_ms": hold,
                "p99_vs_mean_hold": percentiles(iw)["p99"] / hold,
                "utilisation_client": d.busy_units() / (LIMIT_1 * d.window),
                "utilisation_redis": float(d.server["units"].mean()) / LIMIT_1,
                "batch_grants_per_s": len(batch) / d.window,
                "mean_waiters": float(d.server["waiters"].mean()),
                "lua_us_per_grant": d.lua_us_per_grant(),
            }
        f, p = inter["fifo"], inter["fair"]
        inter["batch_throughput_vs_fifo"] = p["batch_grants_per_s"] / f["batch_grants_per_s"]
        res["interactive"] = inter
        ok_p99 = p["p99_vs_mean_hold"] <= P99_HOLD_TARGET
        ok_u = p["utilisation_client"] >= UTIL_TARGET_1
        for what, key, target, ok in (
            ("interactive wait p50 ms", "p50", "-", None),
            ("interactive wait p99 ms", "p99", f"<= {P99_HOLD_TARGET} x hold", ok_p99),
        ):
            rows.append(
                (
                    "interactive",
                    what,
                    f["interactive_wait_ms"][key],
                    p["interactive_wait_ms"][key],
                    target,
                    _verdict(ok),
                )
            )
        rows += [
            ("interactive", "  p99 / mean hold", f["p99_vs_mean_hold"], p["p99_vs_mean_hold"],
             f"<= {P99_HOLD_TARGET}", _verdict(ok_p99)),
            ("interactive", "mean hold ms", f["mean_hold_ms"], p["mean_hold_ms"], "-", "-"),
            ("interactive", "units utilisation (client)", f["utilisation_client"],
             p["utilisation_client"], f">= {UTIL_TARGET_1}", _verdict(ok_u)),
            ("interactive", "units utilisation (Redis)", f["utilisation_redis"],
             p["utilisation_redis"], "-", "-"),
            ("interactive", "batch grants/s", f["batch_grants_per_s"], p["batch_grants_per_s"],
             f"ideal {LIMIT_1 / HOLD_S - INTERACTIVE_RATE:.0f}", "-"),
            ("interactive", "mean waiters (Redis)", f["mean_waiters"], p["mean_waiters"], "-", "-"),
            ("interactive", "Lua µs / grant", f["lua_us_per_grant"], p["lua_us_per_grant"], "-",
             "-"),
        ]  # fmt: skip
        heads += [
            Headline(NAME, "interactive wait p99 / mean hold (FIFO)",
                     f"{p['p99_vs_mean_hold']:.2f} ({f['p99_vs_mean_hold']:.0f})",
                     f"<= {P99_HOLD_TARGET}", ok_p99),
            Headline(NAME, "interactive: units utilisation, client (Redis; FIFO client)",
                     f"{p['utilisation_client']:.3f} ({p['utilisation_redis']:.3f}; "
                     f"{f['utilisation_client']:.3f})",
                     f">= {UTIL_TARGET_1}", ok_u),
            Headline(NAME, "interactive: batch grants/s vs FIFO",
                     f"{inter['batch_throughput_vs_fifo']:.3f}", "-", None),
        ]  # fmt: skip

        # 2. two tenants, 100:1 backlog
        ten: dict[str, Any] = {}
        share_targets: tuple[tuple[str, float | None], ...] = (
            ("fifo", None),
            ("equal", 0.5),
            ("3to1", 0.75),
        )
        for v, share_target in share_targets:
            d = data[f"tenants_{v}"]
            both = (d.server["per_tenant"]["bulk"] > 0) & (d.server["per_tenant"]["small"] > 0)
            small = d.granted_in(d.of("small"))
            bulk = d.granted_in(d.of("bulk"))
            # units granted by the tenant's callers (weight 1 each) in the window
            share = len(small) / max(1, len(small) + len(bulk))
            ten[v] = {
                "share_small": share,
                "target": share_target,
                "both_backlogged_fraction": float(both.mean()) if v != "fifo" else None,
                "mean_small_waiting": float(d.server["per_tenant"]["small"].mean()),
                "grants_per_s": (len(small) + len(bulk)) / d.window,
                "utilisation_client": d.busy_units() / (LIMIT_2 * d.window),
                "utilisation_redis": float(d.server["units"].mean()) / LIMIT_2,
                "lua_us_per_grant": d.lua_us_per_grant(),
            }
            if share_target is not None:
                ok = abs(share - share_target) <= SHARE_TOL
                ten[v]["met"] = ok
                heads.append(
                    Headline(NAME, f"tenants {'1:1' if v == 'equal' else '3:1'}: share of small "
                             f"(FIFO {ten['fifo']['share_small']:.3f})", f"{share:.3f}",
                             f"{share_target} +- {SHARE_TOL}", ok)
                )  # fmt: skip
        res["tenants"] = ten
        for v, label in (("equal", "weights 1:1"), ("3to1", "weights small 3 : bulk 1")):
            t = ten[v]
            rows.append(
                ("tenants", f"share of small, {label}", ten["fifo"]["share_small"],
                 t["share_small"], f"{t['target']} +- {SHARE_TOL}", _verdict(t["met"]))
            )  # fmt: skip
            rows.append(
                ("tenants", f"  both backlogged ({label})", "-", t["both_backlogged_fraction"],
                 "1", "-")
            )  # fmt: skip
            rows.append(
                ("tenants", f"  utilisation client / Redis ({label})",
                 f"{ten['fifo']['utilisation_client']:.3f} / "
                 f"{ten['fifo']['utilisation_redis']:.3f}",
                 f"{t['utilisation_client']:.3f} / {t['utilisation_redis']:.3f}", "-", "-")
            )  # fmt: skip

        # 3. mixed weights
        wts: dict[str, Any] = {}
        for v in ("fifo", "fair"):
            d = data[f"weights_{v}"]
            w1, w16 = d.waits_ms(d.of("w1")), d.waits_ms(d.of("w16"))
            p1, p16 = percentiles(w1), percentiles(w16)
            wts[v] = {
                "units_redis_max": int(d.server["units"].max()),
                "units_external_sampled_max": int(d.server["counter"].max()),
                "units_external_peak": d.peak_counter,
                "utilisation_units_client": d.busy_units() / (LIMIT_3 * d.window),
                "utilisation_units_redis": float(d.server["units"].mean()) / LIMIT_3,
                "w1_wait_ms": p1,
                "w16_wait_ms": p16,
                "w16_p99_vs_w1_p99": p16["p99"] / p1["p99"],
                "grants_per_s": len(d.granted_in(d.recs)) / d.window,
                "lua_us_per_grant": d.lua_us_per_grant(),
            }
        res["weights"] = wts
        f, p = wts["fifo"], wts["fair"]
        peak = max(p["units_redis_max"], p["units_external_sampled_max"], p["units_external_peak"])
        ok_peak = peak <= LIMIT_3
        ok_util = p["utilisation_units_client"] >= UTIL_TARGET_3
        ok_ratio = p["w16_p99_vs_w1_p99"] <= WAIT_RATIO_TARGET
        rows += [
            ("weights", "units held max: Redis sampled", f["units_redis_max"],
             p["units_redis_max"], f"<= {LIMIT_3}", _verdict(p["units_redis_max"] <= LIMIT_3)),
            ("weights", "units in use max: external sampled", f["units_external_sampled_max"],
             p["units_external_sampled_max"], f"<= {LIMIT_3}",
             _verdict(p["units_external_sampled_max"] <= LIMIT_3)),
            ("weights", "units in use: external exact peak", f["units_external_peak"],
             p["units_external_peak"], f"<= {LIMIT_3}",
             _verdict(p["units_external_peak"] <= LIMIT_3)),
            ("weights", "unit utilisation (client)", f["utilisation_units_client"],
             p["utilisation_units_client"], f">= {UTIL_TARGET_3}", _verdict(ok_util)),
            ("weights", "unit utilisation (Redis)", f["utilisation_units_redis"],
             p["utilisation_units_redis"], "-", "-"),
            ("weights", "w1 wait p99 ms", f["w1_wait_ms"]["p99"], p["w1_wait_ms"]["p99"], "-",
             "-"),
            ("weights", "w16 wait p99 ms", f["w16_wait_ms"]["p99"], p["w16_wait_ms"]["p99"], "-",
             "-"),
            ("weights", "w16 p99 / w1 p99", f["w16_p99_vs_w1_p99"], p["w16_p99_vs_w1_p99"],
             f"<= {WAIT_RATIO_TARGET}", _verdict(ok_ratio)),
            ("weights", "grants/s", f["grants_per_s"], p["grants_per_s"], "-", "-"),
        ]  # fmt: skip
        heads += [
            Headline(NAME, f"weights: max units held, Redis / external (FIFO external peak "
                     f"{f['units_external_peak']})",
                     f"{p['units_redis_max']} / {p['units_external_peak']}", f"<= {LIMIT_3}",
                     ok_peak),
            Headline(NAME, "weights: unit utilisation, client (Redis)",
                     f"{p['utilisation_units_client']:.3f} ({p['utilisation_units_redis']:.3f})",
                     f">= {UTIL_TARGET_3}", ok_util),
            Headline(NAME, "weights: w16 p99 / w1 p99 wait", f"{p['w16_p99_vs_w1_p99']:.2f}",
                     f"<= {WAIT_RATIO_TARGET}", ok_ratio),
        ]  # fmt: skip

        # 4. cost
        crow = {(x["waiters"], x["tenants"]): x for x in cost["rows"]}
        sizes = sorted({x["waiters"] for x in cost["rows"]})
        kinds = ("grant_cycle_us", "park_cancel_us")
        many = {k: crow[(100_000, 1000)][k] / crow[(100_000, 1)][k] for k in kinds}
        many_10k = {k: crow[(10_000, 1000)][k] / crow[(10_000, 1)][k] for k in kinds}
        growth = {k: crow[(sizes[-1], 1)][k] / crow[(sizes[0], 1)][k] for k in kinds}
        growth_many = {k: crow[(sizes[-1], 1000)][k] / crow[(1000, 1000)][k] for k in kinds}
        cost.update(
            tenants_1000_vs_1_at_100k=many,
            tenants_1000_vs_1_at_10k=many_10k,
            growth_one_tenant=growth,
            growth_1000_tenants_1k_to_100k=growth_many,
        )
        res["cost"] = cost
        worst_many = max(*many.values(), *many_10k.values())
        worst_growth = max(*growth.values(), *growth_many.values())
        heads += [
            Headline(NAME, "cost: 1,000 tenants / one tenant, worst script pair",
                     f"{worst_many:.2f}x", f"<= {COST_TARGET}x", worst_many <= COST_TARGET),
            Headline(NAME, "cost: growth 10 -> 100,000 waiters, worst",
                     f"{worst_growth:.2f}x", f"<= {GROWTH_TARGET}x",
                     worst_growth <= GROWTH_TARGET),
            Headline(NAME, "cost: Lua µs per grant cycle, 100k waiters, 1 / 1,000 tenants",
                     f"{crow[(100_000, 1)]['grant_cycle_us']:.0f} / "
                     f"{crow[(100_000, 1000)]['grant_cycle_us']:.0f}", "-", None),
        ]  # fmt: skip

        text = table(
            ("scenario", "figure", "FIFO", "admission", "target", ""),
            rows,
        )
        text += "\n\n" + table(
            ("waiters", "tenants", "grant cycle µs", "park + cancel µs"),
            [(x["waiters"], x["tenants"], x["grant_cycle_us"], x["park_cancel_us"])
             for x in cost["rows"]],
        )  # fmt: skip
        text += "\n" + table(
            ("", *kinds),
            [
                ("1,000 tenants / 1 at 10k", *many_10k.values()),
                ("1,000 tenants / 1 at 100k", *many.values()),
                ("growth 10 -> 100k, 1 tenant", *growth.values()),
                ("growth 1k -> 100k, 1,000 tenants", *growth_many.values()),
            ],
        )
        res["workers_stuck_in_close"] = data["interactive_fifo"].extra["workers_stuck_in_close"]
        res["phases_late_s"] = {k: d.late_s for k, d in data.items()}
        fig = plot(data, res)
        save(NAME, opts, rp.url, res, text, fig)
    return heads


def plot(data: dict[str, PhaseData], res: dict[str, Any]) -> Any:
    fig, ax = figure(4)
    a = ax[0][0]
    for v, style in (("fifo", "tab:red"), ("fair", "tab:blue")):
        d = data[f"interactive_{v}"]
        w = np.sort(d.waits_ms(d.of("interactive")))
        if len(w):
            a.plot(
                w,
                np.linspace(0, 1, len(w)),
                color=style,
                label=f"interactive, {'FIFO' if v == 'fifo' else 'priority 10'}",
            )
    hold = res["interactive"]["fair"]["mean_hold_ms"]
    a.axvline(P99_HOLD_TARGET * hold, color="grey", ls="--", label="1.5 x mean hold")
    a.set_xscale("log")
    a.set_xlabel("interactive wait (ms)")
    a.set_ylabel("CDF")
    a.set_title(f"4 x {BATCH_PER_PROC} batch + 20/s interactive", fontsize=9)
    a.legend(fontsize=8)

    a = ax[0][1]
    ten = res["tenants"]
    names = ["FIFO", "1:1", "3:1"]
    vals = [ten["fifo"]["share_small"], ten["equal"]["share_small"], ten["3to1"]["share_small"]]
    a.bar(names, vals, color=["tab:red", "tab:blue", "tab:blue"])
    for x, t in ((1, 0.5), (2, 0.75)):
        a.errorbar([x], [t], yerr=[SHARE_TOL], fmt="_", color="black", capsize=8)
    a.set_ylim(0, 1)
    a.set_ylabel("share of units to tenant small")
    a.set_title(f"tenants: bulk 4 x {BATCH_PER_PROC}, small {SMALL_TASKS}", fontsize=9)

    a = ax[0][2]
    for v, color in (("fifo", "tab:red"), ("fair", "tab:blue")):
        d = data[f"weights_{v}"]
        ts = np.arange(len(d.server["counter"])) / 100
        lab = "count-based (all weight 1)" if v == "fifo" else "weights 1/16"
        a.plot(ts, d.server["counter"], color=color, lw=0.8, label=f"units in use, {lab}")
    a.axhline(LIMIT_3, color="grey", ls="--", label=f"limit {LIMIT_3}")
    a.set_xlabel("s into the window")
    a.set_ylabel("units in use (external counter)")
    a.set_title("mixed weights {1, 16}, limit 64", fontsize=9)
    a.legend(fontsize=8)

    a = ax[0][3]
    cost = res["cost"]["rows"]
    for many, style in ((False, "o-"), (True, "s-")):
        pts = [x for x in cost if (x["tenants"] > 1) == many]
        a.plot(
            [x["waiters"] for x in pts],
            [x["grant_cycle_us"] for x in pts],
            style,
            label=f"grant cycle, {'min(n, 1000) tenants' if many else '1 tenant'}",
        )
    a.set_xscale("log")
    a.set_ylim(bottom=0)
    a.set_xlabel("waiters")
    a.set_ylabel("Lua µs per release + hand-off + park")
    a.legend(fontsize=8)
    fig.suptitle("fleetgate admission order vs plain FIFO (same run)")
    return fig


if __name__ == "__main__":
    import sys

    from ._common import main

    sys.exit(main(only=[NAME]))
