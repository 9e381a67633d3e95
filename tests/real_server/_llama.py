"""The real-server room's parts: a llama-server process, the coordinator's polls as a record,
and callers that load the server through a gate or around it.

The binary and the model come from ``.ci/llama_server.py`` (``make llama-server``), whose
``--paths`` says where they are; nothing here builds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis.asyncio as aredis

from fleetgate.client import DeadlineExceeded, Gate
from fleetgate.coordinator.config import Config
from fleetgate.keys import GateKeys
from fleetgate.tools.redisproc import free_port
from fleetgate.util_hash import UtilHash

ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / ".ci" / "llama_server.py"

#: the server's slots (-np) in the tests that do not change them
SLOTS = 4
#: the coordinator's poll period in these tests (a llama-server request takes ~0.2-0.5 s)
POLL = 0.5
#: tokens each call generates (ignore_eos: always this many, so every call costs the same):
#: ~0.8 s a call at 4 busy slots here. With 16 (~0.2 s) the gate's fixed cost per call (a
#: freed slot waits a Redis + HTTP round trip, and the client's CPU competes with the server's
#: on 2 cores) is a larger share: adaptive 0.83 x no gate (docs/servers.md, "A real
#: llama-server in the suite")
N_PREDICT = 64
COMPLETION = {"prompt": "fleet gate", "n_predict": N_PREDICT, "ignore_eos": True}
#: a caller's total deadline per call, queue included (a call takes ~1 s; a stall fails fast)
PERMIT_DEADLINE = 30.0
#: context per slot: the prompt and N_PREDICT tokens with room to spare
CTX_PER_SLOT = 128


def built_paths() -> dict[str, object]:
    """``{"binary", "model", "ready"}`` from the build script, which builds nothing here."""
    out = subprocess.run(
        [sys.executable, str(BUILD_SCRIPT), "--paths"], check=True, capture_output=True, text=True
    )
    paths: dict[str, object] = json.loads(out.stdout)
    return paths


class LlamaServer:
    """One ``llama-server`` on a free loopback port, restartable on the same port with another
    number of slots (``-np``); its output goes to a log file per start."""

    def __init__(self, binary: Path, model: Path, log_dir: Path) -> None:
        self.binary, self.model, self.log_dir = binary, model, log_dir
        self.port = free_port()
        self.slots = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._starts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, slots: int, timeout: float = 120.0) -> None:
        """Start with ``slots`` slots and wait for ``/health`` to answer 200."""
        assert self.proc is None, "already running"
        self._starts += 1
        log_path = self.log_dir / f"llama-server-{self._starts}-np{slots}.log"
        cmd = [
            str(self.binary), "-m", str(self.model), "--host", "127.0.0.1",
            "--port", str(self.port), "-np", str(slots), "-c", str(CTX_PER_SLOT * slots),
            # One decoding thread. With two on a 2-core machine, anything else runnable (this
            # test's own callers, Redis, another suite) preempts one of them and the other
            # spins at ggml's per-operation barrier until it is back: a 64-token call went from
            # ~2 s to 16-27 s (250-400 ms a token) with one or two busy processes beside it,
            # and past 30 s on a loaded machine: the "stall" (docs/servers.md). One thread
            # takes its share of the CPU and never waits for a descheduled peer (78-100 ms a
            # token in the same conditions, and faster than two on an idle machine here).
            # Enough HTTP threads that every caller reaches the server (deferred requests hold
            # one each), whatever the test's number of callers.
            "-t", "1", "--threads-http", "64", "--metrics", "--no-webui",
            "--cache-ram", "0",
        ]  # fmt: skip
        with log_path.open("wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        self.slots = slots
        deadline = time.monotonic() + timeout
        with httpx.Client(base_url=self.url, timeout=2.0) as http:
            while True:
                if self.proc.poll() is not None:
                    tail = log_path.read_text(errors="replace")[-3000:]
                    self.proc = None
                    raise RuntimeError(f"llama-server exited at start-up:\n{tail}")
                with contextlib.suppress(httpx.TransportError):
                    if http.get("/health").status_code == 200:
                        return
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"llama-server not healthy in {timeout} s ({log_path})")
                time.sleep(0.1)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 2 s: llama-server does not exit on SIGTERM while calls
        are in flight (20 s and counting with 8 of them), and until it does those calls hang
        and the port stays taken. A restart in the tests is an operator's, not a drain."""
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(2)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None

    def restart(self, slots: int) -> None:
        self.stop()
        self.start(slots)


def coordinator_config(redis_url: str, prefix: str, gates: str) -> Config:
    """A coordinator polling every POLL s (no jitter) with the ``[[gates]]`` tables ``gates``."""
    return Config.from_toml_text(
        f"""
[redis]
url = "{redis_url}"
prefix = "{prefix}"
[coordinator]
poll_interval = {POLL}
poll_jitter = 0.0
leader_ttl = 2.0
metrics_listen = "127.0.0.1:0"
scrape_timeout = 0.4
{gates}""",
        env={},
    )


def llama_gate(name: str, server_url: str, *, floor: int = 1, ceiling: int = 32) -> str:
    """An adaptive gate on the llama-server at ``server_url``, its kind left to detection."""
    return f"""
[[gates]]
name = "{name}"
base_url = "{server_url}/v1"
server = "auto"
floor = {floor}
ceiling = {ceiling}
max_queued = 1000
"""


@dataclass
class PollRecord:
    """Every poll of one gate, as the coordinator's snapshot (``fg:{G}:util``) showed it."""

    redis: aredis.Redis
    keys: GateKeys
    polls: list[UtilHash] = field(default_factory=list)

    async def watch(self) -> None:
        """Append the snapshot each time its ``last_poll`` changes (read every 20 ms, well
        under the poll period), until cancelled."""
        last: float | None = None
        while True:
            snap = UtilHash.decode(await self.redis.hgetall(self.keys.util))
            if snap.last_poll is not None and snap.last_poll != last:
                last = snap.last_poll
                self.polls.append(snap)
            await asyncio.sleep(0.02)

    async def until(self, count: int, timeout: float) -> list[UtilHash]:
        """Wait until ``count`` polls are recorded; the record (fails after ``timeout``)."""
        end = time.monotonic() + timeout
        while len(self.polls) < count:
            assert time.monotonic() < end, f"only {len(self.polls)} of {count} polls: {self}"
            await asyncio.sleep(0.05)
        return self.polls

    def targets(self, start: int = 0) -> list[int | None]:
        return [p.current_target for p in self.polls[start:]]

    def __str__(self) -> str:
        return " | ".join(
            f"{p.current_target} {p.reason} run={p.running} wait={p.waiting_capacity} "
            f"held={p.in_flight}"
            for p in self.polls
        )


@contextlib.asynccontextmanager
async def recording(redis: aredis.Redis, keys: GateKeys) -> AsyncIterator[PollRecord]:
    record = PollRecord(redis, keys)
    task = asyncio.create_task(record.watch())
    try:
        yield record
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def first_in(targets: list[int | None], low: float, high: float) -> int | None:
    """1-based number of the first target within [low, high], None if none is."""
    for i, target in enumerate(targets, 1):
        if target is not None and low <= target <= high:
            return i
    return None


@dataclass
class Callers:
    """``count`` closed-loop callers, each making one completion call after another, inside a
    permit of ``gate`` or (``gate`` None) straight to the server. ``done`` holds the monotonic
    time of every call that completed with 200. Any other answer, or no answer, fails the test;
    with ``tolerate`` (a server restarted on purpose) it is kept in ``errors`` and the caller
    tries again 50 ms later -- as is a permit's deadline run out (callers queued behind the
    calls the restart cut off)."""

    http: httpx.AsyncClient
    count: int
    gate: Gate | None = None
    tolerate: bool = False
    done: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    async def _call(self) -> None:
        try:
            resp = await self.http.post("/completion", json=COMPLETION)
            assert resp.status_code == 200, (resp.status_code, resp.text[:300])
        except (httpx.TransportError, AssertionError) as exc:
            if not self.tolerate:
                raise
            self.errors.append(repr(exc))
            await asyncio.sleep(0.05)
            return
        self.done.append(time.monotonic())

    async def _loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            if self.gate is None:
                await self._call()
                continue
            try:
                async with self.gate.permit(deadline=PERMIT_DEADLINE):
                    await self._call()
            except DeadlineExceeded as exc:
                if not self.tolerate:
                    raise
                self.errors.append(repr(exc))

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Callers]:
        """The callers run for the block; leaving it lets each finish its call in progress
        (PERMIT_DEADLINE at most: a stalled gate or server fails the test, never hangs it)."""
        stop = asyncio.Event()
        tasks = [asyncio.create_task(self._loop(stop)) for _ in range(self.count)]
        try:
            yield self
        finally:
            stop.set()
            done, pending = await asyncio.wait(tasks, timeout=PERMIT_DEADLINE + 5)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            assert not pending, f"{len(pending)} callers still in a call after {PERMIT_DEADLINE} s"
            for task in done:
                task.result()  # a caller's failure fails the test

    def rate(self, start: float, end: float) -> float:
        """Calls completed per second in [start, end] (monotonic)."""
        return sum(start <= t <= end for t in self.done) / (end - start)


def median(values: list[float]) -> float:
    return statistics.median(values)
