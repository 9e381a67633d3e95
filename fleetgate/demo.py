"""``fleetgate demo``: a whole fleet on one machine, for about a minute.

``python -m fleetgate.demo [--duration 60] [--out DIR] [--quiet]`` starts, as child processes:

* a private ``redis-server`` on a free port (or uses ``$FLEETGATE_REDIS_URL`` under a fresh,
  unique key prefix, deleting only that prefix's keys at the end);
* two vLLM simulators (a chat model with capacity 48, an embedder with capacity 96) and a
  reranker simulator (concurrency 32);
* two coordinators (``coord-a`` leads, ``coord-b`` stands by) from a generated TOML config:
  two adaptive gates (floor 4) on the vLLM simulators' ``/metrics``, one fixed rerank gate (32);
* three worker pods that push more load through the gates than the servers hold.

It then shows a live view every second (leader, epoch, per gate limit/target/in-flight/queue/
saturation/reason and the servers' running/waiting), SIGKILLs the leader halfway so the failover
is visible, halves the chat server's capacity at two thirds so the target follows it down, and
writes ``demo.png`` and ``demo.json`` to the output directory (default ``demo-out/``).

Every child runs in its own process group and is stopped in order (workers, coordinators,
simulators, Redis): SIGTERM, a bounded wait, SIGKILL for stragglers — at the end, on Ctrl-C or
SIGTERM, and when the demo itself fails. On Linux the children also get SIGTERM if the demo dies.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import msgspec

from fleetgate._demo_report import (
    DemoRecord,
    Event,
    Failover,
    GateInfo,
    GateSample,
    Sample,
    format_summary,
    plot,
    progress_line,
    render_view,
    summarize,
)
from fleetgate._demo_run import (
    LEADER_TTL,
    POLL_INTERVAL,
    Children,
    DemoError,
    Setup,
    prepare,
    read_worker_totals,
)
from fleetgate._redis import REDIS_ERRORS, connect
from fleetgate.keys import GateKeys, fleet_keys
from fleetgate.status import gather_status

__all__ = ["LiveRun", "build_parser", "main"]

PROGRESS_EVERY = 5  # seconds between plain progress lines when stdout is not a terminal


class LiveRun:
    """The live phase: sample every second, kill the leader halfway, halve a server at 2/3."""

    def __init__(
        self,
        args: argparse.Namespace,
        rec: DemoRecord,
        children: Children,
        setup: Setup,
        *,
        tty: bool,
    ) -> None:
        """Nothing starts until :meth:`run`."""
        self.args, self.rec, self.children, self.setup = args, rec, children, setup
        self.tty, self.quiet = tty, bool(args.quiet)
        self.keys = fleet_keys(setup.prefix)
        self.interrupted = False
        self.t0 = time.monotonic()
        self.capacity_changed = False
        self._stop = asyncio.Event()
        self._watcher: asyncio.Task[None] | None = None
        self._redis: Any = None
        self._http: httpx.AsyncClient | None = None

    def now(self) -> float:
        """Seconds since the load started."""
        return time.monotonic() - self.t0

    def _on_signal(self) -> None:
        self.interrupted = True
        self._stop.set()

    def event(self, kind: str, text: str) -> None:
        """Record an event; print it at once unless the live view shows it."""
        e = Event(t=round(self.now(), 2), kind=kind, text=text)
        self.rec.events.append(e)
        if not self.tty and not self.quiet:
            print(f"[{e.t:5.1f}s] {text}", flush=True)

    async def run(self) -> None:
        """Sample until the duration is over (and a started failover has completed)."""
        loop = asyncio.get_running_loop()
        # An ignored SIGINT (a background job of a non-interactive shell) stays ignored.
        previous = {
            sig: handler
            for sig in (signal.SIGINT, signal.SIGTERM)
            if (handler := signal.getsignal(sig)) is not signal.SIG_IGN
        }
        for sig in previous:
            loop.add_signal_handler(sig, self._on_signal)
        self._redis = connect(self.setup.redis_url)
        self._http = httpx.AsyncClient(timeout=1.0)
        duration = self.args.duration
        if self.tty and not self.quiet:
            sys.stdout.write("\x1b[2J")
        self.t0 = time.monotonic()
        self.event("start", f"{self.args.workers} workers started; targets start at the floors")
        try:
            tick = 0
            while True:
                t = self.now()
                if self.rec.failover is None and t >= duration / 2:
                    await self._kill_leader()
                if not self.capacity_changed and t >= duration * 2 / 3:
                    await self._halve_capacity()
                sample = await self._sample(t)
                self.rec.samples.append(sample)
                self._show(sample, tick)
                if t >= duration and self._failover_settled(t):
                    break
                tick += 1
                stopped = asyncio.ensure_future(self._stop.wait())
                await asyncio.wait({stopped}, timeout=max(0.0, tick - self.now()))
                stopped.cancel()
                if self._stop.is_set():
                    self.event("interrupt", "interrupted: stopping")
                    break
        finally:
            if self._watcher is not None:
                self._watcher.cancel()
                await asyncio.gather(self._watcher, return_exceptions=True)
            await self._http.aclose()
            await self._redis.aclose()
            for sig, handler in previous.items():
                loop.remove_signal_handler(sig)  # resets to the default: restore ours
                signal.signal(sig, handler)

    def _failover_settled(self, t: float) -> bool:
        fo = self.rec.failover
        if fo is None or fo.published_after is not None:
            return True
        return t > fo.kill_t + 3 * LEADER_TTL + 2 * POLL_INTERVAL  # give up waiting

    def _show(self, sample: Sample, tick: int) -> None:
        if self.quiet:
            return
        if self.tty:
            width = shutil.get_terminal_size((100, 30)).columns
            sys.stdout.write("\x1b[H\x1b[J" + render_view(self.rec, sample, width) + "\n")
            sys.stdout.flush()
        elif tick % PROGRESS_EVERY == 0:
            print(progress_line(sample), flush=True)

    async def _server_stats(self, url: str) -> dict[str, Any] | None:
        assert self._http is not None
        try:
            resp = await self._http.get(f"{url}/admin/stats")
            return dict(resp.json()) if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    async def _sample(self, t: float) -> Sample:
        try:
            status = await gather_status(self._redis, self.setup.prefix)
        except REDIS_ERRORS:
            status = None
        stats = await asyncio.gather(*(self._server_stats(g.url) for g in self.rec.gates))
        workers = read_worker_totals(self.setup.stats_paths)
        self.rec.workers = workers
        rows = {g.name: g for g in status.gates} if status is not None else {}
        gates: dict[str, GateSample] = {}
        for info, srv in zip(self.rec.gates, stats, strict=True):
            if srv is not None:
                self.rec.servers[info.name] = srv
            row = rows.get(info.name)
            if row is None:
                continue
            gates[info.name] = GateSample(
                limit=row.limit,
                target=row.target,
                in_flight=row.in_flight,
                queued=row.queued,
                saturated=row.saturated,
                reason=row.reason,
                server_running=srv.get("running") if srv else None,
                server_waiting=srv.get("waiting") if srv else None,
                server_capacity=srv.get("capacity") if srv else None,
            )
        return Sample(
            t=round(t, 2),
            leader=status.leader if status else None,
            epoch=status.epoch if status else None,
            gates=gates,
            requests_ok=workers["requests_ok"],
            errors=workers["errors"],
        )

    async def _kill_leader(self) -> None:
        try:
            leader = await self._redis.get(self.keys.leader)
            epoch = int(await self._redis.get(self.keys.epoch) or 0)
        except REDIS_ERRORS:
            return  # try again next second
        if leader not in self.children.procs:
            return
        pid = self.children.kill(leader)
        t = self.now()
        self.rec.failover = Failover(
            killed=leader, killed_pid=pid, old_epoch=epoch, kill_t=round(t, 3)
        )
        self.event(
            "leader_killed",
            f"SIGKILL leader {leader} (pid {pid}, epoch {epoch}): the "
            f"standby takes over when the lease lapses (ttl {LEADER_TTL:g} s)",
        )
        self._watcher = asyncio.create_task(self._watch_failover())

    async def _watch_failover(self) -> None:
        """Poll every 20 ms for a new epoch, then for targets published under it."""
        fo = self.rec.failover
        assert fo is not None
        adaptive = [GateKeys.of(self.setup.prefix, g.name) for g in self.rec.gates if g.adaptive]
        while True:
            try:
                t = self.now()
                epoch = int(await self._redis.get(self.keys.epoch) or 0)
                if fo.new_epoch is None and epoch > fo.old_epoch:
                    fo.new_leader = await self._redis.get(self.keys.leader)
                    fo.new_epoch, fo.elected_after = epoch, round(t - fo.kill_t, 3)
                    self.event(
                        "leader_elected",
                        f"{fo.new_leader} elected with epoch {epoch}, "
                        f"{fo.elected_after:.2f} s after the kill",
                    )
                if fo.new_epoch is not None:
                    published = [await self._redis.hget(k.target, "epoch") for k in adaptive]
                    if any(int(p or 0) >= fo.new_epoch for p in published):
                        fo.published_after = round(t - fo.kill_t, 3)
                        self.event(
                            "targets_published",
                            f"targets published under epoch "
                            f"{fo.new_epoch}: failover took {fo.published_after:.2f} s",
                        )
                        return
            except REDIS_ERRORS:
                pass
            await asyncio.sleep(0.02)

    async def _halve_capacity(self) -> None:
        self.capacity_changed = True
        info = next(g for g in self.rec.gates if g.adaptive)
        new = max(1, info.capacity // 2)
        assert self._http is not None
        try:
            resp = await self._http.post(f"{info.url}/admin/capacity", json={"capacity": new})
            resp.raise_for_status()
        except httpx.HTTPError as exc:
            self.event("capacity_failed", f"could not change {info.name}'s capacity: {exc}")
            return
        self.event(
            "capacity",
            f"{info.name} server capacity {info.capacity} -> {new} (replica lost): "
            "the target follows",
        )


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The demo's argument parser."""
    p = argparse.ArgumentParser(
        prog="fleetgate demo",
        description="Run a local fleet (Redis, vLLM and reranker simulators, a leader and a "
        "standby coordinator, worker pods) for about a minute: watch the targets ramp, the "
        "leader fail over and the limits follow the servers. Writes demo.png and demo.json.",
    )
    p.add_argument(
        "--duration",
        type=_positive,
        default=60.0,
        metavar="SECONDS",
        help="seconds of load; the leader is killed halfway (default: %(default)s)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("demo-out"),
        metavar="DIR",
        help="where demo.png, demo.json, the config and the logs go (default: %(default)s)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=3,
        choices=range(1, 9),
        metavar="N",
        help="worker processes (1-8, default: %(default)s)",
    )
    p.add_argument("--quiet", action="store_true", help="print only the summary")
    return p


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _ignore_signals() -> None:
    """From here on a second Ctrl-C must not cut the cleanup short (it would leave orphans)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


def _say(quiet: bool, text: str) -> None:
    if not quiet:
        print(text, flush=True)


def _finish(rec: DemoRecord, out: Path, quiet: bool) -> None:
    """Write demo.json and demo.png and print the summary (whatever was recorded)."""
    rec.summary = summarize(rec)
    (out / "demo.json").write_bytes(msgspec.json.format(msgspec.json.encode(rec), indent=2))
    if rec.samples:
        try:
            plot(rec, out / "demo.png")
        except ImportError:
            print("demo.png skipped: matplotlib is missing (pip install 'fleetgate[bench]')")
    print(format_summary(rec, out), flush=True)


def run(args: argparse.Namespace) -> int:
    """Set up the fleet, run the live phase, tear everything down; return the exit code."""
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    external = os.environ.get("FLEETGATE_REDIS_URL") or None
    prefix = f"demo-{uuid.uuid4().hex[:8]}" if external else "fg"
    children = Children(out / "logs")
    rec: DemoRecord | None = None
    setup: Setup | None = None
    code = 0
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        setup = prepare(args, out, children, external, prefix, lambda s: _say(args.quiet, s))
        rec = DemoRecord(
            started_at=time.time(),
            duration=args.duration,
            redis=setup.redis_label,
            prefix=prefix,
            gates=[GateInfo(**g) for g in setup.gates],
            pids=children.pids(),
        )
        live = LiveRun(args, rec, children, setup, tty=sys.stdout.isatty())
        asyncio.run(live.run())
        rec.interrupted = live.interrupted
        code = 130 if live.interrupted else 0
    except KeyboardInterrupt:
        code = 130
        if rec is not None:
            rec.interrupted = True
        print("\ninterrupted: stopping everything", file=sys.stderr, flush=True)
    except DemoError as exc:
        code = 1
        print(f"fleetgate demo: {exc}", file=sys.stderr, flush=True)
    finally:
        _ignore_signals()
        if rec is not None:
            rec.events.append(
                Event(
                    t=rec.samples[-1].t if rec.samples else 0.0,
                    kind="stop",
                    text="stopping workers, coordinators, simulators",
                )
            )
        _say(args.quiet, "\nstopping: workers, coordinators, simulators, redis ...")
        children.stop_all()
        if rec is not None and setup is not None:
            rec.workers = read_worker_totals(setup.stats_paths)
    if rec is not None:
        _finish(rec, out, args.quiet)
    bad = children.survivors()
    if bad:
        print(f"fleetgate demo: processes still alive: {bad}", file=sys.stderr)
        code = code or 1
    return code


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m fleetgate.demo`` and ``fleetgate demo``; returns the exit code."""
    args = build_parser().parse_args(argv)
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return run(args)
    except Exception:
        # Children are already stopped (run's finally); report the bug and fail.
        import traceback

        traceback.print_exc()
        return 1
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        with contextlib.suppress(Exception):
            sys.stdout.flush()


if __name__ == "__main__":
    raise SystemExit(main())
