"""The load generator (``fleetgate worker``, ``python -m fleetgate.tools.load``), as in compose."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from fleetgate.keys import GateKeys
from fleetgate.tools import load
from fleetgate.tools.redisproc import free_port
from fleetgate.tools.sim import rerank, serve_in_thread, vllm

from ..conftest import RedisUnderTest


def scrape(url: str) -> dict[tuple[str, ...], float]:
    """{(sample name, gate[, outcome]): value} of a /metrics page; {} while it does not answer."""
    try:
        text = httpx.get(url, timeout=1.0).text
    except httpx.TransportError:
        return {}
    return {
        (s.name, *(s.labels[k] for k in ("gate", "outcome") if k in s.labels)): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_worker_drives_gates_and_serves_client_metrics(rut: RedisUnderTest) -> None:
    embed, ranker = "embed", "rerank/sim"
    port = free_port()
    metrics_url = f"http://127.0.0.1:{port}/metrics"
    with (
        serve_in_thread(vllm.build_app(vllm.VllmSimConfig(capacity=4, service_ms=10))) as v,
        serve_in_thread(rerank.build_app(rerank.RerankSimConfig(concurrency=2))) as rr,
    ):
        argv = [
            sys.executable, "-m", "fleetgate.tools.load",
            "--redis", rut.url, "--prefix", rut.prefix,
            "--gate", embed, "--target-url", v.url, "--kind", "vllm",
            "--gate", ranker, "--target-url", rr.url + "/v1", "--kind", "rerank",
            "--rate", "40", "--concurrency", "4", "--floor", "2", "--passages", "8",
            "--batch-size", "4", "--metrics-listen", f"127.0.0.1:{port}",
            "--duration", "60", "--log-interval", "0.5",
        ]  # fmt: skip
        with subprocess.Popen(argv, stderr=subprocess.PIPE, text=True) as proc:
            try:
                wanted = [
                    *(("fleetgate_client_granted_total", g) for g in (embed, ranker)),
                    *(("fleetgate_worker_requests_total", g, "ok") for g in (embed, ranker)),
                ]
                found: dict[tuple[str, ...], float] = {}
                end = time.monotonic() + 20
                while not all(found.get(k, 0) > 0 for k in wanted):
                    assert proc.poll() is None, f"worker exited: {proc.communicate()[1]}"
                    assert time.monotonic() < end, f"no grants and calls on both gates: {found}"
                    time.sleep(0.1)
                    found = scrape(metrics_url)
                proc.send_signal(signal.SIGTERM)
                _, err = proc.communicate(timeout=15)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
        assert proc.returncode == 0, err
        assert f"{embed}: stopped after" in err and "Traceback" not in err, err
        stats = v.state.sim.stats()
        assert stats["served"] > 0
        assert stats["peak_running"] <= 2, stats  # the gate's floor capped the calls
    client = redis.Redis.from_url(rut.url)
    try:  # a clean stop leaves no lease behind
        assert client.zcard(GateKeys.of(rut.prefix, embed).holders) == 0
        assert client.zcard(GateKeys.of(rut.prefix, ranker).holders) == 0
    finally:
        client.close()


@pytest.mark.parametrize(
    "argv",
    [
        ["--gate", "g", "--gate", "h", "--target-url", "http://a/v1"],  # a URL missing
        ["--gate", "g", "--target-url", "http://a", "--kind", "vllm", "--kind", "rerank"],
        ["--gate", "g", "--gate", "g", "--target-url", "http://a", "--target-url", "http://b"],
        ["--gate", "g", "--target-url", "http://a", "--concurrency", "0"],
        ["--gate", "g", "--target-url", "http://a", "--metrics-listen", "nowhere"],
        ["--target-url", "http://a"],  # no gate
    ],
)
def test_worker_rejects_bad_arguments(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        load.main(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err
