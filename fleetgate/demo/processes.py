"""The machinery of ``fleetgate demo``: child processes, setup, and the live phase.

:class:`Children` owns every process the demo starts (each in its own process group, stopped in
order with SIGTERM, a bounded wait and SIGKILL). :func:`prepare` starts Redis, the simulators,
the coordinators and the workers, each waited for by polling, never by sleeping a fixed time.
The live phase itself is :class:`fleetgate.demo.live.LiveRun`.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import redis

from fleetgate._redis import redact
from fleetgate.coordinator.config import CoordinatorSettings
from fleetgate.demo.interactive import SPEC_ENV as INTERACTIVE_ENV
from fleetgate.demo.interactive import InteractiveSpec
from fleetgate.demo.report import worker_totals
from fleetgate.keys import fleet_keys
from fleetgate.tools.load import SPEC_ENV, GateLoad, Kind, LoadSpec
from fleetgate.tools.redisproc import RedisProcess, RedisServerMissing, free_port

__all__ = [
    "GATES",
    "LEADER_TTL",
    "POLL_INTERVAL",
    "Children",
    "DemoError",
    "DemoGate",
    "Setup",
    "prepare",
    "read_gateway_totals",
    "read_worker_totals",
]

# The coordinators run with the default poll, leader lease and target lifetime (no override in
# the generated config), so the failover shown is the one a default deployment gets.
_DEFAULTS = CoordinatorSettings()
POLL_INTERVAL = _DEFAULTS.poll_interval
SEARCH_RATE = 4.0  # the search pod's interactive calls per second
INGEST_LOOPS = 240  # its batch backlog at two thirds of the run
LEADER_TTL = _DEFAULTS.leader_ttl
COORDINATORS = ("coord-a", "coord-b")
STARTUP_TIMEOUT = 30.0
# Variables that would override the generated coordinator config in the children.
_CHILD_ENV_DROP = (
    "FLEETGATE_PREFIX",
    "FLEETGATE_POLL_INTERVAL",
    "FLEETGATE_METRICS_LISTEN",
    "FLEETGATE_ADAPTIVE",
    "KG_ADAPTIVE_CONCURRENCY",
    "MODEL_MAX_CONCURRENCY",
)


class DemoError(RuntimeError):
    """Setup failed (a process did not start, Redis is missing, ...); the message says why."""


@dataclass(frozen=True)
class DemoGate:
    """One gate, the simulator behind it and the load each worker puts on it."""

    name: str
    kind: Kind
    model: str
    capacity: int  # the simulator's max_num_seqs / concurrency
    floor: int
    service_ms: float
    users: int  # per worker
    calls: int  # calls per request
    fan: int  # of which at most this many at once


GATES = (
    DemoGate(
        name="llama-3.1-8b", kind="chat", model="meta-llama/Llama-3.1-8B-Instruct",
        capacity=48, floor=4, service_ms=1500.0, users=24, calls=1, fan=1,
    ),
    DemoGate(
        name="bge-m3", kind="embed", model="BAAI/bge-m3",
        capacity=96, floor=4, service_ms=1000.0, users=16, calls=8, fan=4,
    ),
    DemoGate(
        name="rerank/nemoretriever-500m-v2", kind="rerank",
        model="nvidia/llama-3.2-nemoretriever-500m-rerank-v2",
        capacity=32, floor=32, service_ms=500.0, users=6, calls=8, fan=4,
    ),
)  # fmt: skip


def _pdeathsig() -> Callable[[], None] | None:
    """On Linux, a pre-exec hook asking the kernel to SIGTERM the child if the demo dies."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1

    def hook() -> None:
        prctl(pr_set_pdeathsig, int(signal.SIGTERM))

    return hook


class Children:
    """Every process the demo started, by name, in stop order groups."""

    GROUPS = ("worker", "coordinator", "sim")

    def __init__(self, log_dir: Path) -> None:
        """Logs of the children go to ``log_dir/<name>.log``."""
        self.log_dir = log_dir
        self.procs: dict[str, tuple[str, subprocess.Popen[bytes]]] = {}
        self.redis: RedisProcess | None = None
        self.on_close: list[Callable[[], None]] = []
        self.env: dict[str, str] = dict(os.environ)
        self._hook = _pdeathsig()

    def spawn(
        self, name: str, group: str, argv: list[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` in its own process group (Ctrl-C reaches only the demo), with
        ``env`` added to :attr:`env`."""
        with open(self.log_dir / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**self.env, **(env or {})},
                start_new_session=True,
                preexec_fn=self._hook,
            )
        self.procs[name] = (group, proc)
        return proc

    def start_redis(self) -> RedisProcess:
        """A private redis-server, with SIGINT blocked so a terminal Ctrl-C cannot kill it
        before the workers have left (the mask is inherited; SIGTERM still stops it)."""
        server = RedisProcess(die_with_parent=True)
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            self.redis = server
            server.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        return server

    def log_tail(self, name: str, chars: int = 1500) -> str:
        """The end of a child's log, for error messages."""
        path = self.log_dir / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return text[-chars:].strip() or "(empty log)"

    def check_alive(self, name: str) -> None:
        """Raise :class:`DemoError` with the log tail if ``name`` has exited."""
        proc = self.procs[name][1]
        if proc.poll() is not None:
            raise DemoError(f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}")

    def kill(self, name: str) -> int:
        """SIGKILL ``name``'s process group; return its pid."""
        proc = self.procs[name][1]
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return proc.pid

    def pids(self, include_stopped: bool = True) -> dict[str, int]:
        """Name → pid of every child (and Redis, when it is ours)."""
        out = {n: p.pid for n, (_, p) in self.procs.items() if include_stopped or p.poll() is None}
        if self.redis is not None and self.redis.proc is not None:
            out["redis"] = self.redis.proc.pid
        return out

    def stop_all(self) -> None:
        """Stop the groups in order (workers release their permits first), then Redis."""
        for group, grace in zip(self.GROUPS, (10.0, 8.0, 5.0), strict=True):
            members = [p for g, p in self.procs.values() if g == group]
            for p in members:
                if p.poll() is None:
                    _signal_group(p.pid, signal.SIGTERM)
            deadline = time.monotonic() + grace
            for p in members:
                try:
                    p.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    _signal_group(p.pid, signal.SIGKILL)
                    p.wait(5)
                _signal_group(p.pid, signal.SIGKILL)  # any grandchild left in the group
        for hook in self.on_close:
            try:
                hook()
            except Exception as exc:  # cleanup must go on
                print(f"cleanup: {exc}", file=sys.stderr)
        if self.redis is not None:
            self.redis.close()

    def survivors(self) -> list[str]:
        """Names of children that are still running (should be none after :meth:`stop_all`)."""
        alive = [n for n, (_, p) in self.procs.items() if p.poll() is None]
        if self.redis is not None and self.redis.proc is not None:
            alive.append("redis")
        return alive


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass
class Setup:
    """What :func:`prepare` started."""

    redis_url: str
    redis_label: str
    prefix: str
    urls: dict[str, str]  # gate name → simulator base URL
    gates: list[dict[str, Any]] = field(default_factory=list)
    stats_paths: list[Path] = field(default_factory=list)
    #: the search pod's stats file (fleetgate.demo.interactive), None before it starts
    interactive_path: Path | None = None
    #: the non-Python caller's record (one HTTP status per line), None when curl is missing
    gateway_path: Path | None = None


def read_worker_totals(paths: list[Path]) -> dict[str, Any]:
    """Sum whatever the workers have written so far."""
    stats = []
    for p in paths:
        try:
            stats.append(msgspec.json.decode(p.read_bytes()))
        except (OSError, msgspec.DecodeError):
            continue
    return worker_totals(stats)


def _wait(what: str, check: Callable[[], bool], alive: Callable[[], None], timeout: float) -> None:
    """Poll ``check`` until true; ``alive`` raises if the process behind it died."""
    end = time.monotonic() + timeout
    while not check():
        alive()
        if time.monotonic() > end:
            raise DemoError(f"{what} not ready after {timeout:.0f} s")
        time.sleep(0.05)


def _wait_leader(url: str, prefix: str, cid: str, alive: Callable[[], None]) -> None:
    fk, names = fleet_keys(prefix), {g.name for g in GATES}
    with redis.Redis.from_url(url, decode_responses=True) as r:

        def leading() -> bool:
            registered = {str(n) for n in r.smembers(fk.gates)}
            return r.get(fk.leader) == cid and registered >= names

        _wait(f"{cid} leadership", leading, alive, STARTUP_TIMEOUT)


def _sim_argv(gate: DemoGate, port: int) -> list[str]:
    """The command line of the simulator behind ``gate`` on ``port``."""
    if gate.kind == "rerank":
        opts = ["fleetgate.tools.sim.rerank", "--concurrency", str(gate.capacity)]
        opts += ["--base-ms", str(gate.service_ms), "--model", gate.model]
    else:
        opts = ["fleetgate.tools.sim.vllm", "--capacity", str(gate.capacity)]
        opts += ["--model", gate.model, "--service-ms", str(gate.service_ms)]
        opts += ["--service-dist", "lognormal"]
    return [sys.executable, "-m", *opts, "--port", str(port), "--log-level", "warning"]


def _start_sim(children: Children, gate: DemoGate, say: Callable[[str], None]) -> str:
    name = f"sim-{gate.kind}"
    for _attempt in range(3):  # a free port can be taken between the probe and the bind
        port = free_port()
        children.spawn(name, "sim", _sim_argv(gate, port))
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(timeout=1.0) as http:

            def healthy(url: str = url, http: httpx.Client = http) -> bool:
                try:
                    return http.get(f"{url}/health").status_code == 200
                except httpx.TransportError:
                    return False

            try:
                _wait(name, healthy, lambda: children.check_alive(name), STARTUP_TIMEOUT)
            except DemoError as exc:
                if "address already in use" in str(exc).lower():
                    continue
                raise
        say(f"  {name:<12} {url}  ({gate.model}, capacity {gate.capacity})")
        return url
    raise DemoError(f"{name}: no free port found")


def _config_toml(redis_url: str, prefix: str, urls: dict[str, str]) -> str:
    q = msgspec.json.encode  # a JSON string is a valid TOML basic string
    lines = [
        "# Generated by `fleetgate demo`. Run one with: fleetgate coordinator --config THIS",
        "[redis]",
        f"url = {q(redact(redis_url)).decode()}  # the children get the real URL by env",
        f"prefix = {q(prefix).decode()}",
        "",
        "[coordinator]",
        "# poll_interval, leader_ttl and target_ttl_polls: the defaults",
        'metrics_listen = "127.0.0.1:0"',
        "scrape_timeout = 1.0",
    ]
    for g in GATES:
        lines += ["", "[[gates]]", f"name = {q(g.name).decode()}", f"floor = {g.floor}"]
        if g.kind != "rerank":
            lines += [f"base_url = {q(urls[g.name] + '/v1').decode()}", "ceiling = 256"]
        else:
            # the seed's fixed rerank cap (a gate without metrics is latency-driven by default)
            lines.append('signal = "fixed"')
        lines.append("max_queued = 1000")
    return "\n".join(lines) + "\n"


def _redis(children: Children, external: str | None, prefix: str) -> tuple[str, str]:
    """The Redis URL the demo uses and how to show it: ``external`` (whose ``prefix`` keys are
    deleted at the end) or a private redis-server."""
    if not external:
        try:
            server = children.start_redis()
        except RedisServerMissing as exc:
            raise DemoError(str(exc)) from None
        return server.url, f"private redis-server on port {server.port}"
    try:
        redis.Redis.from_url(external, socket_connect_timeout=2).ping()
    except redis.RedisError as exc:
        raise DemoError(f"FLEETGATE_REDIS_URL {redact(external)} unreachable: {exc}") from None

    def drop_keys() -> None:
        with redis.Redis.from_url(external) as r:
            for key in r.scan_iter(match=f"{prefix}:*", count=500):
                r.unlink(key)

    children.on_close.append(drop_keys)
    return external, f"{redact(external)} (prefix {prefix})"


def _start_coordinators(
    children: Children, config: Path, url: str, prefix: str, say: Callable[[str], None]
) -> None:
    """Start the coordinators; the first one is waited for until it leads and has registered
    the gates, so it is the leader and the others stand by."""
    leader = COORDINATORS[0]
    for cid in COORDINATORS:
        argv = [sys.executable, "-m", "fleetgate.cli", "coordinator", "--config", str(config)]
        children.spawn(cid, "coordinator", [*argv, "--id", cid])
        if cid == leader:
            _wait_leader(url, prefix, cid, lambda: children.check_alive(leader))
        say(f"  {cid:<12} {'leader' if cid == leader else 'standby'}  (config {config})")


def _start_workers(
    children: Children, setup: Setup, out: Path, workers: int, say: Callable[[str], None]
) -> None:
    """Start ``workers`` load generators (:mod:`fleetgate.tools.load`), each putting every
    gate's load on its simulator, and wait until their stats files show the load runs."""
    (out / "workers").mkdir(exist_ok=True)
    loads = [
        GateLoad(
            name=g.name,
            kind=g.kind,
            url=setup.urls[g.name],
            model=g.model,
            floor=g.floor,
            users=g.users,
            calls=g.calls,
            fan=g.fan,
        )
        for g in GATES
    ]
    for w in range(1, workers + 1):
        stats = out / "workers" / f"worker-{w}.json"
        stats.unlink(missing_ok=True)
        spec = LoadSpec(
            redis_url=setup.redis_url,
            prefix=setup.prefix,
            gates=loads,
            pod_id=f"worker-{w}",
            stats_path=str(stats),
            parent_pid=os.getpid(),
        )
        # The spec (with the Redis URL) goes by environment: ps shows only the label.
        argv = [sys.executable, "-m", "fleetgate.tools.load", "--spec-from-env", f"worker-{w}"]
        env = {SPEC_ENV: msgspec.json.encode(spec).decode()}
        children.spawn(f"worker-{w}", "worker", argv, env)
        setup.stats_paths.append(stats)

    def workers_alive() -> None:
        for w in range(1, workers + 1):
            children.check_alive(f"worker-{w}")

    # A worker writes its stats file once its users run: the load starts now.
    _wait("workers", lambda: all(p.exists() for p in setup.stats_paths), workers_alive, 60.0)
    demand = ", ".join(f"{g.name} {workers * g.users * g.fan}" for g in GATES)
    say(f"  {workers} workers, concurrent demand: {demand}")


def prepare(
    args: argparse.Namespace,
    out: Path,
    children: Children,
    external: str | None,
    prefix: str,
    say: Callable[[str], None],
) -> Setup:
    """Start Redis, simulators, coordinators and workers; return where everything is."""
    url, label = _redis(children, external, prefix)
    say(f"fleetgate demo: redis {label}; output in {out}/")
    children.env = {k: v for k, v in os.environ.items() if k not in _CHILD_ENV_DROP}
    children.env.update(FLEETGATE_REDIS_URL=url, PYTHONUNBUFFERED="1")
    urls = {g.name: _start_sim(children, g, say) for g in GATES}
    config = out / "coordinator.toml"
    config.write_text(_config_toml(url, prefix, urls))
    _start_coordinators(children, config, url, prefix, say)
    setup = Setup(redis_url=url, redis_label=label, prefix=prefix, urls=urls)
    setup.gates = [
        dict(
            name=g.name,
            kind=g.kind,
            floor=g.floor,
            adaptive=g.kind != "rerank",
            capacity=g.capacity,
            url=urls[g.name],
        )
        for g in GATES
    ]
    _start_workers(children, setup, out, args.workers, say)
    _start_search_pod(children, setup, out, args.duration, say)
    _start_gateway(children, setup, out, say)
    return setup


# A shell client: curl in a loop, one status code per line (no Python, no fleetgate library).
_CURL_LOOP = (
    'while :; do curl -s -o /dev/null -w "%{http_code}\\n" --max-time 30 '
    '-H "Content-Type: application/json" -H "X-Fleetgate-Deadline-Ms: 20000" '
    '--data-binary "$BODY" "$URL/v1/ranking" >> "$OUT"; sleep 0.2; done'
)


def _start_gateway(children: Children, setup: Setup, out: Path, say: Callable[[str], None]) -> None:
    """Start ``fleetgate proxy`` in front of the reranker, on the workers' rerank gate, and a
    non-Python caller through it (curl in a shell loop); skipped when curl is missing."""
    curl = shutil.which("curl")
    if curl is None:
        say("  gateway      skipped: curl is not installed")
        return
    gate = next(g for g in GATES if g.kind == "rerank")
    argv = [sys.executable, "-m", "fleetgate.cli", "proxy", "--upstream", setup.urls[gate.name]]
    argv += ["--gate", gate.name, "--prefix", setup.prefix, "--listen", "127.0.0.1:0"]
    # the Redis URL reaches it as FLEETGATE_REDIS_URL (children.env): never on a command line
    children.spawn("proxy-1", "coordinator", argv)
    log = children.log_dir / "proxy-1.log"
    found: list[str] = []

    def listening() -> bool:
        text = log.read_text(errors="replace") if log.exists() else ""
        found[:] = [ln.rsplit("listening on ", 1)[1].strip() for ln in text.splitlines()
                    if "listening on " in ln][:1]  # fmt: skip
        return bool(found)

    _wait("proxy-1", listening, lambda: children.check_alive("proxy-1"), STARTUP_TIMEOUT)
    record = out / "workers" / "curl.txt"
    record.unlink(missing_ok=True)
    passages = [{"text": f"passage {i} of the shell client"} for i in range(8)]
    body = {"model": gate.model, "query": {"text": "gateway"}, "passages": passages}
    env = {"BODY": msgspec.json.encode(body).decode(), "URL": found[0], "OUT": str(record)}
    children.spawn("curl-1", "worker", ["/bin/sh", "-c", _CURL_LOOP], env)
    setup.gateway_path = record
    say(f"  proxy-1      {found[0]} -> {setup.urls[gate.name]} (gate {gate.name})")
    say("  curl-1       a shell loop of curl calls through proxy-1, beside the Python workers")


def read_gateway_totals(path: Path | None) -> dict[str, Any]:
    """The shell client's record: requests and HTTP status codes."""
    if path is None or not path.exists():
        return {}
    codes: dict[str, int] = {}
    for line in path.read_text(errors="replace").split():
        codes[line] = codes.get(line, 0) + 1
    return {"requests": sum(codes.values()), "ok": codes.get("200", 0), "codes": codes}


def _start_search_pod(
    children: Children, setup: Setup, out: Path, duration: float, say: Callable[[str], None]
) -> None:
    """Start the search pod (:mod:`fleetgate.demo.interactive`) on the rerank gate: interactive
    calls at priority 10 beside a batch backlog growing to ``INGEST_LOOPS`` loops by two thirds
    of the run; wait until its stats file shows it runs."""
    gate = next(g for g in GATES if g.kind == "rerank")
    stats = out / "workers" / "search.json"
    stats.unlink(missing_ok=True)
    spec = InteractiveSpec(
        redis_url=setup.redis_url,
        prefix=setup.prefix,
        gate=gate.name,
        url=setup.urls[gate.name],
        model=gate.model,
        rate=SEARCH_RATE,
        ramp=INGEST_LOOPS / max(1.0, duration * 2 / 3),
        max_loops=INGEST_LOOPS,
        stats_path=str(stats),
        parent_pid=os.getpid(),
    )
    argv = [sys.executable, "-m", "fleetgate.demo.interactive", "--spec-from-env", "search-1"]
    env = {INTERACTIVE_ENV: msgspec.json.encode(spec).decode()}
    children.spawn("search-1", "worker", argv, env)
    setup.interactive_path = stats
    _wait("search pod", stats.exists, lambda: children.check_alive("search-1"), 60.0)
    say(
        f"  search-1     {SEARCH_RATE:g} interactive calls/s at priority 10 on {gate.name}, "
        f"beside a batch backlog growing to {INGEST_LOOPS} loops (priority 0)"
    )
