"""Peer worker for benchmarks/peers.py: PyPI redis-limiters 0.7.0 ``AsyncSemaphore``.

Runs in its own venv (never the project's): standard library, redis-py and redis_limiters only.

Usage: ``<peer venv>/bin/python limiters_worker.py '<spec JSON>'``
spec: {url, key, tasks, limit, hold_ms, warm_s, seconds, out, options}
Protocol (same as semaphore_worker.js): open the pool's connections, print "ready", read the
common start (``time.monotonic_ns``) from stdin, sleep until it, run ``tasks`` acquirers until
warm_s + seconds after it, write {recs, cpu_s, errors} to spec.out. recs is flat: asked, granted,
left (ns) per hold; ``left`` is taken inside the hold, before the release, as
benchmarks/throughput.py does.
"""

from __future__ import annotations

import asyncio
import json
import resource
import sys
import time
from pathlib import Path

from redis.asyncio import Redis
from redis_limiters import AsyncSemaphore


def cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


async def sleep_until(t_ns: int) -> None:
    await asyncio.sleep(max(0.0, (t_ns - time.monotonic_ns()) / 1e9))


async def main(spec: dict) -> dict:
    tasks = int(spec["tasks"])
    # Every waiter sits in its own BLPOP, so the pool needs one connection per task (redis-py's
    # asyncio pool refuses more than 100 by default).
    r = Redis.from_url(spec["url"], max_connections=tasks + 8)
    pool = r.connection_pool
    conns = [await pool.get_connection() for _ in range(tasks + 4)]  # no connect storm later
    for c in conns:
        await pool.release(c)
    sem = AsyncSemaphore(
        name=spec["key"], capacity=int(spec["limit"]), connection=r, **spec["options"]
    )
    print("ready", flush=True)
    start = int(await asyncio.to_thread(sys.stdin.readline))
    lo = start + int(spec["warm_s"] * 1e9)
    stop = start + int((spec["warm_s"] + spec["seconds"]) * 1e9)
    hold = spec["hold_ms"] / 1000
    await sleep_until(start)

    async def cpu_window() -> float:
        await sleep_until(lo)
        before = cpu_seconds()
        await sleep_until(stop)
        return cpu_seconds() - before

    cpu = asyncio.create_task(cpu_window())
    recs: list[int] = []
    errors = 0

    async def one() -> None:
        nonlocal errors
        while (asked := time.monotonic_ns()) < stop:
            try:
                async with sem:
                    granted = time.monotonic_ns()
                    if granted < stop:
                        await asyncio.sleep(hold)
                    recs.extend((asked, granted, time.monotonic_ns()))
            except Exception:
                errors += 1

    await asyncio.gather(*(one() for _ in range(tasks)))
    out = {"recs": recs, "cpu_s": await cpu, "errors": errors}
    await r.aclose()
    return out


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    Path(spec["out"]).write_text(json.dumps(asyncio.run(main(spec))))
