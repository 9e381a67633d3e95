"""Code run in child OS processes by the fleet tests (spawned, so importable by path), and the
parent's side of it: :func:`run_pods` starts them, :func:`wait_for` polls for what they did."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import redis
from prometheus_client import CollectorRegistry

from fleetgate.client import Fleet, LeaseLost


def hammer(url: str, prefix: str, gate: str, tasks: int, hold_s: float, probe: str) -> int:
    """Run ``tasks`` permits concurrently; return the highest concurrency seen by the probe.

    The probe is a plain Redis counter outside fleetgate: INCR on entry, DECR on exit.
    """
    return hammer_with(url, prefix, gate, probe_url=url, probe=probe, tasks=tasks, hold_s=hold_s)


def park_and_record(url: str, prefix: str, gate: str, record: str, hold_s: float) -> None:
    """Acquire once (parking if needed) and append this process' pid to ``record`` on grant."""

    async def main() -> None:
        r = redis.asyncio.Redis.from_url(url)
        async with Fleet(url, prefix=prefix, registry=CollectorRegistry()) as fleet:
            async with fleet.gate(gate, floor=1).permit(deadline=60):
                await r.rpush(record, os.getpid())
                await asyncio.sleep(hold_s)
        await r.aclose()

    asyncio.run(main())


def hold_forever(
    url: str, prefix: str, gate: str, ready: str, lease_ms: int, waiter_ms: int
) -> None:
    """Acquire (or park) and then never finish; the test SIGKILLs this process."""

    async def main() -> None:
        r = redis.asyncio.Redis.from_url(url)
        async with Fleet(url, prefix=prefix, registry=CollectorRegistry()) as fleet:
            g = fleet.gate(gate, floor=1, lease_ms=lease_ms, waiter_ms=waiter_ms)
            task = asyncio.create_task(g.acquire(deadline=None))
            await r.rpush(ready, os.getpid())
            await task
            await asyncio.sleep(3600)

    asyncio.run(main())


def wait_for(predicate, timeout: float, interval: float = 0.01) -> float:  # type: ignore[no-untyped-def]
    """Poll ``predicate`` until true; return the seconds it took (raise on timeout)."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"condition not met within {timeout}s")
        time.sleep(interval)
    return time.monotonic() - start


def map_with_probe(url: str, prefix: str, gate: str, items: int, hold_s: float, probe: str) -> int:
    """One request: ``gate.map`` over ``items`` calls; return the peak concurrency seen by the
    shared probe counter (INCR/DECR outside fleetgate)."""

    async def main() -> int:
        peak = 0
        r = redis.asyncio.Redis.from_url(url)
        async with Fleet(url, prefix=prefix, registry=CollectorRegistry()) as fleet:
            g = fleet.gate(gate, floor=1)

            async def call(_: int) -> None:
                nonlocal peak
                peak = max(peak, await r.incr(probe))
                await asyncio.sleep(hold_s)
                await r.decr(probe)

            await g.map(call, range(items), max_in_flight=4, deadline=60)
        await r.aclose()
        return peak

    return asyncio.run(main())


def burst(
    url: str, prefix: str, sim_url: str, requests: int, calls: int, mode: str, cap: int
) -> dict[str, Any]:
    """``requests`` concurrent findAndRerank-like requests of ``calls`` rerank calls each.

    mode "fleet": every call inside a permit of the fleet gate ``rerank`` (limit ``cap``);
    mode "local": a per-process ``asyncio.Semaphore(cap)`` only (a per-pod gate).
    No retries in either mode, so every server-side rejection is counted.
    """
    import httpx

    async def main() -> dict[str, Any]:
        failed_calls = failed_requests = 0
        errors: dict[str, int] = {}  # failed requests by exception type, for the test's message
        latencies: list[float] = []
        limits = httpx.Limits(max_connections=2 * cap, max_keepalive_connections=2 * cap)
        async with httpx.AsyncClient(base_url=sim_url, limits=limits, timeout=120) as http:

            async def rerank(batch: list[str]) -> int:
                nonlocal failed_calls
                body = {"query": {"text": "q"}, "passages": [{"text": p} for p in batch]}
                resp = await http.post("/v1/ranking", json=body)
                if resp.status_code != 200:
                    failed_calls += 1
                    resp.raise_for_status()
                return len(resp.json()["rankings"])

            passages = [[f"passage {i}-{j}" for j in range(10)] for i in range(calls)]
            async with Fleet(url, prefix=prefix, registry=CollectorRegistry()) as fleet:
                gate = fleet.gate("rerank", floor=cap, max_queued=requests * calls * 8)
                local = asyncio.Semaphore(cap)

                async def guarded(batch: list[str]) -> int:
                    async with local:
                        return await rerank(batch)

                async def request() -> None:
                    nonlocal failed_requests
                    t0 = time.monotonic()
                    try:
                        if mode == "fleet":
                            await gate.map(
                                rerank, passages, max_in_flight=8, deadline=120, retry=False
                            )
                        else:
                            await asyncio.gather(*(guarded(b) for b in passages))
                    except Exception as exc:
                        failed_requests += 1
                        kind = f"{type(exc).__name__}: {exc}"[:200]
                        errors[kind] = errors.get(kind, 0) + 1
                    latencies.append(time.monotonic() - t0)

                await asyncio.gather(*(request() for _ in range(requests)))
        latencies.sort()
        return {
            "failed_calls": failed_calls,
            "failed_requests": failed_requests,
            "errors": errors,
            "p50": latencies[len(latencies) // 2],
            "p99": latencies[int(len(latencies) * 0.99) - 1],
        }

    return asyncio.run(main())


def hammer_gates(url: str, prefix: str, gates: list[str], tasks: int, probe: str) -> int:
    """Like :func:`hammer`, over several gates (each with its own probe counter); returns the
    highest per-gate concurrency seen."""

    async def main() -> int:
        peak = 0
        async with Fleet(url, prefix=prefix, registry=CollectorRegistry()) as fleet:
            probe_client = fleet.redis

            async def one(name: str) -> None:
                nonlocal peak
                async with fleet.gate(name, floor=2).permit(deadline=60):
                    key = f"{probe}:{{{name}}}"
                    peak = max(peak, await probe_client.incr(key))
                    await asyncio.sleep(0.002)
                    await probe_client.decr(key)

            await asyncio.gather(*(one(gates[i % len(gates)]) for i in range(tasks)))
        return peak

    return asyncio.run(main())


def hold_gates(
    url: str, prefix: str, gates: list[str], *, hold_s: float, probe_url: str, probe: str
) -> list[bool]:
    """Hold one permit of each gate (floor = ceiling = 1, 1 s leases, heartbeat every 0.2 s)
    for ``hold_s``, the probe counted up (INCR) while the last gate's is held; returns whether
    each lease was lost."""

    async def main() -> list[bool]:
        probe_client = redis.asyncio.Redis.from_url(probe_url)
        opts = dict(floor=1, ceiling=1, lease_ms=1000, waiter_ms=1000)
        lost: list[bool] = []
        async with Fleet(
            url, prefix=prefix, heartbeat_interval=0.2, registry=CollectorRegistry()
        ) as fleet:
            with contextlib.suppress(LeaseLost):  # what was lost is returned
                async with contextlib.AsyncExitStack() as stack:
                    leases = [
                        await stack.enter_async_context(fleet.gate(g, **opts).permit())
                        for g in gates
                    ]
                    await probe_client.incr(probe)
                    await asyncio.sleep(hold_s)
                    await probe_client.decr(probe)
                    lost = [lease.is_lost for lease in leases]
        await probe_client.aclose()
        return lost

    return asyncio.run(main())


def hammer_with(
    url: str,
    prefix: str,
    gate: str,
    *,
    probe_url: str,
    probe: str,
    tasks: int = 1,
    loops: int = 1,
    hold_s: float = 0.1,
    pod_id: str | None = None,
    floor: int = 4,
    heartbeat_interval: float = 1.0,
    barrier: tuple[str, int] | None = None,
    after_probe: int = 0,
    tokens: int = 0,
    token_limit: int | None = None,
    live_pods: int = 0,
    go: str | None = None,
    deadline_admission: bool | str = True,
) -> int:
    """``hammer`` with the knobs the fault tests need; returns the probe's highest reading.

    Each of ``tasks`` tasks takes ``loops`` permits in turn. The probe (INCR on entry, DECR on
    exit; by ``tokens`` when the permits ask tokens, so it reads tokens in use) lives on
    ``probe_url``, which may be another server than the gate's (whose Redis may be down).
    ``live_pods``: first wait until the gate's trusted count of live pods reaches it.
    ``barrier`` = (key, n): start once n processes have arrived (INCR on probe_url); ``go``:
    then wait until that key exists on probe_url (the test does something first, say kill
    Redis); ``after_probe``: start once the probe reads at least that (another process holds
    permits).
    """

    async def main() -> int:
        peak = 0
        probe_client = redis.asyncio.Redis.from_url(probe_url)
        async with Fleet(
            url,
            prefix=prefix,
            pod_id=pod_id,
            heartbeat_interval=heartbeat_interval,
            registry=CollectorRegistry(),
        ) as fleet:
            g = fleet.gate(
                gate, floor=floor, token_limit=token_limit, deadline_admission=deadline_admission
            )
            while g.last_live_pods < live_pods:
                await asyncio.sleep(0.01)
            if barrier is not None:
                await probe_client.incr(barrier[0])
                while int(await probe_client.get(barrier[0]) or 0) < barrier[1]:
                    await asyncio.sleep(0.01)
            while go is not None and not await probe_client.exists(go):
                await asyncio.sleep(0.01)
            while int(await probe_client.get(probe) or 0) < after_probe:
                await asyncio.sleep(0.01)

            async def one() -> None:
                nonlocal peak
                for _ in range(loops):
                    async with g.permit(deadline=60, tokens=tokens):
                        now = await probe_client.incrby(probe, tokens or 1)
                        peak = max(peak, now)
                        await asyncio.sleep(hold_s)
                        await probe_client.decrby(probe, tokens or 1)

            await asyncio.gather(*(one() for _ in range(tasks)))
        await probe_client.aclose()
        return peak

    return asyncio.run(main())


def run_pods(n: int, **kwargs: Any) -> list[int]:
    """Run ``n`` :func:`hammer_with` processes with the same arguments; their probe peaks."""
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(n, mp_context=spawn) as ex:
        futs = [ex.submit(hammer_with, **kwargs) for _ in range(n)]
        return [f.result(timeout=120) for f in futs]


def hold_and_report(
    url: str, prefix: str, gate: str, control_url: str, report: str, stop: str, hb: float
) -> None:
    """Take one permit, push its lease id and fencing token to ``report`` (a list on the
    control Redis), and hold it -- through outages, renewed and adopted as the fleet does --
    until ``stop`` exists there."""

    async def main() -> None:
        ctl = redis.asyncio.Redis.from_url(control_url, decode_responses=True)
        fleet = Fleet(url, prefix=prefix, registry=CollectorRegistry(), heartbeat_interval=hb)
        async with fleet:
            async with fleet.gate(gate, floor=4).permit(deadline=30) as lease:
                await ctl.rpush(report, lease.id, lease.token)
                while not await ctl.exists(stop):
                    await asyncio.sleep(0.02)
        await ctl.aclose()

    asyncio.run(main())
