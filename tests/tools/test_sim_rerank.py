"""The reranker simulator, against the real served app (uvicorn on a free loopback port)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from fleetgate.tools.sim import Served, serve_in_thread
from fleetgate.tools.sim.rerank import (
    RerankSim,
    RerankSimConfig,
    build_app,
    build_parser,
    config_from_args,
    main,
    score,
)

MODEL = RerankSimConfig.model


@pytest.fixture
def serve() -> Iterator[Any]:
    """Start simulators on demand; all are stopped at the end of the test."""
    with contextlib.ExitStack() as stack:

        def _serve(**kwargs: Any) -> Served:
            return stack.enter_context(serve_in_thread(build_app(RerankSimConfig(**kwargs))))

        yield _serve


def ranking_body(n: int, query: str = "red apple pie") -> dict[str, Any]:
    texts = ["apple pie recipe", "red car", "pie chart", "red apple pie with cream", "weather"]
    passages = [{"text": f"{texts[i % len(texts)]} #{i}"} for i in range(n)]
    return {"model": MODEL, "query": {"text": query}, "passages": passages, "truncate": "END"}


async def stats(client: httpx.AsyncClient) -> dict[str, Any]:
    body: dict[str, Any] = (await client.get("/admin/stats")).json()
    return body


async def wait_stats(client: httpx.AsyncClient, **want: int) -> dict[str, Any]:
    """Poll /admin/stats until every ``want`` value shows; return that snapshot."""
    deadline = asyncio.get_running_loop().time() + 5.0
    while True:
        seen = await stats(client)
        if all(seen[k] == v for k, v in want.items()):
            return seen
        assert asyncio.get_running_loop().time() < deadline, f"stats stuck at {seen}"
        await asyncio.sleep(0.01)


async def scrape(client: httpx.AsyncClient) -> dict[str, Metric]:
    text = (await client.get("/metrics")).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def outcome(families: dict[str, Metric], name: str) -> float:
    return sum(
        s.value
        for s in families["nim_rerank_requests"].samples
        if s.name == "nim_rerank_requests_total" and s.labels["outcome"] == name
    )


async def test_rankings_sorted_and_indices_a_permutation(serve: Any) -> None:
    srv = serve(base_ms=0, per_passage_ms=0)
    async with httpx.AsyncClient(base_url=srv.url) as client:
        resp = await client.post("/v1/ranking", json=ranking_body(25))
        again = await client.post("/v1/ranking", json=ranking_body(25))
    assert resp.status_code == 200
    rankings = resp.json()["rankings"]
    assert sorted(r["index"] for r in rankings) == list(range(25))
    logits = [r["logit"] for r in rankings]
    assert logits == sorted(logits, reverse=True)
    assert again.json() == resp.json()  # deterministic
    assert rankings[0]["index"] % 5 == 3  # the passage sharing every query word wins


async def test_over_max_batch_size_is_400(serve: Any) -> None:
    srv = serve(max_batch_size=8, base_ms=0, per_passage_ms=0)
    async with httpx.AsyncClient(base_url=srv.url) as client:
        ok = await client.post("/v1/ranking", json=ranking_body(8))
        over = await client.post("/v1/ranking", json=ranking_body(9))
        empty = await client.post("/v1/ranking", json=ranking_body(0))
        no_query = await client.post("/v1/ranking", json={"passages": [{"text": "a"}]})
        wrong_model = await client.post("/v1/ranking", json={**ranking_body(1), "model": "x"})
        fam = await scrape(client)
    assert ok.status_code == 200
    assert over.status_code == 400
    message = over.json()["error"]["message"]
    assert "9 passages" in message and "max_batch_size 8" in message
    assert empty.status_code == 400
    assert no_query.status_code == 400 and "query" in no_query.json()["error"]["message"]
    assert wrong_model.status_code == 404
    assert outcome(fam, "bad_request") == 4 and outcome(fam, "ok") == 1


async def test_full_queue_answers_503_at_once(serve: Any) -> None:
    srv = serve(concurrency=1, queue_size=1, base_ms=300, per_passage_ms=0)
    async with httpx.AsyncClient(base_url=srv.url, timeout=10) as client:
        held = [
            asyncio.create_task(client.post("/v1/ranking", json=ranking_body(2))) for _ in range(2)
        ]
        await wait_stats(client, running=1, waiting=1)
        fam = await scrape(client)
        assert fam["nim_rerank_requests_running"].samples[0].value == 1
        assert fam["nim_rerank_requests_waiting"].samples[0].value == 1
        full = await client.post("/v1/ranking", json=ranking_body(2))
        assert full.status_code == 503
        assert [r.status_code for r in await asyncio.gather(*held)] == [200, 200]
        final = await stats(client)
    assert (final["rejected"], final["served"], final["peak_running"]) == (1, 2, 1)


async def test_request_timeout_answers_504(serve: Any) -> None:
    srv = serve(concurrency=1, queue_size=10, request_timeout_ms=250, base_ms=150, per_passage_ms=0)
    async with httpx.AsyncClient(base_url=srv.url, timeout=10) as client:
        responses = await asyncio.gather(
            *(client.post("/v1/ranking", json=ranking_body(1)) for _ in range(3))
        )
        codes = sorted(r.status_code for r in responses)
        assert codes == [200, 504, 504]
        late = next(r for r in responses if r.status_code == 504)
        assert "250 ms" in late.json()["error"]["message"]
        final = await wait_stats(client, running=0, waiting=0)
        fam = await scrape(client)
    assert final["timed_out"] == 2 and final["peak_running"] == 1
    assert outcome(fam, "timeout") == 2 and outcome(fam, "ok") == 1


async def test_ungated_burst_times_out_gated_burst_succeeds(serve: Any) -> None:
    """A burst past the queue's drain time fails; gating it fixes that."""
    srv = serve(
        concurrency=4, queue_size=1000, request_timeout_ms=450, base_ms=80, per_passage_ms=2
    )  # 100 ms per 10-passage call, 4 at once
    async with httpx.AsyncClient(base_url=srv.url, timeout=10) as client:
        ungated = await asyncio.gather(
            *(client.post("/v1/ranking", json=ranking_body(10)) for _ in range(40))
        )
        codes = [r.status_code for r in ungated]
        assert 503 not in codes
        assert 8 <= codes.count(200) <= 20 and codes.count(504) >= 20
        gate = asyncio.Semaphore(4)

        async def gated() -> int:
            async with gate:
                return (await client.post("/v1/ranking", json=ranking_body(10))).status_code

        assert await asyncio.gather(*(gated() for _ in range(40))) == [200] * 40
        assert (await stats(client))["peak_running"] == 4


async def test_admin_capacity_and_peaks(serve: Any) -> None:
    srv = serve(concurrency=1, queue_size=10, base_ms=300, per_passage_ms=0)
    async with httpx.AsyncClient(base_url=srv.url, timeout=10) as client:
        calls = [
            asyncio.create_task(client.post("/v1/ranking", json=ranking_body(1))) for _ in range(3)
        ]
        await wait_stats(client, running=1, waiting=2)
        grown = (await client.post("/admin/capacity", json={"capacity": 3})).json()
        assert (grown["running"], grown["waiting"], grown["peak_in_flight"]) == (3, 0, 3)
        assert [r.status_code for r in await asyncio.gather(*calls)] == [200] * 3
        reset = (await client.post("/admin/reset-peaks")).json()
        assert (reset["peak_running"], reset["peak_in_flight"]) == (0, 0)
        assert (await client.get("/health")).status_code == 200


def test_service_time_grows_with_passages() -> None:
    sim = RerankSim(RerankSimConfig(base_ms=20, per_passage_ms=0.5))
    assert sim.service_seconds(0) == pytest.approx(0.020)
    assert sim.service_seconds(512) == pytest.approx(0.020 + 0.256)
    assert score("a b", "a b") > score("a b", "c d")
    assert score("q", "p") == score("q", "p")
    with pytest.raises(ValueError):
        RerankSimConfig(queue_size=-1)


def test_help_lists_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    """Every option the parser takes is in ``--help`` with a line of its own saying what it
    does (read from the parser, so a new option cannot be left out)."""
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    options = [a for a in build_parser()._actions if a.option_strings and a.dest != "help"]
    names = {s for a in options for s in a.option_strings}
    assert {"--max-batch-size", "--per-passage-ms"} <= names
    for action in options:
        assert action.help, f"{action.option_strings} has no help text"
        for name in action.option_strings:
            assert name in out


def test_cli_options_map_onto_the_config() -> None:
    ns = build_parser().parse_args(
        [
            "--model",
            "m",
            "--max-batch-size",
            "64",
            "--concurrency",
            "2",
            "--queue-size",
            "5",
            "--request-timeout-ms",
            "900",
            "--base-ms",
            "3",
            "--per-passage-ms",
            "0.25",
        ]
    )
    assert config_from_args(ns) == RerankSimConfig(
        model="m",
        max_batch_size=64,
        concurrency=2,
        queue_size=5,
        request_timeout_ms=900,
        base_ms=3,
        per_passage_ms=0.25,
    )


def test_python_dash_m_help() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "fleetgate.tools.sim.rerank", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0 and "--queue-size" in done.stdout


async def test_a_caller_gone_before_its_body_counts_as_aborted(
    serve: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A caller that hangs up before its body arrived (an ungated burst's timeouts): counted as
    aborted, no ASGI error logged (it was 'Exception in ASGI application' with a traceback)."""
    srv = serve(concurrency=4)
    host, port = srv.url.removeprefix("http://").split(":")
    _reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /v1/ranking HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 1000\r\n\r\n{"model":'
    )
    await writer.drain()
    await asyncio.sleep(0.1)
    writer.close()
    await writer.wait_closed()
    async with httpx.AsyncClient(base_url=srv.url, timeout=10) as client:
        await wait_stats(client, aborted=1)
    assert not [r for r in caplog.records if "Exception in ASGI application" in r.getMessage()]
