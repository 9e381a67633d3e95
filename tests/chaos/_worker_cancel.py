"""The chaos worker's cancellation roles (``python -m tests.chaos._worker`` runs them for the
roles ``cancel`` and ``cancel_ends``): cancellations aimed at each point of a permit's life, and
the check that every cancelled task ends and leaks nothing."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

from fleetgate.scripts import GRANTED, PARKED

if TYPE_CHECKING:
    from ._worker import Worker

log = logging.getLogger("chaos.worker")


async def cancel_storm(w: Worker, http: httpx.AsyncClient) -> None:
    """Cancel ``spec["cancels"]`` tasks at random points of a permit's life.

    Tasks run ``permit()`` around one short simulator call (or a short sleep). Cancellation is
    aimed by hooks on the fleet's script calls -- which a caller cannot see, so this is test
    instrumentation only -- and by a random-time canceller:

    * ``acquire_in_flight``: cancelled 0-0.5 ms after the acquire was asked (in the gate's
      batch, or its script in flight);
    * ``parked``: cancelled while parked in the fleet queue (random delay after parking);
    * ``just_granted``: cancelled right after the hand-off resolved its future, before the
      task resumed (the grant/cancel race);
    * ``in_permit``: cancelled inside the block (during the HTTP call or the sleep);
    (No ``releasing`` phase: a fleet lease's release has no await point -- it joins the
    gate's next batch -- so no cancellation can land in it.)
    * plus cancels at random times, counted under whatever phase the task was in.

    After the storm every task has ended. The worker then waits until its fleet has no
    background task left (pending cancels/releases), reports ``done`` and the ids it still holds
    (none), and stays alive -- heartbeats running -- until told to stop, so TTL expiry cannot
    hide a leak: the test reads Redis while the processes live.
    """
    spec = w.spec
    fleet, gate = w.fleet, w.gate
    assert fleet is not None and gate is not None
    loop = asyncio.get_running_loop()
    rng = random.Random(spec.get("seed"))
    target = spec["cancels"]
    concurrency = spec.get("concurrency", 24)
    p = spec.get("p", {})
    phase: dict[asyncio.Task[Any], str] = {}
    task_of: dict[str, asyncio.Task[Any]] = {}
    hits: Counter[str] = Counter()
    sent = 0

    def cancel(t: asyncio.Task[Any], aim: str) -> None:
        nonlocal sent
        if t.done() or sent >= target or getattr(t, "_chaos_cancelled", False):
            return
        where = phase.get(t, "other")
        if where == "done":
            return
        t._chaos_cancelled = True  # type: ignore[attr-defined]
        hits[where] += 1
        hits[f"aim:{aim}"] += 1
        sent += 1
        t.cancel()

    # The caller's side of an acquire (its request in the gate's batch, until the answer).
    orig_acquire = gate._request
    orig_on_granted = gate.on_granted

    async def acquire(lease_id: str, wait_ms: int, cls: str = "") -> Any:
        t = asyncio.current_task()
        assert t is not None
        task_of[lease_id] = t
        phase[t] = "acquire_in_flight"
        if rng.random() < p.get("acquire", 0.12):
            loop.call_later(rng.uniform(0, 0.0005), cancel, t, "acquire")
        reply = await orig_acquire(lease_id, wait_ms, cls)
        if reply.status == PARKED:
            phase[t] = "parked"
            if rng.random() < p.get("parked", 0.25):
                loop.call_later(rng.uniform(0, 0.02), cancel, t, "parked")
        else:
            phase[t] = "granted"
        return reply

    def on_granted(lease_id: str, token: int) -> None:
        orig_on_granted(lease_id, token)
        t = task_of.get(lease_id)
        if t is not None and phase.get(t) == "parked" and rng.random() < p.get("granted", 0.35):
            phase[t] = "just_granted"
            cancel(t, "granted")

    gate._request = acquire  # type: ignore[method-assign]
    gate.on_granted = on_granted  # type: ignore[method-assign]

    async def one() -> None:
        t = asyncio.current_task()
        assert t is not None
        phase[t] = "start"
        lease_id = None
        try:
            async with gate.permit(deadline=None) as lease:
                lease_id = lease.id
                phase[t] = "in_permit"
                if rng.random() < p.get("permit", 0.08):
                    loop.call_later(rng.uniform(0, 0.01), cancel, t, "permit")
                if rng.random() < 0.5:
                    await w.call(http, lease, 2)
                else:
                    await asyncio.sleep(rng.uniform(0, 0.005))
            w.stats["completed"] += 1
        except asyncio.CancelledError:
            w.stats["cancelled"] += 1
        except Exception as exc:
            w.stats[f"err:{type(exc).__name__}"] += 1
            log.warning("task failed: %r", exc)
        finally:
            phase[t] = "done"
            if lease_id is not None:
                task_of.pop(lease_id, None)

    running: set[asyncio.Task[None]] = set()

    async def random_canceller() -> None:
        while True:
            await asyncio.sleep(rng.uniform(0, 0.004))
            live = [t for t in running if not t.done()]
            if live and rng.random() < p.get("random", 0.5):
                cancel(rng.choice(live), "random")

    rc = asyncio.create_task(random_canceller())
    t0 = time.monotonic()
    while sent < target and not w.stopping.is_set():
        while len(running) < concurrency:
            t = asyncio.create_task(one())
            running.add(t)
            t.add_done_callback(running.discard)
        await asyncio.sleep(0.001)
        w.extra["cancels_sent"] = sent
    rc.cancel()
    if running:
        await asyncio.wait(list(running))
    # Drain the fleet's background work (cancels and releases spawned by the cancellations).
    while fleet.runtime.tasks:
        await asyncio.sleep(0.01)
    for key in list(phase):
        if phase[key] == "done":
            del phase[key]
    w.extra.update(
        cancels_sent=sent,
        storm_s=round(time.monotonic() - t0, 2),
        live_leases=json.dumps(list(gate.leases)),
        hits=json.dumps(dict(hits)),
        waiters_left=len(gate.waiters),
    )
    w.state = "done"
    await w.ctl.hset(w.k_status, mapping=w.snapshot())
    await w.stopping.wait()


async def cancel_ends(w: Worker) -> None:
    """Cancel ``spec["cancels"]`` tasks once each, at random points, and time how long each takes
    to end after its cancellation (tests/chaos/test_cancel_ends.py).

    Each task takes a permit -- ``gate.permit()`` or ``gate.acquire()`` + ``release()``, with no
    deadline or a long one -- and then waits *forever* inside it: a cancellation is the only way
    it ends. A cancellation that is lost (swallowed somewhere) therefore shows as a task that
    does not end -- and that holds a permit, or enters its permit after it was cancelled -- not
    as a call that quietly completed. Each task is cancelled once, aimed by a plan drawn at its
    start (test instrumentation hooks on the fleet's script calls and hand-offs):

    * ``acquire_rt``: during the acquire script's round trip: 0-6 loop iterations after it was
      issued (the iterations in which redis-py sends and reads), or 0-1 ms after;
    * ``parked``: 0-20 ms after the reply said "parked";
    * ``just_granted``: right as a hand-off resolves the parked acquire, before it resumes;
    * ``reply``: as the acquire script's reply returns ("granted" or "parked"), by the
      acquiring task itself (raised at its next await);
    * ``in_permit``: 0-5 ms into the permit;
    * ``random``: 0-10 ms after the task started, wherever it is;

    and a task whose plan's moment never came is cancelled 0-2 ms into its permit. A task not
    ended ``end_bound_s`` after its cancellation is counted as hung (with where it was when
    cancelled) and cancelled again, so one loss does not stall the storm; a task that enters its
    permit after its cancellation is counted too (the cancellation was lost), and cancelled
    again at once. After the storm every remaining task is cancelled, the fleet's background
    work is drained, and the worker reports, stays alive (heartbeats running) until told to stop,
    then closes its fleet.
    """
    spec = w.spec
    fleet, gate = w.fleet, w.gate
    assert fleet is not None and gate is not None
    loop = asyncio.get_running_loop()
    rng = random.Random(spec.get("seed"))
    target = spec["cancels"]
    concurrency = spec.get("concurrency", 12)
    bound = spec.get("end_bound_s", 2.0)
    budget = spec.get("budget_s", 45.0)
    plans = spec.get(
        "plans",
        {"acquire_rt": 30, "parked": 20, "just_granted": 15, "reply": 5, "in_permit": 10,
         "random": 20},
    )  # fmt: skip
    plan_names, plan_weights = list(plans), list(plans.values())

    @dataclass
    class Info:
        api: str
        plan: str
        phase: str = "start"
        cancel_at: float | None = None
        cancel_phase: str = ""
        aim: str = ""
        hung: bool = False
        ended_at: float | None = None

    info: dict[asyncio.Task[Any], Info] = {}
    task_of: dict[str, asyncio.Task[Any]] = {}
    hits: Counter[str] = Counter()
    hung: list[tuple[str, str, str]] = []
    lost_where: Counter[str] = Counter()
    sent = 0
    lost = 0

    def cancel(t: asyncio.Task[Any], aim: str) -> None:
        nonlocal sent
        i = info.get(t)
        if i is None or t.done() or i.cancel_at is not None:
            return
        i.cancel_at, i.cancel_phase, i.aim = loop.time(), i.phase, aim
        hits[i.phase] += 1
        hits[f"aim:{aim}"] += 1
        sent += 1
        t.cancel()

    def after_iterations(k: int, t: asyncio.Task[Any]) -> None:
        if k <= 0:
            cancel(t, "acquire_rt")
        else:
            loop.call_soon(after_iterations, k - 1, t)

    # The caller's side of an acquire (its request in the gate's batch, until the answer).
    orig_acquire, orig_on_granted = gate._request, gate.on_granted

    async def acquire(lease_id: str, wait_ms: int, cls: str = "") -> Any:
        t = asyncio.current_task()
        assert t is not None
        i = info.get(t)
        if i is None:  # not one of ours
            return await orig_acquire(lease_id, wait_ms, cls)
        task_of[lease_id] = t
        i.phase = "acquire_in_flight"
        if i.plan == "acquire_rt" and i.cancel_at is None:
            if rng.random() < 0.6:
                after_iterations(rng.randint(0, 6), t)
            else:
                loop.call_later(rng.uniform(0, 0.001), cancel, t, "acquire_rt")
        reply = await orig_acquire(lease_id, wait_ms, cls)
        i.phase = {PARKED: "parked", GRANTED: "granted_reply"}.get(reply.status, "rejected")
        if i.plan == "parked" and reply.status == PARKED:
            loop.call_later(rng.uniform(0, 0.02), cancel, t, "parked")
        elif i.plan == "reply":
            cancel(t, "reply")  # the running task cancels itself: raised at its next await
        return reply

    def on_granted(lease_id: str, token: int) -> None:
        orig_on_granted(lease_id, token)
        t = task_of.get(lease_id)
        i = info.get(t) if t is not None else None
        if t is not None and i is not None and i.phase == "parked":
            i.phase = "just_granted"
            if i.plan == "just_granted":
                cancel(t, "just_granted")

    gate._request = acquire  # type: ignore[method-assign]
    gate.on_granted = on_granted  # type: ignore[method-assign]

    async def inside(t: asyncio.Task[Any], i: Info) -> None:
        nonlocal lost
        i.phase = "in_permit"
        if i.cancel_at is not None and (i.aim, i.cancel_phase) != ("reply", "granted_reply"):
            # Cancelled before it was granted, and yet here: the cancellation was lost. (A task
            # that cancelled itself as its "granted" reply returned gets the CancelledError at
            # its first await in here.)
            lost += 1
            lost_where[f"{i.cancel_phase}/{i.aim}"] += 1
            if lost <= 5:
                log.warning("task entered its permit after a cancellation at %s", i.cancel_phase)
            t.cancel()
        elif i.plan == "in_permit":
            loop.call_later(rng.uniform(0, 0.005), cancel, t, "in_permit")
        else:
            loop.call_later(rng.uniform(0, 0.002), cancel, t, "backstop")
        await asyncio.Event().wait()  # forever: only a cancellation ends the task

    async def one(i: Info) -> None:
        t = asyncio.current_task()
        assert t is not None
        deadline = None if rng.random() < 0.5 else 300.0
        try:
            if i.api == "permit":
                async with gate.permit(deadline=deadline):
                    await inside(t, i)
            else:
                lease = await gate.acquire(deadline=deadline)
                try:
                    await inside(t, i)
                finally:
                    await lease.release()
            w.stats["completed"] += 1  # impossible: only a cancellation ends a task
        except asyncio.CancelledError:
            w.stats["cancelled"] += 1
        except Exception as exc:
            w.stats[f"err:{type(exc).__name__}"] += 1
            log.warning("task failed: %r", exc)
        finally:
            i.phase = "done"
            i.ended_at = loop.time()

    running: set[asyncio.Task[None]] = set()

    def start() -> None:
        i = Info(
            api=rng.choice(["permit", "acquire"]),
            plan=rng.choices(plan_names, plan_weights)[0],
        )
        t = asyncio.create_task(one(i))
        info[t] = i
        running.add(t)
        t.add_done_callback(running.discard)
        if i.plan == "random":
            loop.call_later(rng.uniform(0, 0.01), cancel, t, "random")

    async def monitor() -> None:
        while True:
            await asyncio.sleep(0.05)
            now = loop.time()
            for t in list(running):
                i = info[t]
                if i.cancel_at is not None and now - i.cancel_at > bound and not t.done():
                    if not i.hung:
                        i.hung = True
                        hung.append((i.cancel_phase, i.aim, i.phase))
                        log.warning("task not ended %.1fs after its cancellation: %s", bound, i)
                    t.cancel()  # again (and again), so one loss does not stall the storm

    mon = asyncio.create_task(monitor())
    t0 = loop.time()
    while sent < target and loop.time() - t0 < budget and not w.stopping.is_set():
        while len(running) < concurrency:
            start()
        await asyncio.sleep(0.001)
        w.extra["cancels_sent"] = sent
    storm_s = loop.time() - t0
    for t in list(running):
        cancel(t, "final")
    if running:
        await asyncio.wait(list(running), timeout=max(30.0, 4 * bound))
    stuck = sum(1 for t in running if not t.done())
    mon.cancel()
    # Drain the fleet's background work (cancels and releases spawned by the cancellations).
    drain_until = loop.time() + 15.0
    while fleet.runtime.tasks and loop.time() < drain_until:
        await asyncio.sleep(0.01)
    ends = sorted(
        i.ended_at - i.cancel_at
        for i in info.values()
        if i.ended_at is not None and i.cancel_at is not None
    )
    w.extra.update(
        cancels_sent=sent,
        tasks=len(info),
        storm_s=round(storm_s, 2),
        hung=len(hung),
        hung_detail=json.dumps(Counter(f"{a}/{b}->{c}" for a, b, c in hung).most_common(10)),
        entered_after_cancel=lost,
        lost_where=json.dumps(lost_where.most_common(10)),
        stuck=stuck,
        never_cancelled=sum(1 for i in info.values() if i.cancel_at is None),
        end_p50_ms=round(1000 * ends[len(ends) // 2], 1) if ends else -1,
        end_p99_ms=round(1000 * ends[int(len(ends) * 0.99)], 1) if ends else -1,
        end_max_ms=round(1000 * ends[-1], 1) if ends else -1,
        hits=json.dumps(dict(hits)),
        apis=json.dumps(Counter(i.api for i in info.values())),
        live_leases=json.dumps(list(gate.leases)),
        leases_left=len(gate.leases),
        waiters_left=len(gate.waiters),
        local_left=len(gate.local_leases),
        bg_left=len(fleet.runtime.tasks),
    )
    w.state = "done"
    await w.ctl.hset(w.k_status, mapping=w.snapshot())
    await w.stopping.wait()
