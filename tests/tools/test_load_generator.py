"""The load generator (``fleetgate worker``, ``python -m fleetgate.tools.load``), as in compose."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from typing import Any

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


@pytest.mark.long
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


class _StreamFlags:
    """ASGI middleware: records, per request to a ``/v1/...completions`` path, whether its JSON
    body asked for a streamed reply."""

    def __init__(self, app: Any, seen: list[bool]) -> None:
        self.app, self.seen = app, seen

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].endswith("completions"):
            await self.app(scope, receive, send)
            return
        body = b""

        async def recorded() -> Any:
            nonlocal body
            message = await receive()
            if message["type"] != "http.request":
                return message  # e.g. the server watching for a disconnect
            body += message.get("body", b"")
            if not message.get("more_body"):
                self.seen.append(json.loads(body).get("stream") is True)
            return message

        await self.app(scope, recorded, send)


@pytest.mark.parametrize("kind", ["vllm", "chat"])
def test_worker_streams_when_asked(rut: RedisUnderTest, kind: str) -> None:
    """``--stream``: every completion or chat call asks for SSE and is read to its [DONE] inside
    the permit (a reply cut short would count as an error, not ok)."""
    app = vllm.build_app(vllm.VllmSimConfig(capacity=4, service_ms=5))
    seen: list[bool] = []
    app.add_middleware(_StreamFlags, seen=seen)
    with serve_in_thread(app) as v:
        code = load.main(
            [
                "--redis", rut.url, "--prefix", rut.prefix, "--gate", "s",
                "--target-url", v.url, "--kind", kind, "--stream", "--rate", "0",
                "--concurrency", "2", "--duration", "1.5", "--log-interval", "0",
                "--metrics-listen", f"127.0.0.1:{free_port()}",
            ]
        )  # fmt: skip
    assert code == 0
    assert seen and all(seen), seen  # every call asked for a stream
    assert 0 < v.state.sim.stats()["served"] <= len(seen)  # the last may be cut by the stop


def test_the_worker_serves_its_metrics_on_loopback_by_default() -> None:
    """As every other listener of fleetgate (proxy, coordinator, simulators): 0.0.0.0 only
    when asked, as docker-compose and the manifests do."""
    from fleetgate.tools.load import build_parser

    ns = build_parser().parse_args(["--gate", "g", "--target-url", "http://a"])
    assert ns.metrics_listen == ("127.0.0.1", 9100)
