"""The chaos harness: worker processes, the simulator with an invariant checker, faults.

Pieces (each usable on its own; the tests and ``tests.chaos.soak`` combine them):

* :class:`Control` -- a private control Redis that the faults never touch. Worker processes
  report their state there (fallback mode, live pods, counters, events) and read commands
  (``stop``) from it, so a test can watch a fleet whose own Redis is dead or cut off.
* :class:`Sim` -- the rerank simulator served on a thread of the test process, with an exact
  timeline of the calls *running at it* (every admission and exit, with the lease id each call
  carries). This is the invariant checker's ground truth: real concurrent calls at the model
  server, independent of anything fleetgate believes.
* :class:`LimitSampler` -- reads the published limit (and holders, queue) of the gate from
  Redis with the ``inspect`` script at ~50 Hz, so the timeline can be compared with the limit in
  force over time.
* :class:`Workers` -- spawns ``python -m tests.chaos._worker`` processes, pauses (SIGSTOP),
  resumes (SIGCONT), kills (SIGKILL) and reaps them.
* ``_cluster.ReplicatedCluster`` -- a real Redis Cluster of masters with one replica each (for
  failover), plus helpers to migrate a slot by hand, in a module of its own.
* :func:`figure` -- print a measured figure and attach it to the JUnit report.

Everything listens on 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

from fleetgate.admission import tokens_of

ROOT = Path(__file__).resolve().parents[2]


def wall_offset() -> float:
    """Wall clock minus this process' monotonic clock, now. Worker processes timestamp with
    the wall clock, this process' timelines are monotonic. Read when it is used, not once at
    import: the wall clock of a test machine may be stepped during a long run (a full suite
    once saw every hand-off "noticed" 5.3 s late in three consecutive tests, an offset taken
    minutes earlier)."""
    return time.time() - time.monotonic()


__all__ = [
    "ROOT",
    "Control",
    "LimitSampler",
    "Sim",
    "WorkerProc",
    "Workers",
    "figure",
    "poll",
]


# -- small helpers ------------------------------------------------------------------------------


def owned_by(lease_id: str, pod: str) -> bool:
    """Whether ``lease_id`` belongs to the worker labelled ``pod``: ids carry the fleet's
    ``pod_key``, the label plus a per-process suffix (``<pod>-<hex>:<n>``)."""
    owner = lease_id.rsplit(":", 1)[0]
    return owner == pod or owner.startswith(pod + "-")


def figure(record_property: Callable[[str, object], None] | None, name: str, value: object) -> None:
    """Print a measured figure (visible with ``pytest -s``) and attach it to the report."""
    print(f"[chaos] {name} = {value}", flush=True)
    if record_property is not None:
        record_property(name, value)


def poll(
    predicate: Callable[[], Any], timeout: float, interval: float = 0.01, what: str = ""
) -> float:
    """Wait until ``predicate()`` is truthy; return the seconds it took (TimeoutError after)."""
    start = time.monotonic()
    while True:
        try:
            if predicate():
                return time.monotonic() - start
        except (redis.ConnectionError, redis.TimeoutError):
            pass
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"not met within {timeout:.1f}s: {what or predicate}")
        time.sleep(interval)


# -- the control channel ------------------------------------------------------------------------


class Control:
    """Reports from worker processes and commands to them, through a Redis no fault touches."""

    def __init__(self, url: str, run: str | None = None) -> None:
        self.url = url
        self.run = run or uuid.uuid4().hex[:8]
        self.r = redis.Redis.from_url(url, decode_responses=True)

    def key(self, *parts: str) -> str:
        return ":".join(("chaos", self.run, *parts))

    def stop(self) -> None:
        self.r.set(self.key("stop"), "1")

    def status(self, pod: str) -> dict[str, str]:
        return self.r.hgetall(self.key("w", pod))

    def statuses(self, pods: list[str]) -> dict[str, dict[str, str]]:
        pipe = self.r.pipeline()
        for p in pods:
            pipe.hgetall(self.key("w", p))
        return dict(zip(pods, pipe.execute(), strict=True))

    def events(self, pod: str) -> list[dict[str, Any]]:
        return [json.loads(e) for e in self.r.lrange(self.key("ev", pod), 0, -1)]

    def result(self, pod: str) -> dict[str, Any] | None:
        raw = self.r.get(self.key("result", pod))
        return json.loads(raw) if raw else None

    def close(self) -> None:
        self.r.close()


# -- the simulator and its exact timeline --------------------------------------------------------


class Sim:
    """The rerank simulator on a thread of this process, recording every call running at it.

    Its own concurrency is effectively unlimited, so a call starts running the moment it
    arrives: what runs at the simulator is exactly what the fleet let through. Each call carries
    the caller's lease id as its query text, so an over-limit instant can be attributed, and
    the tokens of the permits running calls here are counted from their ids (``tokens``).
    Service time: ``base_ms + per_passage_ms × passages``.
    """

    def __init__(self, base_ms: float = 20.0, per_passage_ms: float = 1.0) -> None:
        from fleetgate.tools.sim import rerank

        self.config = rerank.RerankSimConfig(
            concurrency=100_000,
            queue_size=100_000,
            request_timeout_ms=0,
            base_ms=base_ms,
            per_passage_ms=per_passage_ms,
        )
        self.app = rerank.build_app(self.config)
        self.sim = self.app.state.sim
        self._lock = threading.Lock()
        self.running = 0
        self.tags: Counter[str] = Counter()
        self.times: list[float] = []  # monotonic time of each change
        self.values: list[int] = []  # running after that change
        self.tokens = 0  # tokens of the permits running calls (each permit once, by its id)
        self.tvalues: list[int] = []  # tokens after each change
        self.calls = 0
        # Over a watermark: who ran (one tag per running call: a permit of weight w runs w).
        self.snapshots: list[tuple[float, int, list[str]]] = []
        self.watermark = self.token_watermark = 1 << 30
        self._cm: contextlib.AbstractContextManager[Any] | None = None
        self.url = ""
        self._wrap()

    def _wrap(self) -> None:
        orig = self.sim.rank

        async def rank(query: str, passages: list[str]) -> Any:
            self._change(+1, query)
            try:
                return await orig(query, passages)
            finally:
                self._change(-1, query)

        self.sim.rank = rank  # the route looks it up on the instance at every request

    def _change(self, delta: int, tag: str) -> None:
        with self._lock:
            self.running += delta
            if delta > 0:
                self.calls += 1
                self.tags[tag] += 1
                if self.tags[tag] == 1:
                    self.tokens += tokens_of(tag)
            else:
                self.tags[tag] -= 1
                if self.tags[tag] <= 0:
                    del self.tags[tag]
                    self.tokens -= tokens_of(tag)
            self.times.append(time.monotonic())
            self.values.append(self.running)
            self.tvalues.append(self.tokens)
            over = self.running > self.watermark or self.tokens > self.token_watermark
            if delta > 0 and over and len(self.snapshots) < 10_000:
                self.snapshots.append((self.times[-1], self.running, list(self.tags.elements())))

    def __enter__(self) -> Sim:
        from fleetgate.tools.sim import serve_in_thread

        self._cm = serve_in_thread(self.app)
        served = self._cm.__enter__()
        self.url = served.url
        return self

    def __exit__(self, *exc: object) -> None:
        if self._cm is not None:
            self._cm.__exit__(None, None, None)

    # -- reading the timeline ------------------------------------------------------------------

    def _at(self, t: float, values: list[int] | None = None) -> int:
        i = bisect.bisect_right(self.times, t) - 1
        return (self.values if values is None else values)[i] if i >= 0 else 0

    def max_between(self, t0: float, t1: float | None = None) -> int:
        """Most calls running at once at any instant in [t0, t1]."""
        with self._lock:
            t1 = time.monotonic() if t1 is None else t1
            i = bisect.bisect_left(self.times, t0)
            j = bisect.bisect_right(self.times, t1)
            return max([self._at(t0), *self.values[i:j]])

    def series(
        self, t0: float, t1: float | None = None, *, tokens: bool = False
    ) -> list[tuple[float, int]]:
        """(time, calls running) at every change in [t0, t1]; with ``tokens``, the tokens of
        the permits running calls."""
        values = self.tvalues if tokens else self.values
        with self._lock:
            t1 = time.monotonic() if t1 is None else t1
            i = bisect.bisect_left(self.times, t0)
            j = bisect.bisect_right(self.times, t1)
            return [(t0, self._at(t0, values)), *zip(self.times[i:j], values[i:j], strict=True)]

    def violations(
        self, bound: Callable[[float], float], t0: float, t1: float | None = None
    ) -> list[tuple[float, int, float]]:
        """Instants in [t0, t1] where the running calls exceeded ``bound(t)``."""
        return [(t, n, bound(t)) for t, n in self.series(t0, t1) if n > bound(t)]

    def longest_below(self, level: int, t0: float, t1: float | None = None) -> float:
        """The longest stretch in [t0, t1] with fewer than ``level`` calls running (an idle
        slot while callers wait, when demand exceeds the limit)."""
        series = self.series(t0, t1)
        end = time.monotonic() if t1 is None else t1
        longest, since = 0.0, None
        for t, n in series:
            if n < level and since is None:
                since = t
            elif n >= level and since is not None:
                longest = max(longest, t - since)
                since = None
        if since is not None:
            longest = max(longest, end - since)
        return longest

    def running_tags(self) -> list[str]:
        with self._lock:
            return list(self.tags)

    def stats(self) -> dict[str, Any]:
        """The simulator's own ``/admin/stats`` (its peak tracking, for cross-checks)."""
        return httpx.get(f"{self.url}/admin/stats", timeout=5).json()  # type: ignore[no-any-return]

    def reset_peaks(self) -> None:
        httpx.post(f"{self.url}/admin/reset-peaks", timeout=5).raise_for_status()


# -- the published limit over time ----------------------------------------------------------------


@dataclass
class Sample:
    t: float
    limit: int
    holders: int
    queued: int
    ids: list[str]
    granted: int
    #: the holders' weights, in the order of ``ids``
    weights: list[int]


class LimitSampler:
    """Samples ``inspect`` of one gate at ``hz`` on its own thread (own event loop, own client,
    straight to Redis -- never through a chaos proxy). Failed samples (Redis down) are skipped."""

    def __init__(self, url: str, prefix: str, gate: str, hz: float = 50.0, ids: int = 64) -> None:
        self.url, self.prefix, self.gate, self.period, self.n = url, prefix, gate, 1.0 / hz, ids
        self.samples: list[Sample] = []
        self.failures = 0
        self.last_error = ""  # of the last failed sample (for a test's failure message)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-sampler", daemon=True)

    def __enter__(self) -> LimitSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.run(self._loop())

    async def _loop(self) -> None:
        from fleetgate._redis import RedisMode, connect, prepare
        from fleetgate.keys import GateKeys
        from fleetgate.scripts import GateScripts

        def new_client() -> Any:
            return connect(self.url, socket_timeout=0.5, socket_connect_timeout=0.5)

        client = new_client()
        clients = [client]  # each one closed at the end (a dead node's connections too)
        await prepare(client)
        scripts = GateScripts(client)
        keys = GateKeys.of(self.prefix, self.gate)
        last_ok = time.monotonic()
        try:
            while not self._stop.is_set():
                t = time.monotonic()
                try:
                    snap = await scripts.snapshot(keys, self.n)
                except Exception as exc:
                    self.failures += 1
                    self.last_error = f"{type(exc).__name__}: {exc}"[:300]
                    if t - last_ok > 5.0:
                        # A cluster client can stay stuck on a killed master's slot map (seen
                        # in full-suite runs: no sample for 30 s after a failover): start over.
                        client = new_client()
                        clients.append(client)
                        scripts = GateScripts(client)
                        last_ok = t
                    with contextlib.suppress(Exception):
                        # as the client does after an outage (Runtime.refresh_connections): a
                        # connection that was mid-command when the node died goes back to
                        # redis-py's pool broken, and fails every command after
                        await RedisMode(client).disconnect_idle()
                        await prepare(client)
                else:
                    last_ok = t
                    self.samples.append(
                        Sample(
                            t,
                            snap.limit,
                            snap.holders,
                            snap.queued,
                            [h.id for h in snap.leases],
                            int(snap.stats.get("granted", 0) or 0),
                            [h.weight for h in snap.leases],
                        )
                    )
                await asyncio.sleep(max(0.0, self.period - (time.monotonic() - t)))
        finally:
            for c in clients:
                with contextlib.suppress(Exception):
                    await c.aclose()

    @property
    def last(self) -> Sample | None:
        return self.samples[-1] if self.samples else None

    def limit_at(self, t: float, default: int) -> int:
        """The limit sampled last at or before ``t`` (``default`` before the first sample)."""
        times = [s.t for s in self.samples]
        i = bisect.bisect_right(times, t) - 1
        return self.samples[i].limit if i >= 0 else default

    def held(
        self, pods: list[str], t0: float, t1: float, *, tokens: bool = False
    ) -> dict[str, int]:
        """Per pod, the most units (the weights of its leases; with ``tokens``, their tokens)
        it held in any sample in [t0, t1] (what a pod held when a fault struck; a window rather
        than one sample, so a grant made between the last sample and the fault is not
        missed)."""
        out = dict.fromkeys(pods, 0)
        for smp in self.samples:
            if t0 <= smp.t <= t1:
                sizes = [tokens_of(i) for i in smp.ids] if tokens else smp.weights
                held = list(zip(smp.ids, sizes, strict=True))
                for pod in pods:
                    n = sum(w for i, w in held if owned_by(i, pod))
                    out[pod] = max(out[pod], n)
        return out

    def first_seen(self) -> dict[str, float]:
        """Lease id -> first sample (monotonic) that listed it among the holders."""
        seen: dict[str, float] = {}
        for smp in self.samples:
            for i in smp.ids:
                seen.setdefault(i, smp.t)
        return seen

    def notice_latency(
        self, traces: dict[str, tuple[float, ...]], t0: float, t1: float
    ) -> list[tuple[float, str]]:
        """For each lease that appeared among Redis' holders in [t0, t1]: how long after that
        its owner's caller had it (the hand-off's wake-up latency; about 0 for a direct grant,
        negative when the caller was faster than the sampler). Sorted, largest last."""
        out = []
        offset = wall_offset()
        for lid, t in self.first_seen().items():
            tr = traces.get(lid)
            if tr is None or not t0 <= t <= t1 or tr[3]:
                continue
            out.append((tr[0] - offset - t, lid))
        return sorted(out)

    def limits(self) -> set[int]:
        return {s.limit for s in self.samples}

    def max_holders(self, t0: float, t1: float) -> int:
        return max([s.holders for s in self.samples if t0 <= s.t <= t1], default=0)


# -- worker processes -----------------------------------------------------------------------------


@dataclass
class WorkerProc:
    pod: str
    spec: dict[str, Any]
    proc: subprocess.Popen[bytes]
    log: Path
    paused: bool = False
    started: float = field(default_factory=time.monotonic)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)
        self.paused = False

    def kill(self) -> None:
        if self.alive():
            if self.paused:
                self.resume()
            self.proc.kill()
        self.proc.wait(10)

    def tail(self, n: int = 120) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


class Workers:
    """Spawns and reaps worker processes; every process is gone when the context exits."""

    def __init__(self, control: Control, logdir: Path, base: dict[str, Any]) -> None:
        self.control = control
        self.logdir = logdir
        self.base = dict(base)
        self.procs: list[WorkerProc] = []
        self._n = 0

    def spawn(self, **spec: Any) -> WorkerProc:
        self._n += 1
        full = {**self.base, **spec}
        full.setdefault("pod", f"w{self._n}-{uuid.uuid4().hex[:4]}")
        full["control"] = self.control.url
        full.setdefault("trace", str(self.logdir / "trace"))
        full["run"] = self.control.run
        log = self.logdir / f"{full['pod']}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.chaos._worker", json.dumps(full)],
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )
        w = WorkerProc(full["pod"], full, proc, log)
        self.procs.append(w)
        return w

    def alive(self) -> list[WorkerProc]:
        return [w for w in self.procs if w.alive()]

    def traces(self) -> dict[str, tuple[float, ...]]:
        """Every permit of the workers that exited cleanly: lease id -> (wall time of the
        grant, acquire s, calls s, local)."""
        out: dict[str, tuple[float, ...]] = {}
        for f in self.logdir.glob("trace.*.json"):
            for row in json.loads(f.read_text()):
                out[row[0]] = tuple(row[1:])
        return out

    def pods(self) -> list[str]:
        return [w.pod for w in self.procs]

    def wait_ready(self, procs: list[WorkerProc] | None = None, timeout: float = 30.0) -> None:
        """Until every worker reports that it runs (its fleet is started and it has begun)."""
        procs = procs if procs is not None else self.procs

        def ready() -> bool:
            for w in procs:
                if not w.alive():
                    raise RuntimeError(f"worker {w.pod} exited early:\n{w.tail()}")
            st = self.control.statuses([w.pod for w in procs])
            return all(s.get("state") in ("running", "waiting", "done") for s in st.values())

        poll(ready, timeout, 0.05, "workers ready")

    def stop_all(self, timeout: float = 20.0) -> dict[str, float]:
        """Ask every live worker to stop; return each one's exit time (s after the request).
        Raises if one does not exit within ``timeout`` (a hang), after asking it to dump its
        stacks into its log."""
        self.control.stop()
        t0 = time.monotonic()
        for w in self.procs:
            if w.paused:
                w.resume()
        took: dict[str, float] = {}
        live = [w for w in self.procs if w.alive()]
        while live:
            for w in list(live):
                if not w.alive():
                    took[w.pod] = time.monotonic() - t0
                    live.remove(w)
            if live and time.monotonic() - t0 > timeout:
                w = live[0]
                with contextlib.suppress(OSError):
                    os.kill(w.pid, signal.SIGUSR2)  # asyncio task stacks into the log
                    time.sleep(0.3)
                    os.kill(w.pid, signal.SIGUSR1)  # faulthandler: thread stacks
                time.sleep(0.5)
                raise TimeoutError(
                    f"worker {w.pod} did not exit {timeout}s after stop:\n{w.tail()}"
                )
            time.sleep(0.01)
        for w in self.procs:
            w.proc.wait(5)
        return took

    def close(self) -> None:
        for w in self.procs:
            with contextlib.suppress(Exception):
                w.kill()

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
