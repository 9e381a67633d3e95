"""The demo's search pod: interactive rerank calls at high priority beside a growing batch flood.

``python -m fleetgate.demo.interactive --spec-from-env LABEL`` (the spec, with the Redis URL, as
JSON in ``$FLEETGATE_INTERACTIVE_SPEC``) drives the rerank gate of the demo with two kinds of
callers, both through the same fleet-wide gate as the demo's worker pods:

* ``search``: ``rate`` calls per second, each one ``POST /v1/ranking`` of a few passages inside
  ``gate.permit(priority=10, tenant="search")`` (a search service's ``findAndRerank``: a
  person waits for it);
* ``ingest``: a batch backlog at priority 0 (tenant ``ingest``) that grows by ``ramp`` request
  loops per second up to ``max_loops`` (batch ingestion re-ranking the chunks it embeds:
  nobody waits for it).

The wait of every search call (ask to grant, monotonic clock) is written with the number of
ingest loops to a JSON stats file every half second: the demo plots the search wait staying flat
while the batch queue grows. Stops on SIGTERM/SIGINT or when the parent is gone; what is in
flight is cancelled and its permits released.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import msgspec
from prometheus_client import CollectorRegistry

from fleetgate.client import Fleet, Gate
from fleetgate.demo.search_contract import SPEC_ENV, InteractiveSpec, InteractiveStats

__all__ = ["PRIORITY", "SearchPod", "main"]

PRIORITY = 10


class SearchPod:
    """Interactive searches at a steady rate beside a growing batch backlog, on one gate."""

    def __init__(self, spec: InteractiveSpec) -> None:
        self.spec = spec
        self.stats = InteractiveStats()

    def write(self, stopped: bool = False) -> None:
        """Replace the stats file (if any) atomically with the current counters."""
        if not self.spec.stats_path:
            return
        self.stats.updated = time.time()
        self.stats.stopped = stopped
        path = Path(self.spec.stats_path)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(msgspec.json.encode(self.stats))
        os.replace(tmp, path)

    async def _rank(self, http: httpx.AsyncClient, text: str, passages: int) -> None:
        body = {
            "query": {"text": text},
            "passages": [{"text": f"passage {p} of {text}"} for p in range(passages)],
            **({"model": self.spec.model} if self.spec.model else {}),
        }
        resp = await http.post(f"{self.spec.url}/v1/ranking", json=body)
        resp.raise_for_status()

    async def search(self, gate: Gate, http: httpx.AsyncClient, i: int) -> None:
        """One interactive call at priority ``PRIORITY``; its wait for the permit is recorded."""
        asked = time.monotonic()
        try:
            async with gate.permit(deadline=10.0, priority=PRIORITY, tenant="search"):
                self.stats.waits.append((asked, round((time.monotonic() - asked) * 1000, 2)))
                await self._rank(http, f"search {i}", self.spec.passages)
        except Exception:
            self.stats.search_errors += 1
        else:
            self.stats.search_ok += 1

    async def ingest(self, gate: Gate, http: httpx.AsyncClient, k: int) -> None:
        """Batch loop ``k``: priority-0 calls one after the other, until cancelled."""
        n = 0
        while True:
            n += 1
            try:
                async with gate.permit(deadline=30.0, priority=0, tenant="ingest"):
                    await self._rank(http, f"ingest {k}.{n}", self.spec.ingest_passages)
            except Exception:
                self.stats.ingest_errors += 1
                await asyncio.sleep(0.2)
            else:
                self.stats.ingest_ok += 1

    async def run(self, stop: asyncio.Event) -> None:
        """Search and grow the backlog until ``stop`` is set or the parent is gone."""
        spec = self.spec
        tasks: set[asyncio.Task[None]] = set()
        limits = httpx.Limits(max_connections=spec.max_loops + 64)
        async with (
            Fleet(
                spec.redis_url, prefix=spec.prefix, pod_id=spec.pod_id, registry=CollectorRegistry()
            ) as fleet,
            httpx.AsyncClient(timeout=httpx.Timeout(30.0), limits=limits) as http,
        ):
            gate = fleet.gate(spec.gate)
            t0 = time.monotonic()
            next_search, i, last_write = t0, 0, 0.0
            try:
                while not stop.is_set():
                    now = time.monotonic()
                    if spec.parent_pid is not None and os.getppid() != spec.parent_pid:
                        break
                    while next_search <= now:
                        i += 1
                        t = asyncio.create_task(self.search(gate, http, i))
                        tasks.add(t)
                        t.add_done_callback(tasks.discard)
                        next_search += 1.0 / spec.rate
                    want = min(spec.max_loops, int((now - t0) * spec.ramp))
                    while self.stats.ingest_loops < want:
                        self.stats.ingest_loops += 1
                        t = asyncio.create_task(self.ingest(gate, http, self.stats.ingest_loops))
                        tasks.add(t)
                    if now - last_write >= 0.5:
                        self.write()
                        last_write = now
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(stop.wait(), timeout=0.05)
            finally:
                for t in list(tasks):
                    t.cancel()
                if tasks:
                    await asyncio.wait(tasks, timeout=5.0)
        self.write(stopped=True)


async def _main(spec: InteractiveSpec) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await SearchPod(spec).run(stop)


def main(argv: list[str] | None = None) -> int:
    """Run the search pod of the spec in ``$FLEETGATE_INTERACTIVE_SPEC``; the exit code."""
    p = argparse.ArgumentParser(prog="python -m fleetgate.demo.interactive")
    p.add_argument("--spec-from-env", metavar="LABEL", required=True, help=f"spec in ${SPEC_ENV}")
    p.parse_args(argv)
    raw = os.environ.get(SPEC_ENV)
    if not raw:
        print(f"${SPEC_ENV} is not set", file=sys.stderr)
        return 2
    asyncio.run(_main(msgspec.json.decode(raw, type=InteractiveSpec)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
