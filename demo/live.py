"""The live phase of ``fleetgate demo``: sample every second, fail the leader over, halve a server.

:class:`LiveRun` reads the fleet's status from Redis and the simulators' ``/admin/stats`` once a
second into the :class:`~fleetgate.demo.report.DemoRecord`, shows it (the live view on a
terminal, a progress line otherwise), SIGKILLs the leader halfway and times the failover, and
halves the chat server's capacity at two thirds.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import signal
import sys
import time
from typing import Any

import httpx
import msgspec

from fleetgate._redis import REDIS_ERRORS, connect
from fleetgate.demo.children import Children
from fleetgate.demo.plan import LEADER_TTL, POLL_INTERVAL, Setup
from fleetgate.demo.pods import read_worker_totals
from fleetgate.demo.report import (
    DemoRecord,
    Event,
    Failover,
    GateSample,
    Sample,
    progress_line,
    render_view,
)
from fleetgate.demo.search_contract import InteractiveStats
from fleetgate.keys import GateKeys, fleet_keys
from fleetgate.status import gather_status

__all__ = ["PROGRESS_EVERY", "LiveRun"]

PROGRESS_EVERY = 5  # seconds between plain progress lines when stdout is not a terminal


def _server_kv(srv: dict[str, Any] | None) -> dict[str, int | None]:
    """The KV cache a simulator states in ``/admin/stats`` (blocks x block size, as its
    ``vllm:cache_config_info``), what it uses and its preemptions; None each without one."""
    if not srv or "kv_blocks" not in srv:
        return {}
    block = int(srv["block_size"])
    return {
        "server_kv_tokens": int(srv["kv_blocks"]) * block,
        "server_kv_used": int(srv["kv_blocks_used"]) * block,
        "server_preemptions": int(srv["preemptions"]),
    }


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

    def event(self, kind: str, text: str, gate: str | None = None) -> None:
        """Record an event; print it at once unless the live view shows it."""
        e = Event(t=round(self.now(), 2), kind=kind, text=text, gate=gate)
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
            self._interactive_record()
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
                token_limit=row.token_limit,
                tokens_held=row.tokens if row.token_limit is not None else None,
                token_reason=row.token_reason,
                token_use_ratio=row.token_use_ratio,
                **_server_kv(srv),
            )
        sample = Sample(
            t=round(t, 2),
            leader=status.leader if status else None,
            epoch=status.epoch if status else None,
            gates=gates,
            requests_ok=workers["requests_ok"],
            errors=workers["errors"],
        )
        search = self._interactive()
        if search is not None:
            recent = [w for at, w in search.waits if at - self.t0 >= t - 1.0]
            if recent:
                recent.sort()
                sample.search_wait_p50_ms = recent[len(recent) // 2]
                sample.search_wait_max_ms = recent[-1]
            sample.ingest_loops = search.ingest_loops
        return sample

    def _interactive(self) -> InteractiveStats | None:
        """The search pod's stats file, or None (not started, or being replaced)."""
        path = self.setup.interactive_path
        if path is None:
            return None
        try:
            return msgspec.json.decode(path.read_bytes(), type=InteractiveStats)
        except (OSError, msgspec.DecodeError):
            return None

    def _interactive_record(self) -> None:
        """Every search call's wait into the record, on the demo's clock."""
        search = self._interactive()
        if search is None:
            return
        gate = next((g.name for g in self.rec.gates if g.kind == "rerank"), "")
        self.rec.interactive = {
            "gate": gate,
            "priority": 10,
            "waits": [[round(at - self.t0, 3), w] for at, w in search.waits],
            "ingest_loops": search.ingest_loops,
            "search_ok": search.search_ok,
            "search_errors": search.search_errors,
            "ingest_ok": search.ingest_ok,
            "ingest_errors": search.ingest_errors,
        }

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
            text = f"could not change {info.name}'s capacity: {exc}"
            self.event("capacity_failed", text, gate=info.name)
            return
        self.event(
            "capacity",
            f"{info.name} server capacity {info.capacity} -> {new} (replica lost): "
            "the target follows",
            gate=info.name,
        )
