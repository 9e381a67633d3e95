"""A rerank burst, fleet-wide: 4 processes × 250 requests × 10 calls
against a server that rejects whatever exceeds 32 calls in flight."""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import pytest

from fleetgate.tools.sim import serve_in_thread
from fleetgate.tools.sim.rerank import RerankSimConfig, build_app

from .. import _workers
from ..conftest import RedisUnderTest

PROCESSES, REQUESTS, CALLS, CAP, SERVICE_MS = 4, 250, 10, 32, 20.0


def run_burst(rut: RedisUnderTest, mode: str) -> tuple[dict[str, Any], dict[str, float]]:
    # Concurrency 32 and no internal queue: call number 33 gets a 503 at once.
    sim = RerankSimConfig(concurrency=CAP, queue_size=0, base_ms=SERVICE_MS, per_passage_ms=0)
    with serve_in_thread(build_app(sim)) as served:
        t0 = time.monotonic()
        with mp.get_context("spawn").Pool(PROCESSES) as pool:
            parts = pool.starmap(
                _workers.burst,
                [(rut.url, rut.prefix, served.url, REQUESTS, CALLS, mode, CAP)] * PROCESSES,
            )
        makespan = time.monotonic() - t0
        stats = served.state.sim.stats()
    total = {
        "requests": PROCESSES * REQUESTS,
        "calls": PROCESSES * REQUESTS * CALLS,
        "failed_calls": sum(p["failed_calls"] for p in parts),
        "failed_requests": sum(p["failed_requests"] for p in parts),
        "p50": max(p["p50"] for p in parts),
        "p99": max(p["p99"] for p in parts),
        "makespan": makespan,
        "oracle": PROCESSES * REQUESTS * CALLS * SERVICE_MS / 1000 / CAP,
        "errors": [p.get("errors", {}) for p in parts],
    }
    return total, stats


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fleet_gate_absorbs_the_burst(rut: RedisUnderTest) -> None:
    total, stats = run_burst(rut, "fleet")
    print(f"\nfleet gate: {total}  server peak running {stats['peak_running']}")
    assert total["failed_calls"] == 0 and total["failed_requests"] == 0, total["errors"]
    assert stats["peak_running"] <= CAP
    assert stats["served"] == total["calls"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_per_process_semaphores_overrun_the_server(rut: RedisUnderTest) -> None:
    total, stats = run_burst(rut, "local")
    print(f"\nper-process Semaphore({CAP}): {total}  rejected {stats['rejected']}")
    assert total["failed_calls"] > 0 and total["failed_requests"] > 0
