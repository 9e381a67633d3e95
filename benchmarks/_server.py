"""The server side of the benchmarks: a private redis-server, gate setup, and what the server saw
(INFO commandstats and CPU deltas, sampled holders/queue, slow scripts, machine description)."""

from __future__ import annotations

import datetime as dt
import hashlib
import importlib
import os
import platform
import subprocess
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from fleetgate.keys import GateKeys, fleet_keys
from fleetgate.tools.redisproc import RedisProcess

PREFIX = "fgb"


@contextmanager
def private_redis() -> Iterator[RedisProcess]:
    """A private redis-server on a free port (never the machine's own Redis).

    Its prefixes are marked as old (``<prefix>:born`` = 0): no work ran on the new server, so a
    benchmark's first gate is not held behind the recovery fence of a server seen empty (it
    measures a gate with state; the fence's own cost is tests/lua/test_recovery_fence.py's)."""
    with RedisProcess() as proc:
        with redis.Redis.from_url(proc.url) as client:
            mark_old(client)
        yield proc


def mark_old(client: redis.Redis) -> None:
    """Mark the benchmarks' prefixes as old on ``client``'s server (see :func:`private_redis`);
    again after a FLUSHALL, which wipes the mark with the rest."""
    for prefix in (PREFIX, "fg"):
        client.set(fleet_keys(prefix).born, 0)


def sync_client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, decode_responses=True)


def configure_gate(url: str, name: str, **cfg: int) -> GateKeys:
    """Write the gate's configuration directly (as the coordinator would) and reset its state."""
    keys = GateKeys.of(PREFIX, name)
    r = sync_client(url)
    stale = list(r.scan_iter(match=f"{keys.base}:*", count=1000))
    if stale:
        r.delete(*stale)
    mapping: dict[Any, Any] = dict(cfg)
    r.hset(keys.cfg, mapping=mapping)
    r.close()
    return keys


def redis_counters(r: redis.Redis, keys: GateKeys | None = None) -> dict[str, float]:
    """``calls:<cmd>`` and ``usec:<cmd>`` from INFO commandstats, plus the gate's stats hash."""
    out: dict[str, float] = {}
    add_counters(out, r.info("commandstats"), r.info("cpu"))
    if keys is not None:
        stats: dict[Any, Any] = r.hgetall(keys.stats)
        out.update({f"stat:{_s(k)}": float(v) for k, v in stats.items()})
    return out


def add_counters(out: dict[str, float], commandstats: Any, cpu: Any) -> None:
    """Add one server's INFO commandstats and INFO cpu to ``out``: ``calls:<cmd>``,
    ``usec:<cmd>`` and ``cpu:redis`` (user + sys seconds). Summed over a Cluster's masters by
    calling it once per node."""
    for k, v in commandstats.items():
        cmd = k.removeprefix("cmdstat_")
        out[f"calls:{cmd}"] = out.get(f"calls:{cmd}", 0.0) + float(v["calls"])
        out[f"usec:{cmd}"] = out.get(f"usec:{cmd}", 0.0) + float(v["usec"])
    used = float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])
    out["cpu:redis"] = out.get("cpu:redis", 0.0) + used


def _all_counters(r: redis.Redis, keys: GateKeys, others: Sequence[str]) -> dict[str, float]:
    """:func:`redis_counters` of ``r`` plus the commandstats and CPU of the servers ``others``."""
    out = redis_counters(r, keys)
    for url in others:
        with sync_client(url) as o:
            add_counters(out, o.info("commandstats"), o.info("cpu"))
    return out


def _s(x: str | bytes) -> str:
    return x.decode() if isinstance(x, bytes) else x


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


def machine(url: str) -> dict[str, Any]:
    r = sync_client(url)
    server = r.info("server")
    r.close()
    versions: dict[str, str] = {}
    for mod in ("redis", "hiredis", "uvloop"):
        try:
            versions[mod] = str(importlib.import_module(mod).__version__)
        except Exception:
            versions[mod] = "absent"
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "redis_server": server.get("redis_version"),
        **{f"{k}_py": v for k, v in versions.items()},
        "loadavg_1m_at_end": round(os.getloadavg()[0], 2),
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "fleetgate": _source_version(),
    }


def _source_version() -> str:
    """The commit measured, with ``+dirty`` if the library's files differ from it."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "client", "fleetgate", "lua"],
            cwd=root,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "unknown"
    return f"{head}{'+dirty' if dirty else ''}" if head else "unknown"


def script_names() -> dict[str, str]:
    """What SLOWLOG names a gate script call by -> script name: the SHA1 of its EVAL source
    (an EVALSHA) and its function of the gate library (an FCALL)."""
    from fleetgate.scripts import SCRIPT_NAMES, gate_library, script_source

    names = {hashlib.sha1(script_source(n).encode()).hexdigest(): n for n in SCRIPT_NAMES}
    names.update({f: n for n, f in gate_library().functions.items()})
    return names


class LibraryFunction:
    """A gate script as the client runs it, a function of the gate library called by FCALL
    (``fleetgate.scripts.gate_library``), with the call shape of a redis-py ``Script``:
    ``f(keys=..., args=..., client=None)`` (a pipeline as ``client`` queues the call)."""

    def __init__(self, r: redis.Redis, function: str) -> None:
        self.r, self.function = r, function

    def __call__(self, keys: list[str], args: list[Any], client: Any = None) -> Any:
        return (client or self.r).fcall(self.function, len(keys), *keys, *args)


def library_functions(r: redis.Redis, names: Iterable[str]) -> dict[str, LibraryFunction]:
    """The gate library loaded on ``r`` (once: FUNCTION LOAD before any timed frame) and the
    functions of ``names``. Their server time is ``cmdstat_fcall`` in INFO commandstats."""
    from fleetgate.scripts import gate_library

    lib = gate_library()
    try:
        r.function_load(lib.source)
    except redis.ResponseError as exc:
        if "already exists" not in str(exc):
            raise
    return {n: LibraryFunction(r, lib.functions[n]) for n in names}


@dataclass
class Window:
    """What the server saw between ``start_ns`` and ``end_ns`` (monotonic)."""

    seconds: float
    counters: dict[str, float]  # delta of redis_counters() over the window
    samples: list[tuple[int, int]]  # (holders, queued) sampled by the monitor
    slow: dict[str, list[int]]  # script name -> durations (µs) above the slowlog threshold
    own_calls: dict[str, int]  # commands issued by the monitor itself (subtract them)
    machine_busy: float | None  # all processes, all cores (from /proc/stat; None elsewhere)


def watch(
    url: str,
    keys: GateKeys,
    start_ns: int,
    end_ns: int,
    hz: float = 100.0,
    slow_us: int = 500,
    others: Sequence[str] = (),
) -> Window:
    """Sample ZCARD holders/queue at ``hz`` and take counter deltas over [start_ns, end_ns].

    ``url`` is the server holding the gate (on a Cluster: the master of its slot); the
    commandstats and CPU of the servers ``others`` (a Cluster's other masters) are added to
    the counters. Script calls slower than ``slow_us`` are collected from SLOWLOG (by SHA or
    function name) of ``url``."""
    r = sync_client(url)
    r.config_set("slowlog-max-len", 10_000)
    r.config_set("slowlog-log-slower-than", slow_us)
    sleep_until(start_ns)
    r.slowlog_reset()
    busy0 = machine_jiffies()
    before = _all_counters(r, keys, others)
    samples: list[tuple[int, int]] = []
    period = int(1e9 / hz)
    tick = start_ns
    while tick < end_ns:
        with r.pipeline(transaction=False) as p:
            p.zcard(keys.holders)
            p.zcard(keys.waiters)
            h, q = p.execute()
        samples.append((int(h), int(q)))
        tick += period
        sleep_until(min(tick, end_ns))
    counters = delta(before, _all_counters(r, keys, others))
    busy1 = machine_jiffies()
    busy = busy_fraction(busy0, busy1)
    names = script_names()
    slow: dict[str, list[int]] = {}
    entries: Any = r.slowlog_get(-1)
    for e in entries:
        cmd = e["command"]
        words = _s(cmd).split()
        if len(words) > 1 and words[0].lower() in ("evalsha", "fcall"):
            slow.setdefault(names.get(words[1], "other"), []).append(int(e["duration"]))
    r.config_set("slowlog-log-slower-than", 10_000)
    r.close()
    own = {"zcard": 2 * len(samples), "hgetall": 1, "info": 2}
    return Window((end_ns - start_ns) / 1e9, counters, samples, slow, own, busy)


def machine_jiffies() -> tuple[int, int] | None:
    """(busy, total) CPU jiffies of the whole machine, or None off Linux."""
    try:
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
    return sum(vals) - idle, sum(vals)


def busy_fraction(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The machine's busy fraction between two :func:`machine_jiffies` readings, or None."""
    if before and after and after[1] > before[1]:
        return (after[0] - before[0]) / (after[1] - before[1])
    return None


def sleep_until(t_ns: int) -> None:
    """Sleep until ``time.monotonic_ns()`` reaches ``t_ns`` (at once if it has)."""
    left = (t_ns - time.monotonic_ns()) / 1e9
    if left > 0:
        time.sleep(left)


# Commands clients send themselves; everything else in commandstats ran inside a script.
CLIENT_COMMANDS = frozenset(
    {"evalsha", "eval", "blpop", "ping", "hello", "client|setinfo", "script|load", "select"}
    | {"fcall", "function|load"}
)


def command_split(w: Window) -> dict[str, float]:
    """Client round trips vs script-internal commands over a window (monitor's own removed)."""
    client = internal = 0.0
    for k, v in w.counters.items():
        if not k.startswith("calls:"):
            continue
        cmd = k.removeprefix("calls:")
        v -= w.own_calls.get(cmd, 0)
        if cmd in ("info", "slowlog|reset", "config|set", "slowlog|get"):
            continue
        if cmd in CLIENT_COMMANDS:
            client += v
        else:
            internal += v
    return {"client": client, "internal": internal}
