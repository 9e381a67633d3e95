"""``fleetgate proxy --workers N``: N OS processes behind one listening port, one Fleet each.

Each test runs the proxy as the CLI does (``fleetgate proxy ... --workers 2``, a parent and two
worker processes) against a real redis-server and the tests' upstream on a thread:

* requests are served by both workers (the ``pid`` labels of the client gauges in ``/metrics``,
  prometheus-client's multiprocess mode) and the fleet-wide cap holds across them (the upstream's
  peak concurrency is the gate's limit, never above it);
* ``/metrics`` sums the workers' counters (every request counted once, whichever worker took it)
  and ``/healthz`` speaks for all workers (how many are live, fallback in any of them);
* SIGTERM to the parent drains the requests in flight and queued in every worker, then all exit 0;
* a worker that dies is logged and replaced (a new pid), and the proxy goes on serving;
* ``[proxy] workers`` in the TOML, ``--workers`` over it, and ``--help`` says what it does.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from fleetgate.keys import GateKeys
from fleetgate.proxy.config import ProxyConfig
from fleetgate.tools.proxyproc import start_proxy_process, stop_process
from fleetgate.tools.sim._server import Served
from fleetgate.tools.sim._server import serve_in_thread as serve_app

from ..conftest import RedisUnderTest
from ._proxy import gate_counts, upstream_app, upstream_log, wait_idle, wait_until

GATE = "g"


def _configure(rut: RedisUnderTest, limit: int) -> None:
    """The gate's settings in Redis, as the coordinator would write them."""
    with redis.Redis.from_url(rut.url) as r:
        r.hset(
            GateKeys.of(rut.prefix, GATE).cfg,
            mapping={"floor": limit, "ceiling": limit, "max_queued": 1000, "lease_ms": 10_000,
                     "waiter_ms": 5_000},
        )  # fmt: skip


def _children(pid: int) -> set[int]:
    """The pids of ``pid``'s child processes (Linux: /proc)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return {int(p) for p in f.read().split()}


@contextlib.contextmanager
def _proxy(
    rut: RedisUnderTest, up: Served, tmp_path: Path, workers: int = 2
) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    log = tmp_path / "proxy.log"
    args = ["--upstream", up.url, "--gate", GATE, "--redis", rut.url, "--prefix", rut.prefix]
    proc, url = start_proxy_process([*args, "--workers", str(workers)], str(log))
    try:
        yield proc, url, log
    finally:
        stop_process(proc, timeout=30)


def _families(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """``/metrics`` of the proxy: sample name -> [(labels, value)]."""
    text = httpx.get(url + "/metrics", timeout=5).text
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def _served_pids(url: str) -> set[str]:
    """The workers that granted a permit: the ``pid`` labels of ``fleetgate_client_in_flight``
    (a series appears in a worker's file on its first grant)."""
    return {labels["pid"] for labels, _ in _families(url).get("fleetgate_client_in_flight", [])}


def _requests_counted(url: str, status: str = "200") -> float:
    samples = _families(url).get("fleetgate_proxy_requests_total", [])
    return sum(v for labels, v in samples if labels.get("status") == status)


async def _calls(url: str, n: int, ms: int) -> list[int]:
    """``n`` concurrent calls, each on a connection of its own (so the kernel spreads them over
    the workers' listeners)."""

    async def one(i: int) -> int:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            return (await http.get(f"/work?tag={i}&ms={ms}")).status_code

    return list(await asyncio.gather(*(one(i) for i in range(n))))


@pytest.fixture
def up() -> Iterator[Served]:
    with serve_app(upstream_app()) as served:
        yield served


@pytest.mark.timeout(90)
def test_two_workers_share_the_port_and_the_cap(
    rut: RedisUnderTest, up: Served, tmp_path: Path
) -> None:
    limit = 3
    _configure(rut, limit)
    with _proxy(rut, up, tmp_path) as (proc, url, _):
        assert len(_children(proc.pid)) == 2
        codes: list[int] = []
        for _ in range(3):  # 3 waves of 24 callers on fresh connections
            codes += asyncio.run(_calls(url, 24, 40))
        assert codes == [200] * 72
        log = upstream_log(up)
        assert log.peak == limit, log.peak  # the fleet-wide cap held across both workers, used
        assert len(_served_pids(url)) == 2, _served_pids(url)  # both workers took permits
        # the counters of both workers, summed by the multiprocess collector: each request once
        wait_until(lambda: _requests_counted(url) == 72, 5, "72 requests counted in /metrics")
        workers = _families(url)["fleetgate_proxy_workers"]
        assert [v for _, v in workers] == [2.0], workers
        health = httpx.get(url + "/healthz", timeout=5)
        assert health.status_code == 200
        body = health.json()
        assert body["status"] == "ok" and body["fallback"] is False
        assert body["workers"] == {"configured": 2, "live": 2}
        # the workers share one Via name: a request coming back is a loop whichever worker
        # takes it
        vias = {httpx.get(url + "/work?ms=1", timeout=5).headers["via"] for _ in range(20)}
        assert len(vias) == 1, vias
    wait_idle(rut.url, rut.prefix, GATE)


@pytest.mark.timeout(90)
@pytest.mark.long
def test_sigterm_drains_every_worker(rut: RedisUnderTest, up: Served, tmp_path: Path) -> None:
    limit = 4
    _configure(rut, limit)
    with _proxy(rut, up, tmp_path) as (proc, url, log):
        pids = _children(proc.pid)

        async def scenario() -> tuple[list[int], float, dict[str, float]]:
            calls = asyncio.ensure_future(_calls(url, 12, 600))
            await asyncio.to_thread(
                wait_until,
                lambda: gate_counts(rut.url, rut.prefix, GATE) == (limit, 12 - limit),
                10,
                "4 running, 8 queued",
            )
            # what each worker holds or has queued: both have some of the 12
            per_pid: dict[str, float] = {}
            fams = await asyncio.to_thread(_families, url)
            for name in ("fleetgate_client_in_flight", "fleetgate_client_queue_depth"):
                for labels, v in fams.get(name, []):
                    per_pid[labels["pid"]] = per_pid.get(labels["pid"], 0.0) + v
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            codes = await calls
            return codes, time.monotonic() - t0, per_pid

        codes, took, per_pid = asyncio.run(scenario())
        assert codes == [200] * 12  # the queued ones too, in both workers
        assert sorted(per_pid.values())[0] >= 1 and len(per_pid) == 2, per_pid
        assert 0.6 < took < 10.0, took
        assert proc.wait(20) == 0
        for pid in pids:  # every worker is gone
            assert not Path(f"/proc/{pid}").exists() or _zombie(pid), pid
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/healthz", timeout=2)
    text = log.read_text()
    assert text.count("draining") >= 2 and text.count("stopped") >= 2, text[-3000:]
    assert sorted(upstream_log(up).arrivals, key=int) == [str(i) for i in range(12)]
    wait_idle(rut.url, rut.prefix, GATE)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.timeout(90)
@pytest.mark.long
def test_a_dead_worker_is_logged_and_replaced(
    rut: RedisUnderTest, up: Served, tmp_path: Path
) -> None:
    _configure(rut, 4)
    with _proxy(rut, up, tmp_path) as (proc, url, log):
        before = _children(proc.pid)
        victim = min(before)
        os.kill(victim, signal.SIGKILL)
        wait_until(
            lambda: len(_children(proc.pid)) == 2 and victim not in _children(proc.pid),
            20,
            "a new worker in place of the killed one",
        )

        def two_live() -> bool:
            return bool(httpx.get(url + "/healthz", timeout=5).json()["workers"]["live"] == 2)

        wait_until(two_live, 20, "/healthz: 2 live workers")
        codes = asyncio.run(_calls(url, 16, 20))
        assert codes == [200] * 16
        assert proc.poll() is None
    text = log.read_text()
    assert f"worker pid {victim}" in text and "SIGKILL" in text, text[-3000:]


def test_workers_in_the_toml_and_on_the_command_line(tmp_path: Path) -> None:
    from fleetgate.proxy.main import config_from_args

    toml = tmp_path / "p.toml"
    toml.write_text('[proxy]\nworkers = 3\n\n[[routes]]\nupstream = "http://u:1"\ngate = "g"\n')
    assert ProxyConfig.from_toml_text(toml.read_text(), env={}).proxy.workers == 3
    assert ProxyConfig.from_mapping({"routes": [{"upstream": "http://u:1", "gate": "g"}]},
                                    env={}).proxy.workers == 1  # fmt: skip

    from fleetgate.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["proxy", "--config", str(toml), "--workers", "2"])
    assert config_from_args(args).proxy.workers == 2
    args = parser.parse_args(["proxy", "--config", str(toml)])
    assert config_from_args(args).proxy.workers == 3
    args = parser.parse_args(["proxy", "--upstream", "http://u:1", "--gate", "g", "--workers", "4"])
    assert config_from_args(args).proxy.workers == 4
    with pytest.raises(SystemExit):
        parser.parse_args(["proxy", "--upstream", "http://u:1", "--gate", "g", "--workers", "0"])
    helptext = subprocess.run(
        [sys.executable, "-m", "fleetgate.cli", "proxy", "--help"],
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout  # fmt: skip
    assert "--workers N" in helptext and "SO_REUSEPORT" in helptext, helptext


def test_each_worker_buffers_its_share_of_max_buffered_bytes(tmp_path: Path) -> None:
    """The bound on buffered request bodies stays the proxy's: each of N workers gets 1/N of
    ``max_buffered_bytes`` (at least ``max_request_bytes``); the workers are told their number
    and share one Via name."""
    from fleetgate.proxy.workers import Supervisor

    mib = 1024 * 1024
    raw = {
        "proxy": {"listen": "127.0.0.1:0", "workers": 4, "max_buffered_bytes": 64 * mib,
                  "max_request_bytes": 4 * mib},
        "routes": [{"upstream": "http://u:1", "gate": "g"}],
    }  # fmt: skip
    sup = Supervisor(ProxyConfig.from_mapping(raw, env={}), str(tmp_path), None)
    try:
        brief = sup.brief
        assert sup.port > 0 and sup.url == f"http://127.0.0.1:{sup.port}"
        assert brief["config"]["proxy"]["max_buffered_bytes"] == 16 * mib
        assert brief["workers"] == 4 and str(brief["via_name"]).startswith("fleetgate-")
        worker_config = ProxyConfig.from_mapping(brief["config"], env={})  # round trip
        assert worker_config.routes[0].upstream == "http://u:1"
        raw["proxy"]["max_buffered_bytes"] = 8 * mib  # 2 MiB each: below max_request_bytes
        small = Supervisor(ProxyConfig.from_mapping(raw, env={}), str(tmp_path), None)
        small.close()
        assert small.brief["config"]["proxy"]["max_buffered_bytes"] == 4 * mib
    finally:
        sup.close()
