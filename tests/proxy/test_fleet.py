"""``fleetgate proxy`` as a fleet: several OS processes sharing one gate through Redis.

* Two proxy processes (one configured by flags, one by a TOML file) and one Python service
  (``gate.map`` in a process of its own) share the gate of a reranker that answers 503 past its
  capacity (queue 0): every call through the proxies succeeds and the reranker never runs more
  than the gate's limit.
* SIGTERM drains: the listener closes, the requests in flight (queued ones included) finish,
  the process exits 0 and every permit is back.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from fleetgate.keys import GateKeys
from fleetgate.tools.proxyproc import start_proxy_process, stop_process
from fleetgate.tools.sim._server import Served
from fleetgate.tools.sim._server import serve_in_thread as serve_app
from fleetgate.tools.sim.rerank import RerankSimConfig, build_app

from ..conftest import RedisUnderTest
from ._proxy import (
    gate_counts,
    rerank_worker,
    upstream_app,
    wait_idle,
    wait_until,
)

LIMIT = 4
GATE = "rerank"


def _configure(rut: RedisUnderTest, gate: str, floor: int, max_queued: int = 1000) -> None:
    """The gate's settings in Redis, as the coordinator would write them."""
    keys = GateKeys.of(rut.prefix, gate)
    with redis.Redis.from_url(rut.url) as r:
        r.hset(
            keys.cfg,
            mapping={
                "floor": floor,
                "ceiling": floor,
                "max_queued": max_queued,
                "lease_ms": 10_000,
                "waiter_ms": 5_000,
            },
        )


@pytest.fixture
def reranker() -> Iterator[Served]:
    """A reranker with room for LIMIT calls and no queue: the (LIMIT+1)-th gets 503."""
    cfg = RerankSimConfig(concurrency=LIMIT, queue_size=0, base_ms=40, per_passage_ms=0)
    with serve_app(build_app(cfg)) as served:
        yield served


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_proxies_and_a_python_worker_hold_the_cap(
    rut: RedisUnderTest, reranker: Served, tmp_path: Path
) -> None:
    _configure(rut, GATE, LIMIT)
    redis_args = ["--redis", rut.url, "--prefix", rut.prefix]
    toml = tmp_path / "proxy.toml"
    toml.write_text(
        f'[proxy]\nlisten = "127.0.0.1:0"\n\n[[routes]]\npath = "/v1/ranking"\n'
        f'upstream = "{reranker.url}"\ngate = "{GATE}"\n'
    )
    a, url_a = start_proxy_process(
        ["--upstream", reranker.url, "--gate", GATE, *redis_args], str(tmp_path / "a.log")
    )
    b, url_b = start_proxy_process(["--config", str(toml), *redis_args], str(tmp_path / "b.log"))
    ctx = mp.get_context("spawn")
    try:
        with ctx.Pool(1) as pool:
            worker = pool.apply_async(rerank_worker, (rut.url, rut.prefix, GATE, reranker.url, 60))

            async def through(url: str, users: int, calls: int) -> list[int]:
                limits = httpx.Limits(max_connections=users, max_keepalive_connections=users)
                async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:

                    async def user(u: int) -> list[int]:
                        codes = []
                        for c in range(calls):
                            body = {"query": {"text": "q"}, "passages": [{"text": f"{u}-{c}"}]}
                            codes.append((await http.post("/v1/ranking", json=body)).status_code)
                        return codes

                    done = await asyncio.gather(*(user(u) for u in range(users)))
                return [c for codes in done for c in codes]

            async def both() -> list[int]:
                results = await asyncio.gather(through(url_a, 24, 3), through(url_b, 24, 3))
                return [c for codes in results for c in codes]

            codes = asyncio.run(both())
            done = worker.get(timeout=90)
        stats = httpx.get(reranker.url + "/admin/stats").json()
        assert codes.count(200) == len(codes) == 144, sorted(set(codes))
        assert done["failed"] == 0
        assert stats["rejected"] == 0 and stats["timed_out"] == 0, stats
        assert stats["served"] == 144 + 60
        assert stats["peak_running"] <= LIMIT, stats  # the cap held across three processes
        assert stats["peak_running"] == LIMIT  # and was used
    finally:
        codes_a, codes_b = stop_process(a), stop_process(b)
    assert (codes_a, codes_b) == (0, 0)
    wait_idle(rut.url, rut.prefix, GATE)


@pytest.mark.timeout(60)
@pytest.mark.long
def test_sigterm_drains_requests_in_flight(rut: RedisUnderTest, tmp_path: Path) -> None:
    _configure(rut, "g", 2)
    with serve_app(upstream_app()) as up:
        proc, url = start_proxy_process(
            ["--upstream", up.url, "--gate", "g", "--redis", rut.url, "--prefix", rut.prefix],
            str(tmp_path / "p.log"),
        )
        try:

            async def scenario() -> tuple[list[int], float]:
                async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                    calls = [
                        asyncio.ensure_future(http.get(f"/work?tag={i}&ms=600")) for i in range(4)
                    ]
                    await asyncio.to_thread(
                        wait_until,
                        lambda: gate_counts(rut.url, rut.prefix, "g") == (2, 2),
                        10,
                        "2 running, 2 queued",
                    )
                    t0 = time.monotonic()
                    proc.send_signal(signal.SIGTERM)
                    answers = await asyncio.gather(*calls)
                    return [r.status_code for r in answers], time.monotonic() - t0

            codes, took = asyncio.run(scenario())
            assert codes == [200] * 4  # the queued ones too
            assert 0.6 < took < 5.0, took
            assert proc.wait(15) == 0
            with pytest.raises(httpx.ConnectError):
                httpx.get(url + "/healthz", timeout=2)
        finally:
            stop_process(proc)
        log = (tmp_path / "p.log").read_text()
        assert "draining" in log and "stopped" in log
        assert sorted(up.state.log.arrivals) == ["0", "1", "2", "3"]
    wait_idle(rut.url, rut.prefix, "g")
