"""A real Prometheus scrapes a coordinator and a worker; the fleetgate series arrive labelled.

Runs Debian's ``prometheus`` binary (``apt-get install prometheus``; its systemd service is not
used) on a free loopback port with a 1 s scrape interval, a coordinator in-process (its own loop
in a thread), a worker as a subprocess (``python -m fleetgate.tools.load``) and a vLLM simulator,
then asks Prometheus' HTTP API. Skips where the ``prometheus`` binary is absent.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from fleetgate.coordinator.config import Config
from fleetgate.coordinator.daemon import Coordinator
from fleetgate.tools.redisproc import free_port
from fleetgate.tools.sim import serve_in_thread, vllm

from ..conftest import RedisUnderTest

PROMETHEUS = shutil.which("prometheus")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(90),
    pytest.mark.skipif(
        PROMETHEUS is None,
        reason="the prometheus binary is not installed (Debian: apt-get install prometheus)",
    ),
]

ADAPTIVE, FIXED = "embed", "rerank/fixed"


@contextlib.contextmanager
def coordinator_in_thread(config: Config) -> Iterator[Coordinator]:
    """Run a Coordinator on its own event loop in a thread; stop it cleanly on exit."""
    coord = Coordinator(config, registry=CollectorRegistry(), coordinator_id="e2e")
    ready = threading.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        box["loop"], box["stop"] = asyncio.get_running_loop(), asyncio.Event()
        ready.set()
        await coord.run(box["stop"])

    def target() -> None:
        try:
            asyncio.run(main())
        except BaseException as exc:  # reported by the test, never lost
            box["error"] = exc
            ready.set()

    thread = threading.Thread(target=target, name="coordinator", daemon=True)
    thread.start()
    try:
        assert ready.wait(10), "coordinator loop did not start"
        wait_for(lambda: coord.metrics_port is not None or "error" in box, 10, "coordinator")
        assert "error" not in box, box["error"]
        yield coord
    finally:
        if "loop" in box and thread.is_alive():
            box["loop"].call_soon_threadsafe(box["stop"].set)
        thread.join(15)
        assert not thread.is_alive(), "coordinator did not stop"
        assert "error" not in box, box.get("error")


@contextlib.contextmanager
def process(argv: list[str], log: Path, stop_signal: int = signal.SIGTERM) -> Iterator[Any]:
    """Popen with output to ``log``; on exit signal, wait, kill if it lingers."""
    with log.open("wb") as out, subprocess.Popen(argv, stdout=out, stderr=out) as proc:
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.send_signal(stop_signal)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)


def wait_for(check: Any, timeout: float, what: str, interval: float = 0.1) -> None:
    end = time.monotonic() + timeout
    while not check():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def query(client: httpx.Client, promql: str) -> list[dict[str, Any]]:
    body = client.get("/api/v1/query", params={"query": promql}).json()
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else "(no log)"


def test_prometheus_scrapes_coordinator_and_worker(rut: RedisUnderTest, tmp_path: Path) -> None:
    assert PROMETHEUS is not None
    sim_config = vllm.VllmSimConfig(capacity=8, service_ms=20, model="e2e-model")
    with (
        serve_in_thread(vllm.build_app(sim_config)) as sim,
        coordinator_in_thread(
            Config.from_toml_text(
                f"""
[redis]
url = "{rut.url}"
prefix = "{rut.prefix}"
[coordinator]
poll_interval = 0.5
leader_ttl = 2.0
metrics_listen = "127.0.0.1:0"
scrape_timeout = 0.4
[[gates]]
name = "{ADAPTIVE}"
base_url = "{sim.url}/v1"
model_name = "e2e-model"
floor = 2
ceiling = 16
[[gates]]
name = "{FIXED}"
floor = 3
""",
                env={},
            )
        ) as coord,
    ):
        worker_port, prom_port = free_port(), free_port()
        prom_config = tmp_path / "prometheus.yml"
        prom_config.write_text(
            f"""
global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: fleetgate-coordinator
    static_configs:
      - targets: ["127.0.0.1:{coord.metrics_port}"]
  - job_name: fleetgate-worker
    static_configs:
      - targets: ["127.0.0.1:{worker_port}"]
"""
        )
        worker_argv = [
            sys.executable, "-m", "fleetgate.tools.load",
            "--redis", rut.url, "--prefix", rut.prefix,
            "--gate", ADAPTIVE, "--target-url", sim.url, "--kind", "vllm",
            "--rate", "40", "--concurrency", "4",
            "--metrics-listen", f"127.0.0.1:{worker_port}",
            "--duration", "80",
        ]  # fmt: skip
        prom_argv = [
            PROMETHEUS,
            f"--config.file={prom_config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
            "--log.level=warn",
        ]
        prom_log, worker_log = tmp_path / "prometheus.log", tmp_path / "worker.log"
        with (
            process(prom_argv, prom_log) as prom,
            process(worker_argv, worker_log) as worker,
            httpx.Client(base_url=f"http://127.0.0.1:{prom_port}", timeout=2.0) as api,
        ):

            def ready() -> bool:
                assert prom.poll() is None, f"prometheus exited:\n{tail(prom_log)}"
                assert worker.poll() is None, f"worker exited:\n{tail(worker_log)}"
                with contextlib.suppress(httpx.TransportError):
                    return api.get("/-/ready").status_code == 200
                return False

            wait_for(ready, 20, "prometheus /-/ready")

            seen: dict[str, list[dict[str, Any]]] = {}

            def arrived() -> bool:
                assert worker.poll() is None, f"worker exited:\n{tail(worker_log)}"
                seen["up"] = query(api, "up")
                seen["target"] = query(api, "fleetgate_coordinator_target")
                seen["leader"] = query(api, "fleetgate_coordinator_leader")
                seen["granted"] = query(
                    api, f'fleetgate_client_granted_total{{gate="{ADAPTIVE}"}} > 0'
                )
                seen["ok"] = query(
                    api, f'fleetgate_worker_requests_total{{gate="{ADAPTIVE}",outcome="ok"}} > 0'
                )
                up = {r["metric"]["job"]: r["value"][1] for r in seen["up"]}
                targets = {r["metric"].get("gate") for r in seen["target"]}
                leader = [r["value"][1] for r in seen["leader"]]
                return (
                    up == {"fleetgate-coordinator": "1", "fleetgate-worker": "1"}
                    and {ADAPTIVE, FIXED} <= targets
                    and leader == ["1"]
                    and bool(seen["granted"])
                    and bool(seen["ok"])
                )

            try:
                wait_for(arrived, 30, "fleetgate series in Prometheus", interval=0.25)
            except AssertionError as exc:
                raise AssertionError(
                    f"{exc}\nlast answers: {seen}\nprometheus log:\n{tail(prom_log)}\n"
                    f"worker log:\n{tail(worker_log)}"
                ) from None

            by_gate = {r["metric"]["gate"]: r for r in seen["target"]}
            adaptive, fixed = by_gate[ADAPTIVE], by_gate[FIXED]
            assert adaptive["metric"]["job"] == "fleetgate-coordinator"
            assert adaptive["metric"]["instance"] == f"127.0.0.1:{coord.metrics_port}"
            assert 2 <= float(adaptive["value"][1]) <= 16, adaptive
            assert float(fixed["value"][1]) == 3, fixed
            granted = seen["granted"][0]
            assert granted["metric"]["job"] == "fleetgate-worker"
            assert granted["metric"]["instance"] == f"127.0.0.1:{worker_port}"
            assert float(granted["value"][1]) > 0

            worker.send_signal(signal.SIGTERM)
            assert worker.wait(15) == 0, tail(worker_log)
        assert prom.returncode is not None
