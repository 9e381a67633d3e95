"""Code run in child OS processes by tests/core/test_cluster_pool.py (spawned, so importable by
path).

Each worker opens one Fleet on a Redis Cluster and reports what it saw as plain data: how often
it fell into the fair-share fallback (its log lines) and the highest per-gate concurrency its
probe counters read.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from prometheus_client import CollectorRegistry

from fleetgate._redis import connect
from fleetgate.client import Fleet


class _OutageLines(logging.Handler):
    """Counts the fallback's log lines: entering it ("unreachable (<cause>)") and the local
    bounds it logs per gate."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.causes: list[str] = []
        self.local_bounds = 0

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "unreachable (" in message:
            self.causes.append(message.partition("unreachable (")[2].partition(")")[0])
        elif "local bound" in message:
            self.local_bounds += 1


def park_and_hold_each(
    url: str,
    prefix: str,
    gates: list[str],
    *,
    probe_url: str,
    probe: str,
    barrier: tuple[str, int],
    hold_s: float,
) -> dict[str, Any]:
    """On every gate (limit 1): two permits at once -- one holds a lease, the other parks --
    each held ``hold_s`` with the probe counter of its gate counted up (INCR/DECR on
    ``probe_url``, outside fleetgate). Starts once ``barrier`` = (key, n) counts n processes.
    Returns the fallback's log lines seen, the highest probe reading and the permits granted."""

    async def main() -> dict[str, Any]:
        lines = _OutageLines()
        logging.getLogger("fleetgate.client").addHandler(lines)
        # A blocking pool, large enough that counting is never what the permits wait for (at
        # first the listeners' topology loads take the loop for seconds).
        # Its connects wait too: the default 1 s timed out on a loaded machine (load 8-9), a
        # failure of the test's counter, not of the gate.
        probe_client = connect(
            probe_url, max_connections=32, timeout=60, socket_connect_timeout=10, socket_timeout=10
        )
        peak = granted = 0
        fallback_seen = False
        async with Fleet(
            url, prefix=prefix, heartbeat_interval=0.5, registry=CollectorRegistry()
        ) as fleet:
            handles = [fleet.gate(g, floor=1, ceiling=1) for g in gates]
            key, n = barrier
            await probe_client.incr(key)
            while int(await probe_client.get(key) or 0) < n:
                await asyncio.sleep(0.01)

            async def one(index: int) -> None:
                nonlocal peak, granted, fallback_seen
                gate = handles[index % len(handles)]
                async with gate.permit(deadline=50):
                    granted += 1
                    fallback_seen = fallback_seen or fleet.fallback_active
                    counter = f"{probe}:{gate.name}"
                    peak = max(peak, await probe_client.incr(counter))
                    await asyncio.sleep(hold_s)
                    await probe_client.decr(counter)

            await asyncio.gather(*(one(i) for i in range(2 * len(handles))))
            fallback_seen = fallback_seen or fleet.fallback_active
        await probe_client.aclose()
        logging.getLogger("fleetgate.client").removeHandler(lines)
        return {
            "causes": lines.causes,
            "local_bounds": lines.local_bounds,
            "fallback_seen": fallback_seen,
            "peak": peak,
            "granted": granted,
        }

    return asyncio.run(main())
