"""peers: fleetgate against two published Redis semaphores, same workload, same Redis, one run.

The workload of ``throughput``: 4 OS processes x 250 concurrent acquirers, limit 32, 20 ms hold,
a fixed window after a warm-up, every process started at one common instant (each process
connects, reports ready, then sleeps until a CLOCK_MONOTONIC instant handed to all of them).
Implementations, one after the other on the same private redis-server:

* **fleetgate**: ``gate.permit()``, the worker of ``throughput.py`` itself.
* **redis-semaphore (npm)** 5.8.0 on ioredis 5, 4 node processes: ``Semaphore(client, key, 32,
  {lockTimeout: 10000, acquireTimeout: 600000, retryInterval: 10})``. It has no wait list: a
  waiter retries its acquire script every ``retryInterval`` ms, so it cannot be FIFO; the
  options make it a blocking semaphore (no acquire timeout within the run, unlimited attempts,
  the 10 s lease TTL of the fleetgate gate, refreshed at 0.8 x TTL) and keep the default retry
  interval (its README's; shorter polls by 1000 waiters would swamp Redis and the clients).
* **redis-limiters (PyPI)** 0.7.0 ``AsyncSemaphore(name, capacity=32, max_sleep=0)`` in a venv
  of its own (never the project's). 32 tokens in a Redis list; a waiter blocks in ``BLPOP`` on
  its own connection (250 per process, opened before the start); Redis serves blocked clients
  first come first served, so it is FIFO. No leases: a holder that dies loses the token until the
  idle list expires (``expiry``, 30 s).

Figures per implementation over the window, from the clients' records (asked, granted, left)
and ``INFO commandstats``/``INFO cpu`` deltas: grants/s, utilisation (time inside holds /
(limit x window)), wait p50/p99 and p99 / FIFO ideal (mean number waiting / ideal rate, the
number waiting counted from the records so every implementation is measured alike), client CPU
µs per grant (all worker processes' CPU in the window / grants), Redis commands per grant (all,
script-internal included), Lua µs per grant (EVAL/EVALSHA usec), Redis µs per grant (usec of the
commands clients send; script-internal time is inside EVALSHA's) and redis-server CPU per grant.

Peers are installed on first use into ``benchmarks/peers/node`` (npm) and
``benchmarks/peers/.venv-limiters`` (pip), both git-ignored; a peer whose runtime is missing or
whose install fails is skipped with the reason printed.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import numpy as np
import redis

from . import throughput
from ._common import Headline, Options, figure, log, percentiles, save, table
from ._server import (
    CLIENT_COMMANDS,
    busy_fraction,
    delta,
    machine_jiffies,
    mark_old,
    private_redis,
    redis_counters,
    sleep_until,
    sync_client,
)
from ._workers import Workers

NAME = "peers"
PROCS, TASKS, LIMIT, HOLD_S = throughput.PROCS, throughput.TASKS, throughput.LIMIT, 0.020
GATE = "bench-peers"
HERE = Path(__file__).resolve().parent / "peers"
NODE_DIR = HERE / "node"
VENV_DIR = HERE / ".venv-limiters"
NPM_PACKAGES = ("redis-semaphore@5.8.0", "ioredis@5")
PYPI_PACKAGE = ("redis-limiters", "0.7.0")
SEMAPHORE_OPTIONS = {"lockTimeout": 10_000, "acquireTimeout": 600_000, "retryInterval": 10}
LIMITERS_OPTIONS = {"max_sleep": 0, "expiry": 30}

# The hot path's targets, for fleetgate's figures in this run.
CPU_TARGET_US, LUA_TARGET_US, CMDS_TARGET, P99_TARGET = 250.0, 40.0, 12.0, 1.2


@dataclass
class Impl:
    key: str  # short name (JSON keys, file names)
    label: str
    fair: str  # fairness note
    client_commands: frozenset[str]  # commands its clients send (the rest ran inside scripts)
    skipped: str | None = None
    result: dict[str, Any] = field(default_factory=dict)  # mean over rounds
    rounds: list[dict[str, Any]] = field(default_factory=list)


IMPLS = (
    Impl(
        "fleetgate",
        "fleetgate",
        "FIFO (wait list in Redis, hand-off to the head waiter)",
        CLIENT_COMMANDS,
    ),
    Impl(
        "redis_semaphore",
        "redis-semaphore 5.8.0 (npm)",
        "not FIFO (each waiter polls every 10 ms; whoever polls first after a release wins)",
        frozenset({"evalsha", "eval", "zrem", "info", "ping", "client|setinfo", "hello"}),
    ),
    Impl(
        "redis_limiters",
        "redis-limiters 0.7.0 (PyPI)",
        "FIFO (token list, waiters blocked in BLPOP served in arrival order); no leases",
        frozenset(
            {"evalsha", "eval", "blpop", "expire", "lpush", "multi", "exec", "ping", "hello"}
            | {"client|setinfo"}
        ),
    ),
)

# -- installing the peers -----------------------------------------------------------------------


def _run(cmd: list[str], timeout: float, **kw: Any) -> str | None:
    """Run an install step; None when it worked, else the reason it did not."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{' '.join(cmd[:3])}: {e}"
    if p.returncode != 0:
        tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
        return f"{' '.join(cmd[:3])} exited {p.returncode}: {' | '.join(tail)}"
    return None


def node_peer() -> tuple[list[str], dict[str, str]] | str:
    """(command, env) of the npm peer's worker, installing it on first use; or why not."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        return "node/npm not on PATH"
    modules = NODE_DIR / "node_modules"
    pkg = modules / "redis-semaphore" / "package.json"
    if not (pkg.exists() and (modules / "ioredis").exists()):
        NODE_DIR.mkdir(parents=True, exist_ok=True)
        log(f"{NAME}: npm install {' '.join(NPM_PACKAGES)} into {NODE_DIR}")
        why = _run(
            [
                npm,
                "install",
                "--prefix",
                str(NODE_DIR),
                "--no-audit",
                "--no-fund",
                "--fetch-retries=1",
                "--fetch-timeout=30000",
                *NPM_PACKAGES,
            ],
            timeout=300,
        )
        if why:
            return f"npm install failed: {why}"
    try:
        version = json.loads(pkg.read_text())["version"]
    except (OSError, ValueError, KeyError) as e:
        return f"redis-semaphore not installed in {NODE_DIR}: {e}"
    if version != NPM_PACKAGES[0].split("@")[1]:
        return f"{NODE_DIR} holds redis-semaphore {version}; remove it to reinstall"
    env = {**os.environ, "NODE_PATH": str(modules)}
    return [node, str(HERE / "semaphore_worker.js")], env


def pypi_peer() -> tuple[list[str], dict[str, str]] | str:
    """(command, env) of the PyPI peer's worker in its own venv (made on first use); or why not."""
    name, version = PYPI_PACKAGE
    python = VENV_DIR / "bin" / "python"
    probe = [str(python), "-c", "import importlib.metadata as m, redis_limiters; "
             f"print(m.version('{name}'))"]  # fmt: skip
    ok = python.exists() and _installed(probe) == version
    if not ok:
        log(f"{NAME}: creating {VENV_DIR} with {name}=={version}")
        why = _run([sys.executable, "-m", "venv", "--clear", str(VENV_DIR)], timeout=120)
        why = why or _run(
            [
                str(python),
                "-m",
                "pip",
                "install",
                "-q",
                "--disable-pip-version-check",
                "--timeout",
                "30",
                "--retries",
                "1",
                f"{name}=={version}",
            ],
            timeout=300,
        )
        if why:
            return f"pip install {name}=={version} failed: {why}"
        if (got := _installed(probe)) != version:
            return f"{name} {version} not importable in {VENV_DIR} (got {got!r})"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return [str(python), str(HERE / "limiters_worker.py")], env


def _installed(probe: list[str]) -> str | None:
    try:
        p = subprocess.run(probe, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return p.stdout.strip() if p.returncode == 0 else None


# -- running one implementation ------------------------------------------------------------------


@dataclass
class Measured:
    recs: np.ndarray  # (n, 3): asked, granted, left (monotonic ns)
    cpu_s: float  # all worker processes' CPU in the window
    counters: dict[str, float]  # INFO commandstats / cpu deltas over the window
    machine_busy: float | None
    lo: int
    hi: int
    errors: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def server_window(url: str, lo: int, hi: int) -> tuple[dict[str, float], float | None]:
    """INFO commandstats/cpu deltas and the machine's busy fraction between two instants."""
    r = sync_client(url)
    sleep_until(lo)
    busy0, before = machine_jiffies(), redis_counters(r)
    sleep_until(hi)
    after, busy1 = redis_counters(r), machine_jiffies()
    r.close()
    busy = busy_fraction(busy0, busy1)
    return delta(before, after), busy


def run_fleetgate(url: str, warm: float, seconds: float, opts: Options) -> Measured:
    throughput.configure_workload(url, GATE)
    args = [(url, GATE, TASKS, warm, seconds, opts.flavor)] * PROCS
    with Workers(throughput.acquirers, args) as w:
        start = w.go()
        lo, hi = start + int(warm * 1e9), start + int((warm + seconds) * 1e9)
        counters, busy = server_window(url, lo, hi)
        out = w.results(timeout=120)
    recs = np.array([r[:3] for rs, _, _ in out for r in rs], dtype=np.int64)
    events = {k: sum(e[k] for _, _, e in out) for k in out[0][2]}
    return Measured(
        recs,
        sum(c for _, c, _ in out),
        counters,
        busy,
        lo,
        hi,
        extra={"client_warnings": events, "workers_stuck_in_close": len(w.stuck)},
    )


def run_processes(
    cmd: list[str], env: dict[str, str], spec: dict[str, Any], url: str, warm: float, seconds: float
) -> Measured:
    """PROCS peer worker processes, released at one instant once all are connected."""
    with tempfile.TemporaryDirectory(prefix="fleetgate-peers-") as tmp:
        outs = [Path(tmp) / f"out{i}.json" for i in range(PROCS)]
        procs = [
            subprocess.Popen(
                [*cmd, json.dumps({**spec, "out": str(o)})],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
                text=True,
            )
            for o in outs
        ]
        try:
            for p in procs:
                assert p.stdout is not None
                ready, _, _ = select.select([p.stdout], [], [], 60.0)
                line = p.stdout.readline() if ready else ""
                if line.strip() != "ready":
                    raise RuntimeError(f"peer worker {p.pid} not ready: {line!r}, {p.poll()=}")
            start = time.monotonic_ns() + 200_000_000
            for p in procs:
                assert p.stdin is not None
                p.stdin.write(f"{start}\n")
                p.stdin.flush()
            lo, hi = start + int(warm * 1e9), start + int((warm + seconds) * 1e9)
            counters, busy = server_window(url, lo, hi)
            for p in procs:
                if p.wait(timeout=120) != 0:
                    raise RuntimeError(f"peer worker {p.pid} exited {p.returncode}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        got = [json.loads(o.read_text()) for o in outs]
    recs = np.concatenate([np.asarray(g["recs"], dtype=np.int64).reshape(-1, 3) for g in got])
    return Measured(
        recs,
        sum(float(g["cpu_s"]) for g in got),
        counters,
        busy,
        lo,
        hi,
        errors=sum(int(g["errors"]) for g in got),
    )


def _reset(url: str) -> None:
    """Empty the private server between runs; fleetgate's prefix stays marked old, or its run
    would start behind the recovery fence of a server seen empty."""
    with redis.Redis.from_url(url) as r:
        r.flushall()
        mark_old(r)


# -- figures -----------------------------------------------------------------------------------


def figures(m: Measured, client_commands: frozenset[str]) -> dict[str, Any]:
    lo, hi = m.lo, m.hi
    window = (hi - lo) / 1e9
    asked, granted, left = m.recs[:, 0], m.recs[:, 1], m.recs[:, 2]
    in_win = (granted >= lo) & (granted < hi)
    grants = int(in_win.sum())
    per = max(1, grants)
    busy = np.clip(np.minimum(left, hi) - np.maximum(granted, lo), 0, None).sum() / 1e9
    waiting = np.clip(np.minimum(granted, hi) - np.maximum(asked, lo), 0, None).sum() / 1e9
    mean_waiting = waiting / window
    ideal = LIMIT / HOLD_S
    rate = grants / window
    waits = (granted[in_win] - asked[in_win]) / 1e6
    wait = percentiles(waits)
    fifo_ideal_ms = mean_waiting / ideal * 1000
    c = m.counters
    calls = {
        k.removeprefix("calls:"): v
        for k, v in c.items()
        if k.startswith("calls:") and k not in ("calls:info",)
    }
    client_us = sum(c.get(f"usec:{k}", 0.0) for k in calls if k in client_commands)
    lua_us = c.get("usec:evalsha", 0.0) + c.get("usec:eval", 0.0) + c.get("usec:fcall", 0.0)
    # FIFO check from the clients' clocks: how far each grant's position in grant order is
    # from its position in ask order (asks stamped before the call leaves the event loop, so a
    # FIFO queue still shows some displacement when the loops lag).
    ask_rank = np.argsort(np.argsort(asked[in_win], kind="stable"), kind="stable")
    grant_rank = np.argsort(np.argsort(granted[in_win], kind="stable"), kind="stable")
    displacement = percentiles(np.abs(ask_rank - grant_rank), (50, 99))
    return {
        "window_s": window,
        "grants": grants,
        "grants_per_s": rate,
        "rate_vs_ideal": rate / ideal,
        "utilisation": busy / (LIMIT * window),
        "mean_waiting": mean_waiting,
        "wait_ms": {**wait, "mean": float(waits.mean()) if waits.size else float("nan")},
        "wait_max_ms": float(waits.max()) if waits.size else float("nan"),
        "fifo_ideal_wait_ms": fifo_ideal_ms,
        "wait_p50_vs_ideal": wait["p50"] / fifo_ideal_ms,
        "wait_p99_vs_ideal": wait["p99"] / fifo_ideal_ms,
        "wait_p99_vs_p50": wait["p99"] / wait["p50"],
        "order_displacement_positions": displacement,
        "client_cpu_us_per_grant": m.cpu_s / per * 1e6,
        "client_cpu_cores": m.cpu_s / window,
        "cmds_per_grant": sum(calls.values()) / per,
        "client_cmds_per_grant": sum(v for k, v in calls.items() if k in client_commands) / per,
        "cmds_per_grant_by_command": {k: v / per for k, v in sorted(calls.items())},
        "lua_us_per_grant": lua_us / per,
        "redis_us_per_grant": client_us / per,
        "redis_cpu_us_per_grant": c.get("cpu:redis", 0.0) / per * 1e6,
        "machine_cpu_busy_all_processes": m.machine_busy,
        "errors": m.errors,
        **m.extra,
    }


def _mean(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The mean of each numeric figure over rounds (nested dicts too); others from the first."""
    out: dict[str, Any] = {}
    for k, v in rounds[0].items():
        vals = [r.get(k) for r in rounds]
        if isinstance(v, dict):
            out[k] = _mean(cast(list[dict[str, Any]], vals))
        elif isinstance(v, (int, float)) and all(isinstance(x, (int, float)) for x in vals):
            out[k] = float(np.mean(cast(list[float], vals)))
        else:
            out[k] = v
    return out


ROWS: tuple[tuple[str, str, Callable[[dict[str, Any]], float]], ...] = (
    ("grants/s (ideal 1600)", "grants_per_s", lambda r: r["grants_per_s"]),
    ("utilisation", "utilisation", lambda r: r["utilisation"]),
    ("wait p50 ms", "wait_p50", lambda r: r["wait_ms"]["p50"]),
    ("wait p99 ms", "wait_p99", lambda r: r["wait_ms"]["p99"]),
    ("wait max ms", "wait_max", lambda r: r["wait_max_ms"]),
    ("FIFO ideal wait ms", "fifo_ideal", lambda r: r["fifo_ideal_wait_ms"]),
    ("wait p99 / FIFO ideal", "p99_vs_ideal", lambda r: r["wait_p99_vs_ideal"]),
    ("wait p99 / p50", "p99_vs_p50", lambda r: r["wait_p99_vs_p50"]),
    (
        "grant vs ask order, p50 places",
        "disp50",
        lambda r: r["order_displacement_positions"]["p50"],
    ),
    (
        "grant vs ask order, p99 places",
        "disp99",
        lambda r: r["order_displacement_positions"]["p99"],
    ),
    ("client CPU µs / grant", "cpu", lambda r: r["client_cpu_us_per_grant"]),
    ("Redis cmds / grant (all)", "cmds", lambda r: r["cmds_per_grant"]),
    ("  sent by clients", "client_cmds", lambda r: r["client_cmds_per_grant"]),
    ("Lua µs / grant", "lua", lambda r: r["lua_us_per_grant"]),
    ("Redis µs / grant (client cmds)", "redis_us", lambda r: r["redis_us_per_grant"]),
    ("redis-server CPU µs / grant", "redis_cpu", lambda r: r["redis_cpu_us_per_grant"]),
    ("machine CPU busy (all procs)", "busy", lambda r: r["machine_cpu_busy_all_processes"] or 0),
)


def run(opts: Options) -> list[Headline]:
    warm, seconds = opts.pick((2.0, 10.0), (1.0, 2.5))
    rounds = opts.pick(2, 1)
    spec = {
        "tasks": TASKS,
        "limit": LIMIT,
        "hold_ms": HOLD_S * 1000,
        "warm_s": warm,
        "seconds": seconds,
    }
    impls = {i.key: replace(i, result={}, rounds=[]) for i in IMPLS}
    with private_redis() as rp:
        url = rp.url
        # Full runs measure each implementation twice, in the order A B C C B A, so a drift
        # of the machine's other load over the run does not favour whoever goes first.
        order = list(impls.values())
        order = order + order[::-1] if rounds == 2 else order
        for impl in order:
            if impl.skipped:
                continue
            _reset(url)
            what = f"{PROCS}x{TASKS} acquirers, {seconds} s after {warm} s"
            if impl.key == "fleetgate":
                log(f"{NAME}: fleetgate, {what}")
                m = run_fleetgate(url, warm, seconds, opts)
            else:
                peer = node_peer() if impl.key == "redis_semaphore" else pypi_peer()
                if isinstance(peer, str):
                    impl.skipped = peer
                    log(f"{NAME}: SKIPPED {impl.label}: {peer}")
                    continue
                cmd, env = peer
                options = SEMAPHORE_OPTIONS if impl.key == "redis_semaphore" else LIMITERS_OPTIONS
                log(f"{NAME}: {impl.label}, {what}")
                try:
                    m = run_processes(
                        cmd,
                        env,
                        {**spec, "url": url, "key": GATE, "options": options},
                        url,
                        warm,
                        seconds,
                    )
                except Exception as e:  # a broken peer must not sink the suite
                    impl.skipped = f"run failed: {e}"
                    log(f"{NAME}: SKIPPED {impl.label}: {impl.skipped}")
                    continue
            impl.rounds.append(figures(m, impl.client_commands))
        for impl in impls.values():
            if not impl.skipped:
                impl.result = _mean(impl.rounds)
        fg = impls["fleetgate"].result
        ran = [i for i in impls.values() if not i.skipped]
        headers = ["figure"]
        for i in ran:
            headers += [i.label] if i.key == "fleetgate" else [i.label, "÷ fleetgate"]
        rows = []
        for title, _, get in ROWS:
            row: list[Any] = [title]
            for i in ran:
                v = get(i.result)
                row.append(v)
                if i.key != "fleetgate":
                    base = get(fg)
                    row.append(f"{v / base:.2f}×" if base else "-")
            rows.append(row)
        text = table(headers, rows)
        if rounds > 1:
            text += "\n\nper round (utilisation, wait p99 ms, client CPU µs/grant):\n" + "\n".join(
                f"  {i.label}: "
                + "; ".join(
                    f"{r['utilisation']:.3f}, {r['wait_ms']['p99']:.0f}, "
                    f"{r['client_cpu_us_per_grant']:.0f}"
                    for r in i.rounds
                )
                for i in ran
            )
        text += "\n\nfairness:\n" + "\n".join(f"  {i.label}: {i.fair}" for i in impls.values())
        skipped = [i for i in impls.values() if i.skipped]
        if skipped:
            text += "\n\nskipped:\n" + "\n".join(f"  {i.label}: {i.skipped}" for i in skipped)
        text += (
            f"\n\nMeans of {rounds} round(s) (order A B C C B A when 2); per-round figures in "
            "the JSON. One private redis-server, one implementation at a time, same machine "
            f"({os.cpu_count()} cores, shared with other jobs: noisy figures)."
        )
        data = {
            "workload": {
                "processes": PROCS,
                "tasks_per_process": TASKS,
                "limit": LIMIT,
                "hold_ms": HOLD_S * 1000,
                "warm_s": warm,
                "window_s": seconds,
                "rounds": rounds,
            },
            "options": {
                "redis_semaphore": SEMAPHORE_OPTIONS,
                "redis_limiters": LIMITERS_OPTIONS,
            },
            "implementations": {
                i.key: {
                    "label": i.label,
                    "fairness": i.fair,
                    "skipped": i.skipped,
                    **i.result,
                    "rounds": i.rounds,
                }
                for i in impls.values()
            },
        }
        fig, ax = figure(3)
        labels = [i.label.replace(" (", "\n(") for i in ran]
        colors = ["tab:blue", "tab:orange", "tab:green"][: len(ran)]
        panels: tuple[tuple[str, Callable[[dict[str, Any]], float]], ...] = (
            ("utilisation (time in holds / limit × window)", lambda r: r["utilisation"]),
            ("wait p99 (ms); dashed: FIFO ideal", lambda r: r["wait_ms"]["p99"]),
            ("client CPU µs per grant", lambda r: r["client_cpu_us_per_grant"]),
        )
        for a, (title, get) in zip(ax[0], panels, strict=True):
            vals = [get(i.result) for i in ran]
            a.bar(labels, vals, color=colors)
            for x, v in enumerate(vals):
                a.annotate(
                    f"{v:,.0f}" if v >= 100 else f"{v:.3g}", (x, v), ha="center", va="bottom"
                )
            a.set_title(title, fontsize=10)
            a.tick_params(axis="x", labelsize=8)
        for x, i in enumerate(ran):
            ax[0][1].hlines(
                i.result["fifo_ideal_wait_ms"], x - 0.4, x + 0.4, colors="k", linestyles="--"
            )
        ax[0][0].axhline(1.0, color="grey", lw=0.5)
        fig.suptitle(
            f"{PROCS}x{TASKS} acquirers, limit {LIMIT}, hold {HOLD_S * 1000:.0f} ms, "
            f"same redis-server ({opts.flavor.label} for fleetgate)"
        )
        save(NAME, opts, url, data, text, fig)
    return headlines(impls)


def headlines(impls: dict[str, Impl]) -> list[Headline]:
    fg = impls["fleetgate"].result
    peers = [i for k, i in impls.items() if k != "fleetgate" and not i.skipped]
    util_peers = max((i.result["utilisation"] for i in peers), default=float("nan"))
    out = [
        Headline(
            NAME,
            "fleetgate client CPU µs / contended grant",
            f"{fg['client_cpu_us_per_grant']:.0f}",
            f"<= {CPU_TARGET_US:.0f}",
            fg["client_cpu_us_per_grant"] <= CPU_TARGET_US,
        ),
        Headline(
            NAME,
            "fleetgate Lua µs / contended grant",
            f"{fg['lua_us_per_grant']:.1f}",
            f"<= {LUA_TARGET_US:.0f}",
            fg["lua_us_per_grant"] <= LUA_TARGET_US,
        ),
        Headline(
            NAME,
            "fleetgate Redis commands / grant",
            f"{fg['cmds_per_grant']:.1f}",
            f"<= {CMDS_TARGET:.0f}",
            fg["cmds_per_grant"] <= CMDS_TARGET,
        ),
        Headline(
            NAME,
            "fleetgate wait p99 / FIFO ideal",
            f"{fg['wait_p99_vs_ideal']:.2f}",
            f"<= {P99_TARGET}",
            fg["wait_p99_vs_ideal"] <= P99_TARGET,
        ),
    ]
    if peers:
        out.append(
            Headline(
                NAME,
                "fleetgate utilisation vs best peer",
                f"{fg['utilisation']:.3f} vs "
                + ", ".join(f"{i.label.split()[0]} {i.result['utilisation']:.3f}" for i in peers),
                ">= peers'",
                fg["utilisation"] >= util_peers,
            )
        )
    else:
        out.append(Headline(NAME, "peers", "all skipped", "-", None))
    return out


if __name__ == "__main__":
    from ._common import main

    sys.exit(main(only=[NAME]))
