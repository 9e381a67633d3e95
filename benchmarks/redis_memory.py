"""redis_memory: what a gate, a lease and a parked waiter cost in Redis memory, for sizing.

A private redis-server; one fleet (this process) makes the state as an application would, and
``INFO memory`` ``used_memory_dataset`` is read before and after each step (after the gate
library is loaded, so its code is not counted):

* ``gates``: G gates, each with one lease held (its configuration, holder, live-pod entry,
  registry member, counters): bytes per gate in use;
* ``leases``: L more leases on one gate (limit L): bytes per lease;
* ``waiters``: W callers parked on one full gate (wait list bound above W): bytes per waiter,
  its lane, member and wake-list entry included.

Every step is released and the memory read again, so what a gate keeps after its work is gone
(its configuration, counters, registry entry) is reported too. jemalloc rounds allocations, so
the figures are per item over many items, not exact per key.
"""

from __future__ import annotations

import asyncio
from typing import Any

import redis

from ._common import Headline, Options, figure, log, open_fleet, save, table
from ._server import private_redis, sync_client

NAME = "redis_memory"
HOUR = 3600.0


def _used(r: redis.Redis) -> int:
    # The dataset alone: used_memory less the server's overhead (client buffers, replication
    # backlog, ...), which moves with the connections' traffic, not with the state.
    return int(r.info("memory")["used_memory_dataset"])


async def _measure(
    url: str, opts: Options, gates: int, leases: int, waiters: int
) -> dict[str, Any]:
    r = sync_client(url)
    out: dict[str, Any] = {"gates": gates, "leases": leases, "waiters": waiters}
    async with open_fleet(url, opts.flavor) as fleet:
        warm = fleet.gate("bench-mem-warm")
        await (await warm.acquire()).release()  # the library loaded, the pod registered
        await fleet.flush()
        base = _used(r)

        held = [await fleet.gate(f"bench-mem-{i}").acquire(deadline=HOUR) for i in range(gates)]
        await asyncio.sleep(1.5)  # a heartbeat: each gate's live pod and registry entry
        out["bytes_per_gate_in_use"] = (_used(r) - base) / gates
        for lease in held:
            await lease.release()
        await fleet.flush()
        await asyncio.sleep(0.2)
        out["bytes_per_idle_gate"] = (_used(r) - base) / gates
        log(f"{gates} gates: {out['bytes_per_gate_in_use']:.0f} B in use, "
            f"{out['bytes_per_idle_gate']:.0f} B idle")  # fmt: skip

        wide = fleet.gate("bench-mem-leases", floor=leases, ceiling=leases)
        before = _used(r)
        many = await asyncio.gather(*(wide.acquire(deadline=HOUR) for _ in range(leases)))
        out["bytes_per_lease"] = (_used(r) - before) / leases
        for lease in many:
            await lease.release()
        await fleet.flush()
        log(f"{leases} leases: {out['bytes_per_lease']:.0f} B each")

        full = fleet.gate("bench-mem-waiters", floor=1, max_queued=waiters + 10)
        holder = await full.acquire(deadline=HOUR)
        before = _used(r)
        parked = [asyncio.create_task(full.acquire(deadline=HOUR)) for _ in range(waiters)]
        while int(r.zcard(full.keys.waiters)) < waiters:
            await asyncio.sleep(0.05)
        out["bytes_per_waiter"] = (_used(r) - before) / waiters
        log(f"{waiters} waiters: {out['bytes_per_waiter']:.0f} B each")
        for task in parked:
            task.cancel()
        await asyncio.gather(*parked, return_exceptions=True)
        await holder.release()
    r.close()
    return out


def run(opts: Options) -> list[Headline]:
    gates, leases, waiters = opts.pick((1_000, 10_000, 10_000), (100, 1_000, 1_000))
    with private_redis() as rp:
        res = opts.flavor.run(_measure(rp.url, opts, gates, leases, waiters))
        rows = [
            ("gate in use (1 lease)", gates, res["bytes_per_gate_in_use"]),
            ("gate idle after use", gates, res["bytes_per_idle_gate"]),
            ("lease", leases, res["bytes_per_lease"]),
            ("parked waiter", waiters, res["bytes_per_waiter"]),
        ]
        text = table(("item", "count", "bytes each"), rows)
        fig, ax = figure()
        ax[0][0].bar([r[0] for r in rows], [r[2] for r in rows])
        ax[0][0].set_ylabel("bytes of Redis used_memory_dataset each")
        ax[0][0].tick_params(axis="x", labelrotation=15)
        fig.suptitle("Redis memory per gate, lease and waiter")
        save(NAME, opts, rp.url, res, text, fig)
    return [
        Headline(NAME, "bytes per gate in use", f"{res['bytes_per_gate_in_use']:.0f}", "-", None),
        Headline(NAME, "bytes per lease", f"{res['bytes_per_lease']:.0f}", "-", None),
        Headline(NAME, "bytes per parked waiter", f"{res['bytes_per_waiter']:.0f}", "-", None),
    ]


if __name__ == "__main__":
    import sys

    from ._common import main

    sys.exit(main(only=[NAME]))
