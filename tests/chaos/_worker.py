"""A chaos worker process: ``python -m tests.chaos._worker '<json spec>'``.

It runs one :class:`fleetgate.client.Fleet` against the Redis under test and calls the rerank
simulator inside permits of one gate, reporting to the control Redis (``spec["control"]``),
which faults never touch:

* ``chaos:<run>:w:<pod>`` (hash, refreshed every 50 ms): state, fallback, live_pods, limit,
  in_permit, counters (ok, err:<Type>, fleet_grants, local_grants, lost, ...), max_attempt_s;
* ``chaos:<run>:ev:<pod>`` (list of JSON): timestamped events (fallback on/off, victim steps);
* ``chaos:<run>:result:<pod>`` (JSON): the final summary, written before a clean exit.

It stops when ``chaos:<run>:stop`` exists (or after ``spec["duration"]`` seconds): loops
finish the permit they hold, then the fleet closes. Roles:

* ``load``: ``loops`` concurrent callers, each ``permit()`` covering ``calls_per_permit``
  simulator calls of ``passages`` passages (skipping the rest once ``lease.lost`` is set);
* ``victim``: one permit around one long call, then waits for ``lease.lost`` (the SIGSTOP test);
* ``cancel``: the cancellation storm (``_worker_cancel.cancel_storm``);
* ``cancel_ends``: cancellations that must each end their task (``_worker_cancel.cancel_ends``).

Every call carries the lease id as the query text, so the simulator can attribute it.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import json
import logging
import random
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aredis
from prometheus_client import CollectorRegistry

from fleetgate.client import Fleet, Gate, Lease, LeaseLost

from ._worker_cancel import cancel_ends, cancel_storm

log = logging.getLogger("chaos.worker")


class Worker:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.pod: str = spec["pod"]
        self.stats: Counter[str] = Counter()
        self.max_attempt = 0.0
        self.max_error_attempt = 0.0
        self.in_permit = 0
        self.stopping = asyncio.Event()
        self.state = "starting"
        self.finished = False
        self.fleet: Fleet | None = None
        self.gate: Gate | None = None
        self.ctl = aredis.Redis.from_url(spec["control"], decode_responses=True)
        base = f"chaos:{spec['run']}"
        self.k_status = f"{base}:w:{self.pod}"
        self.k_events = f"{base}:ev:{self.pod}"
        self.k_result = f"{base}:result:{self.pod}"
        self.k_stop = f"{base}:stop"
        self.extra: dict[str, Any] = {}
        # (lease id, wall time of the grant, acquire s, calls s, local) per permit, if asked.
        self.trace: list[tuple[str, float, float, float, int]] | None = (
            [] if spec.get("trace") else None
        )

    # -- reporting -------------------------------------------------------------------------------

    async def event(self, name: str, **fields: Any) -> None:
        await self.ctl.rpush(self.k_events, json.dumps({"ev": name, "t": time.time(), **fields}))

    def snapshot(self) -> dict[str, Any]:
        fleet, gate = self.fleet, self.gate
        out: dict[str, Any] = {
            "state": self.state,
            "ts": time.time(),
            "in_permit": self.in_permit,
            "max_attempt_s": round(self.max_attempt, 4),
            "max_error_attempt_s": round(self.max_error_attempt, 4),
            **{k: v for k, v in self.stats.items()},
            **{k: v for k, v in self.extra.items() if isinstance(v, (int, float, str))},
        }
        if fleet is not None and gate is not None:
            out.update(
                fallback=int(fleet.fallback_active),
                live_pods=gate.last_live_pods,
                limit=gate.last_limit,
                leases=len(gate.leases),
                local_leases=len(gate.local_leases),
                waiters=len(gate.waiters),
                bg_tasks=len(fleet.runtime.tasks),
            )
        return out

    async def reporter(self) -> None:
        while not self.finished:
            try:
                await self.ctl.hset(self.k_status, mapping=self.snapshot())
                if await self.ctl.exists(self.k_stop):
                    self.stopping.set()
            except Exception as exc:  # the control Redis is never faulted; log and go on
                log.warning("report failed: %s", exc)
            await asyncio.sleep(0.05)

    async def watch_fallback(self) -> None:
        """Timestamp every fallback transition (10 ms resolution)."""
        assert self.fleet is not None
        was = self.fleet.fallback_active
        while True:
            now = self.fleet.fallback_active
            if now != was:
                was = now
                self.stats["fallback_on" if now else "fallback_off"] += 1
                await self.event("fallback", on=now)
            await asyncio.sleep(0.01)

    # -- the calls ------------------------------------------------------------------------------

    async def call(self, http: httpx.AsyncClient, lease: Lease, passages: int) -> None:
        body = {
            "query": {"text": lease.id},
            "passages": [{"text": f"p{i}"} for i in range(passages)],
        }
        resp = await http.post("/v1/ranking", json=body)
        if resp.status_code != 200:
            self.stats[f"http:{resp.status_code}"] += 1

    async def load_loop(self, http: httpx.AsyncClient) -> None:
        spec, gate = self.spec, self.gate
        assert gate is not None
        rng = random.Random()
        # Mixed admission (the soak's --mixed): each permit draws a weight, a band, a tenant
        # and tokens, and runs ``weight`` calls at once, so the calls running at the simulator
        # are the units in use; its id (the calls' query text) says its tokens. Some resize
        # their tokens before a call (the calls running at any instant carry one id).
        weights, priorities = spec.get("weights") or [1], spec.get("priorities") or [0]
        tenants, sizes = spec.get("tenants") or [None], spec.get("tokens") or [0]
        while not self.stopping.is_set():
            t0 = time.monotonic()
            weight = rng.choice(weights)
            ask = dict(
                weight=weight, priority=rng.choice(priorities), tenant=rng.choice(tenants),
                tokens=rng.choice(sizes),
            )  # fmt: skip
            try:
                try:
                    async with gate.permit(deadline=spec.get("deadline", 30.0), **ask) as lease:
                        t_granted, wall_granted = time.monotonic(), time.time()
                        self.stats["local_grants" if lease.local else "fleet_grants"] += 1
                        self.in_permit += 1
                        try:
                            for _ in range(spec.get("calls_per_permit", 1)):
                                if lease.is_lost:
                                    self.stats["lost_stop"] += 1
                                    break
                                if lease.tokens and rng.random() < spec.get("resizes", 0.0):
                                    asked = rng.choice(sizes)
                                    done = await lease.resize(asked) == asked
                                    self.stats["resized" if done else "resize_kept"] += 1
                                passages = spec.get("passages", 4)
                                await asyncio.gather(
                                    *(self.call(http, lease, passages) for _ in range(weight))
                                )
                        finally:
                            self.in_permit -= 1
                            if self.trace is not None:
                                self.trace.append(
                                    (lease.id, wall_granted, t_granted - t0,
                                     time.monotonic() - t_granted, int(lease.local))
                                )  # fmt: skip
                except LeaseLost:  # the calls ran to their end; their lease was lost meanwhile
                    self.stats["lost"] += 1
                self.stats["ok"] += 1
                self.max_attempt = max(self.max_attempt, time.monotonic() - t0)
            except Exception as exc:
                took = time.monotonic() - t0
                self.max_attempt = max(self.max_attempt, took)
                self.max_error_attempt = max(self.max_error_attempt, took)
                name = type(exc).__name__
                self.stats[f"err:{name}"] += 1
                if self.stats[f"err:{name}"] == 1:
                    await self.event("error", type=name, took=took, msg=str(exc)[:200])
                if self.stats[f"err:{name}"] <= 3:
                    log.warning("call failed after %.3fs: %r", took, exc)
                await asyncio.sleep(spec.get("error_backoff", 0.05))
            think = spec.get("think_s", 0.0)
            if think:
                await asyncio.sleep(rng.uniform(0, 2 * think))

    async def prime_and_wait(self) -> None:
        """``prime``: take and release one permit first (the gate is one this process has used;
        ``primed`` = 1 in its status), then, with ``go_key``, wait until that control key exists
        before the load starts (idle meanwhile: no calls, so a short outage goes unseen)."""
        spec, gate = self.spec, self.gate
        assert gate is not None
        if spec.get("prime"):
            async with gate.permit(deadline=30):
                pass
            self.extra["primed"] = 1
        go_key = spec.get("go_key")
        while go_key and not self.stopping.is_set() and not await self.ctl.exists(go_key):
            await asyncio.sleep(0.005)

    async def victim(self, http: httpx.AsyncClient) -> None:
        """One permit around one long call; then wait for ``lease.lost`` before leaving it."""
        gate, spec = self.gate, self.spec
        assert gate is not None
        # Waits for the loss inside the block, so leaving it raises LeaseLost: expected here.
        with contextlib.suppress(LeaseLost):
            async with gate.permit(deadline=None) as lease:
                self.extra.update(lease_id=lease.id, token=lease.token)
                await self.event("acquired", lease=lease.id)
                await self.call(http, lease, spec["long_passages"])
                returned = time.time()
                lost_at_return = lease.is_lost
                try:
                    await asyncio.wait_for(lease.lost.wait(), spec.get("lost_wait", 10.0))
                    lost_at: float | None = time.time()
                except asyncio.TimeoutError:
                    lost_at = None
                await self.event(
                    "call_returned", at=returned, lost_at_return=lost_at_return, lost_at=lost_at
                )
        await self.event("released", lost=lease.is_lost)
        self.extra.update(lost=int(lease.is_lost), released_at=time.time())
        await self.stopping.wait()

    # -- main -----------------------------------------------------------------------------------

    async def run(self) -> None:
        spec = self.spec
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR2, dump_tasks)
        await self.ctl.delete(self.k_status, self.k_events, self.k_result)
        reporter = asyncio.create_task(self.reporter())
        # ``open_key``: the process is up (imports done, reporting) but opens its fleet only
        # once that control key exists: a pod with fresh connections at a moment the test picks
        # (say the instant a wiped Redis answers again).
        open_key = spec.get("open_key")
        if open_key:
            self.state = "waiting"
            while not await self.ctl.exists(open_key):
                await asyncio.sleep(0.002)
        fleet = Fleet(
            spec["url"],
            prefix=spec["prefix"],
            pod_id=self.pod,
            on_redis_error=spec.get("on_redis_error", "fair_share"),
            heartbeat_interval=spec.get("hb", 1.0),
            registry=CollectorRegistry(),
        )
        self.fleet = fleet
        limit = spec["limit"]
        deadline_at = time.monotonic() + spec.get("duration", 600.0)
        async with fleet:
            self.gate = fleet.gate(
                spec["gate"],
                floor=limit,
                ceiling=spec.get("ceiling", limit),
                max_queued=spec.get("max_queued", 100_000),
                lease_ms=spec.get("lease_ms", 10_000),
                waiter_ms=spec.get("waiter_ms", 5_000),
                token_limit=spec.get("token_limit"),
            )
            watcher = asyncio.create_task(self.watch_fallback())
            limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
            async with httpx.AsyncClient(base_url=spec["sim"], timeout=120, limits=limits) as http:
                self.state = "running"
                role = spec.get("role", "load")
                if role == "load":
                    await self.prime_and_wait()
                    work = [asyncio.create_task(self.load_loop(http)) for _ in range(spec["loops"])]
                elif role == "victim":
                    work = [asyncio.create_task(self.victim(http))]
                elif role == "cancel":
                    work = [asyncio.create_task(cancel_storm(self, http))]
                elif role == "cancel_ends":
                    work = [asyncio.create_task(cancel_ends(self))]
                else:
                    raise SystemExit(f"unknown role {role!r}")

                async def timer() -> None:
                    await asyncio.sleep(max(0.0, deadline_at - time.monotonic()))
                    self.stopping.set()

                stopper = asyncio.create_task(timer())
                await self.stopping.wait()
                self.state = "stopping"
                # Loops finish the permit they hold; a bound keeps a hang visible as a failure
                # of the test (it measures how long the exit took), not as a stuck process.
                _, pending = await asyncio.wait(work, timeout=spec.get("drain_s", 15.0))
                if pending:
                    log.error("%d loops still busy %.0f s after stop:", len(pending), 15.0)
                    for t in list(pending)[:3]:
                        t.print_stack(file=sys.stderr)
                    log.error("fleet state: %s", self.snapshot())
                for t in pending:
                    t.cancel()
                await asyncio.gather(*work, return_exceptions=True)
                self.stats["undrained"] += len(pending)
                stopper.cancel()
            watcher.cancel()
        self.state = "done"
        self.finished = True
        if self.trace is not None:
            path = Path(spec["trace"] + f".{self.pod}.json")
            await asyncio.to_thread(path.write_text, json.dumps(self.trace))
        await self.ctl.set(self.k_result, json.dumps(self.snapshot()))
        await self.ctl.hset(self.k_status, mapping=self.snapshot())
        reporter.cancel()
        await asyncio.gather(reporter, return_exceptions=True)
        await self.ctl.aclose()


def dump_tasks() -> None:
    """Every asyncio task's stack to stderr (the harness asks with SIGUSR2 when we hang)."""
    for t in asyncio.all_tasks():
        print(f"--- task {t.get_name()} done={t.done()}", file=sys.stderr)
        t.print_stack(file=sys.stderr)
    sys.stderr.flush()


def main() -> None:
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    spec = json.loads(sys.argv[1])
    faulthandler.register(signal.SIGUSR1)  # the harness dumps our stacks into the log on a hang
    asyncio.run(Worker(spec).run())


if __name__ == "__main__":
    main()
