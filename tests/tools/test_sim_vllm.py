"""The vLLM simulator, against the real served app (uvicorn on a free loopback port)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from fleetgate.tools.sim import FifoLimiter, QueueFull, Served, serve_in_thread
from fleetgate.tools.sim.vllm import (
    ServiceDist,
    VllmSim,
    VllmSimConfig,
    build_app,
    build_parser,
    config_from_args,
    main,
)

Serve = Callable[..., Served]
CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "hello there"}]}


@pytest.fixture
def serve() -> Iterator[Serve]:
    """Start simulators on demand; all are stopped at the end of the test."""
    with contextlib.ExitStack() as stack:

        def _serve(**kwargs: Any) -> Served:
            return stack.enter_context(serve_in_thread(build_app(VllmSimConfig(**kwargs))))

        yield _serve


async def scrape(client: httpx.AsyncClient) -> dict[str, Metric]:
    """GET /metrics and parse it with prometheus_client's own parser."""
    resp = await client.get("/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(resp.text)}


def total(
    families: dict[str, Metric], family: str, sample: str | None = None, **labels: str
) -> float:
    """Sum the samples of ``family`` (named ``sample``, default the family) matching labels."""
    name = sample or family
    return sum(
        s.value
        for s in families[family].samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


async def until(check: Callable[[], Awaitable[bool]], timeout: float = 5.0) -> None:
    """Poll ``check`` until it holds (fails the test after ``timeout`` seconds)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def stats(client: httpx.AsyncClient) -> dict[str, Any]:
    resp = await client.get("/admin/stats")
    assert resp.status_code == 200
    body: dict[str, Any] = resp.json()
    return body


async def wait_stats(client: httpx.AsyncClient, **want: int) -> dict[str, Any]:
    """Wait until /admin/stats shows every ``want`` value; return that snapshot."""
    seen: dict[str, Any] = {}

    async def check() -> bool:
        seen.update(await stats(client))
        return all(seen[k] == v for k, v in want.items())

    await until(check)
    return seen


async def test_capacity_enforced_and_excess_waits_by_reason_capacity(serve: Serve) -> None:
    srv = serve(capacity=4, engines=2, service_ms=300)
    async with httpx.AsyncClient(base_url=srv.url, timeout=10) as client:
        burst = [
            asyncio.create_task(client.post("/v1/chat/completions", json=CHAT)) for _ in range(12)
        ]
        await wait_stats(client, in_flight=12)
        fam = await scrape(client)
        assert total(fam, "vllm:num_requests_running") == 4
        assert total(fam, "vllm:num_requests_waiting") == 8
        assert total(fam, "vllm:num_requests_waiting_by_reason", reason="capacity") == 8
        assert total(fam, "vllm:num_requests_waiting_by_reason", reason="deferred") == 0
        # deterministic split over engines "0" and "1"
        assert total(fam, "vllm:num_requests_running", engine="0") == 2
        assert total(fam, "vllm:num_requests_waiting_by_reason", engine="1", reason="capacity") == 4
        assert [s.value for s in fam["vllm:kv_cache_usage_perc"].samples] == [1.0, 1.0]
        responses = await asyncio.gather(*burst)
        assert [r.status_code for r in responses] == [200] * 12
        done = await stats(client)
        assert done["peak_running"] == 4 and done["peak_in_flight"] == 12
        assert (done["served"], done["running"], done["waiting"]) == (12, 0, 0)
        fam = await scrape(client)
        assert (
            total(fam, "vllm:request_success", "vllm:request_success_total", finished_reason="stop")
            == 12
        )
        assert (
            total(fam, "vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_count")
            == 12
        )
        # 8 of the 12 waited at least one service time
        assert (
            total(fam, "vllm:request_queue_time_seconds", "vllm:request_queue_time_seconds_sum")
            >= 8 * 0.25
        )
        assert total(fam, "vllm:num_requests_waiting") == 0
        assert total(fam, "vllm:kv_cache_usage_perc") == 0


async def test_metrics_exposition_matches_vllm(serve: Serve) -> None:
    srv = serve(capacity=2, engines=3, service_ms=0, model="org/m-1")
    async with httpx.AsyncClient(base_url=srv.url) as client:
        body = {"model": "org/m-1", "prompt": "one two three four", "max_tokens": 5}
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        text = (await client.get("/metrics")).text
        fam = await scrape(client)
    for name, kind in [
        ("vllm:num_requests_running", "gauge"),
        ("vllm:num_requests_waiting", "gauge"),
        ("vllm:num_requests_waiting_by_reason", "gauge"),
        ("vllm:kv_cache_usage_perc", "gauge"),
        ("vllm:num_preemptions_total", "counter"),
        ("vllm:prompt_tokens_total", "counter"),
        ("vllm:generation_tokens_total", "counter"),
        ("vllm:request_success_total", "counter"),
        ("vllm:e2e_request_latency_seconds", "histogram"),
        ("vllm:request_queue_time_seconds", "histogram"),
    ]:
        assert f"# HELP {name} " in text
        assert f"# TYPE {name} {kind}\n" in text
    assert "vllm:gpu_cache_usage_perc" not in text
    for family in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        assert {s.labels["engine"] for s in fam[family].samples} == {"0", "1", "2"}
        assert {s.labels["model_name"] for s in fam[family].samples} == {"org/m-1"}
    assert total(fam, "vllm:prompt_tokens", "vllm:prompt_tokens_total") == 5  # 18 chars / 4
    assert total(fam, "vllm:generation_tokens", "vllm:generation_tokens_total") == 5
    assert (
        total(fam, "vllm:request_success", "vllm:request_success_total", finished_reason="length")
        == 1
    )
    assert fam["vllm:request_success_created"].type == "gauge"  # prometheus_client's _created
    assert "vllm:e2e_request_latency_seconds_bucket{" in text and 'le="7680.0"' in text


async def test_legacy_metrics_have_no_by_reason_and_gpu_cache_usage(serve: Serve) -> None:
    srv = serve(capacity=1, legacy_metrics=True)
    async with httpx.AsyncClient(base_url=srv.url) as client:
        fam = await scrape(client)
    assert "vllm:num_requests_waiting_by_reason" not in fam
    assert "vllm:kv_cache_usage_perc" not in fam
    assert fam["vllm:gpu_cache_usage_perc"].type == "gauge"
    assert "vllm:num_requests_waiting" in fam and "vllm:num_requests_running" in fam
    reasons = {s.labels["finished_reason"] for s in fam["vllm:request_success"].samples}
    assert reasons == {"stop", "length", "abort"}


async def test_capacity_change_at_run_time(serve: Serve) -> None:
    srv = serve(capacity=1, service_ms=400)
    async with httpx.AsyncClient(base_url=srv.url, timeout=10) as client:
        burst = [
            asyncio.create_task(client.post("/v1/embeddings", json={"input": "x"}))
            for _ in range(4)
        ]
        await wait_stats(client, running=1, waiting=3)
        grown = (await client.post("/admin/capacity", json={"capacity": 4})).json()
        assert (grown["capacity"], grown["running"], grown["waiting"]) == (4, 4, 0)
        shrunk = (await client.post("/admin/capacity", json={"capacity": 1})).json()
        assert (shrunk["capacity"], shrunk["running"]) == (1, 4)  # nothing killed
        late = asyncio.create_task(client.post("/v1/embeddings", json={"input": "y"}))
        await wait_stats(client, waiting=1)
        assert all(r.status_code == 200 for r in await asyncio.gather(*burst, late))
        reset = (await client.post("/admin/reset-peaks")).json()
        assert (reset["peak_running"], reset["peak_in_flight"], reset["served"]) == (0, 0, 5)
        bad = await client.post("/admin/capacity", json={"capacity": -1})
        assert bad.status_code == 400


async def test_max_waiting_answers_503(serve: Serve) -> None:
    srv = serve(capacity=1, max_waiting=2, service_ms=300)
    async with httpx.AsyncClient(base_url=srv.url, timeout=10) as client:
        first = [
            asyncio.create_task(client.post("/v1/chat/completions", json=CHAT)) for _ in range(3)
        ]
        await wait_stats(client, running=1, waiting=2)
        over = await client.post("/v1/chat/completions", json=CHAT)
        assert over.status_code == 503
        assert over.json()["error"]["code"] == 503
        assert [r.status_code for r in await asyncio.gather(*first)] == [200] * 3
        assert (await stats(client))["rejected"] == 1


async def test_client_disconnect_aborts_the_request(serve: Serve) -> None:
    srv = serve(capacity=1, service_ms=3000)
    async with httpx.AsyncClient(base_url=srv.url, timeout=10) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/v1/chat/completions", json=CHAT, timeout=0.2)
        after = await wait_stats(client, running=0, aborted=1)
        assert after["served"] == 0
        fam = await scrape(client)
        assert (
            total(
                fam, "vllm:request_success", "vllm:request_success_total", finished_reason="abort"
            )
            == 1
        )


async def test_openai_shapes_and_errors(serve: Serve) -> None:
    srv = serve(capacity=4, service_ms=0, embedding_dim=8)
    async with httpx.AsyncClient(base_url=srv.url) as client:
        chat = (await client.post("/v1/chat/completions", json=CHAT)).json()
        assert chat["object"] == "chat.completion" and chat["model"] == "sim-model"
        assert chat["choices"][0]["message"]["role"] == "assistant"
        assert chat["usage"]["total_tokens"] == chat["usage"]["prompt_tokens"] + 16
        comp = (
            await client.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 3})
        ).json()
        assert comp["object"] == "text_completion" and len(comp["choices"]) == 2
        assert comp["choices"][1]["finish_reason"] == "length"
        emb = (await client.post("/v1/embeddings", json={"input": ["a", "b", "c"]})).json()
        assert [d["index"] for d in emb["data"]] == [0, 1, 2]
        vec = emb["data"][0]["embedding"]
        assert len(vec) == 8 and abs(sum(v * v for v in vec) - 1.0) < 1e-9
        again = (await client.post("/v1/embeddings", json={"input": "a"})).json()
        assert again["data"][0]["embedding"] == vec  # deterministic per text
        models = (await client.get("/v1/models")).json()
        assert models["data"][0]["id"] == "sim-model"
        assert (await client.get("/health")).status_code == 200
        wrong = await client.post("/v1/chat/completions", json={**CHAT, "model": "other"})
        assert wrong.status_code == 404 and "other" in wrong.json()["error"]["message"]
        assert (await client.post("/v1/chat/completions", content=b"{")).status_code == 400
        no_msgs = await client.post("/v1/chat/completions", json={"messages": []})
        assert no_msgs.status_code == 400
        for max_tokens in (0, 10**9, "5"):
            body = {"prompt": "x", "max_tokens": max_tokens}
            too = await client.post("/v1/completions", json=body)
            assert too.status_code == 400


def test_service_time_distributions_and_occupancy() -> None:
    fixed = VllmSim(VllmSimConfig(service_ms=100, occupancy_slowdown=1.0, capacity=4))
    assert fixed.service_seconds() == pytest.approx(0.1)
    fixed.limiter.running = 2
    assert fixed.service_seconds() == pytest.approx(0.1 * (1 + 2 / 4))
    dists: tuple[ServiceDist, ...] = ("exp", "lognormal")
    for dist in dists:
        a = VllmSim(VllmSimConfig(service_ms=100, service_dist=dist, seed=7))
        b = VllmSim(VllmSimConfig(service_ms=100, service_dist=dist, seed=7))
        xs = [a.service_seconds() for _ in range(4000)]
        assert xs[:10] == [b.service_seconds() for _ in range(10)]
        assert sum(xs) / len(xs) == pytest.approx(0.1, rel=0.1)
    with pytest.raises(ValueError):
        VllmSimConfig(engines=0)


async def test_fifo_limiter_order_cancel_and_bound() -> None:
    lim = FifoLimiter(1, max_waiting=2)
    await lim.acquire()
    order: list[int] = []

    async def take(i: int) -> None:
        await lim.acquire()
        order.append(i)
        lim.release()

    first, second = asyncio.create_task(take(1)), asyncio.create_task(take(2))
    await asyncio.sleep(0)
    with pytest.raises(QueueFull):
        await lim.acquire()
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    assert lim.waiting == 1  # the cancelled waiter left the list
    lim.release()
    await second
    assert order == [2] and lim.running == 0 and lim.peak_in_flight == 3


def test_help_lists_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    """Every option the parser takes is in ``--help`` with a line of its own saying what it
    does (read from the parser, so a new option cannot be left out)."""
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    options = [a for a in build_parser()._actions if a.option_strings and a.dest != "help"]
    names = {s for a in options for s in a.option_strings}
    assert {"--capacity", "--prefill-ms", "--no-metrics"} <= names
    for action in options:
        assert action.help, f"{action.option_strings} has no help text"
        for name in action.option_strings:
            assert name in out


def test_cli_options_map_onto_the_config() -> None:
    ns = build_parser().parse_args(
        [
            "--port",
            "9",
            "--model",
            "m",
            "--max-num-seqs",
            "3",
            "--engines",
            "2",
            "--service-ms",
            "7.5",
            "--service-dist",
            "exp",
            "--occupancy-slowdown",
            "0.5",
            "--max-waiting",
            "4",
            "--legacy-metrics",
            "--seed",
            "1",
            "--embedding-dim",
            "4",
        ]
    )
    assert config_from_args(ns) == VllmSimConfig(
        model="m",
        capacity=3,
        engines=2,
        service_ms=7.5,
        service_dist="exp",
        occupancy_slowdown=0.5,
        max_waiting=4,
        legacy_metrics=True,
        seed=1,
        embedding_dim=4,
    )
    assert ns.port == 9 and ns.host == "127.0.0.1"


def test_python_dash_m_help() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "fleetgate.tools.sim.vllm", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0 and "--capacity" in done.stdout


# ---------------------------------------------------------------------------------- flavours


@pytest.mark.parametrize(
    ("flavor", "path", "running_name"),
    [
        ("sglang", "/metrics", "sglang:num_running_reqs"),
        ("tgi", "/metrics", "tgi_batch_current_size"),
        ("tei", "/metrics", None),
        ("llamacpp", "/metrics", "llamacpp:requests_processing"),
        ("trtllm", "/prometheus/metrics", "trtllm_num_requests_running"),
        ("nim", "/v1/metrics", "num_requests_running"),
    ],
)
async def test_flavours_serve_their_exposition_at_their_path(
    serve: Serve, flavor: str, path: str, running_name: str | None
) -> None:
    served = serve(flavor=flavor, capacity=2, service_ms=300)
    async with httpx.AsyncClient(base_url=served.url, timeout=5) as client:
        calls = [
            asyncio.create_task(client.post("/v1/chat/completions", json=CHAT)) for _ in range(3)
        ]
        await until(lambda: _in_flight(client, 3))
        resp = await client.get(path)
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
        names = {s.name: s for f in text_string_to_metric_families(resp.text) for s in f.samples}
        if running_name is not None:
            assert names[running_name].value == 2.0
        assert not any("vllm:" in n for n in names)
        if path != "/metrics":
            other = await client.get("/metrics")
            # trtllm-serve's /metrics is JSON iteration stats; NIM has nothing there.
            assert other.status_code == (200 if flavor == "trtllm" else 404)
            if flavor == "trtllm":
                assert other.json()[0]["numQueuedRequests"] == 1
        assert [r.status_code for r in await asyncio.gather(*calls)] == [200, 200, 200]


async def _in_flight(client: httpx.AsyncClient, n: int) -> bool:
    return bool((await stats(client))["in_flight"] == n)


@pytest.mark.parametrize("flavor", ["tgi", "tei"])
async def test_tgi_and_tei_answer_429_beyond_max_concurrent_requests(
    serve: Serve, flavor: str
) -> None:
    served = serve(flavor=flavor, capacity=1, service_ms=300, max_concurrent_requests=2)
    async with httpx.AsyncClient(base_url=served.url, timeout=5) as client:
        calls = [
            asyncio.create_task(client.post("/v1/chat/completions", json=CHAT)) for _ in range(2)
        ]
        await until(lambda: _in_flight(client, 2))
        refused = await client.post("/v1/chat/completions", json=CHAT)
        assert refused.status_code == 429
        body = refused.json()
        assert body == (
            {"message": "Model is overloaded", "code": 429, "type": "Overloaded"}
            if flavor == "tei"
            else {"error": "Model is overloaded", "error_type": "overloaded"}
        )
        assert [r.status_code for r in await asyncio.gather(*calls)] == [200, 200]
        text = (await client.get("/metrics")).text
        failure = "te_request_failure" if flavor == "tei" else "tgi_request_failure"
        assert f'{failure}{{err="overloaded"}} 1' in text
        assert (await stats(client))["rejected"] == 1


@pytest.mark.parametrize("flavor", ["vllm", "sglang", "trtllm", "nim"])
async def test_no_metrics(serve: Serve, flavor: str) -> None:
    served = serve(flavor=flavor, metrics=False)
    path = {"trtllm": "/prometheus/metrics", "nim": "/v1/metrics"}.get(flavor, "/metrics")
    async with httpx.AsyncClient(base_url=served.url, timeout=5) as client:
        assert (await client.get(path)).status_code == 404


def test_flavour_options() -> None:
    ns = build_parser().parse_args(
        ["--flavor", "tei", "--no-metrics", "--max-concurrent-requests", "3"]
    )
    cfg = config_from_args(ns)
    assert (cfg.flavor, cfg.metrics, cfg.concurrency_limit) == ("tei", False, 3)
    assert VllmSimConfig(flavor="tgi").concurrency_limit == 128
    assert VllmSimConfig(flavor="vllm").concurrency_limit is None
    with pytest.raises(ValueError, match="unknown flavor"):
        VllmSimConfig(flavor="triton")
    with pytest.raises(ValueError, match="TGI's and TEI's"):
        VllmSimConfig(flavor="vllm", max_concurrent_requests=4)
