"""The real coordinator against every simulator flavour: detected, read and acted on.

Each test starts ``fleetgate sim vllm --flavor X`` in-process, points one gate at its OpenAI base
URL with ``server = "auto"`` (so detection has to find the right path: ``/metrics``,
``trtllm-serve``'s ``/prometheus/metrics`` behind a JSON ``/metrics``, NIM's ``/v1/metrics``),
drives load through fleetgate permits into the simulator, and waits for a target the coordinator
published from that flavour's signals.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator

import httpx
import pytest
import redis.asyncio as aredis
from prometheus_client import CollectorRegistry

from fleetgate.client import Fleet
from fleetgate.coordinator.config import Config
from fleetgate.coordinator.daemon import Coordinator
from fleetgate.coordinator.scrape.adapters import ADAPTERS
from fleetgate.keys import GateKeys
from fleetgate.status import format_status, gather_status
from fleetgate.tools.sim import serve_in_thread
from fleetgate.tools.sim.flavors import FLAVORS
from fleetgate.tools.sim.vllm import VllmSimConfig, build_app

from ..conftest import RedisUnderTest
from ._coordinator import config_with, eventually, running
from .scrape._metrics_server import serve_metrics

MODEL = "sim-model"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}


def _config(rut: RedisUnderTest, base_url: str, server: str = "auto") -> Config:
    gate = f"""[[gates]]
name = "{MODEL}"
base_url = "{base_url}/v1"
server = "{server}"
floor = 2
ceiling = 64
"""
    return config_with(rut, gate)


@contextlib.asynccontextmanager
async def _load(rut: RedisUnderTest, url: str, workers: int) -> AsyncIterator[list[int]]:
    """``workers`` loops of permit -> POST to the simulator; yields the status codes seen."""
    statuses: list[int] = []
    stop = asyncio.Event()
    async with (
        Fleet(rut.url, prefix=rut.prefix, registry=CollectorRegistry()) as fleet,
        httpx.AsyncClient(base_url=url, timeout=10) as http,
    ):
        gate = fleet.gate(MODEL)

        async def worker() -> None:
            while not stop.is_set():
                async with gate.permit(deadline=30):
                    resp = await http.post("/v1/chat/completions", json=CHAT)
                    statuses.append(resp.status_code)

        tasks = [asyncio.create_task(worker()) for _ in range(workers)]
        try:
            yield statuses
        finally:
            stop.set()
            await asyncio.gather(*tasks)


@pytest.mark.parametrize("flavor", FLAVORS)
async def test_coordinator_publishes_from_each_flavour(
    rut: RedisUnderTest, async_redis: aredis.Redis, flavor: str
) -> None:
    keys = GateKeys.of(rut.prefix, MODEL)
    sim = VllmSimConfig(flavor=flavor, model=MODEL, capacity=6, service_ms=60)
    with serve_in_thread(build_app(sim)) as served:
        async with running(_config(rut, served.url)), _load(rut, served.url, 12):
            # Slow start from the floor on near-full load: a target from this flavour's signals.
            await eventually(lambda: async_redis.exists(keys.target), 10, "a published target")
            await eventually(
                lambda: _util_is(async_redis, keys, server=flavor, metrics_ok="1"),
                5,
                f"a snapshot read by the {flavor} adapter",
            )
            util = await async_redis.hgetall(keys.util)
            assert util["reason"] in {"slow_start", "increase", "decrease", "hold_idle", "clamp"}
            if flavor == "tei":
                assert util["running"] == ""  # TEI exports no in-flight gauge: unknown
            else:
                assert util["running"] != ""
            assert util["waiting_capacity"] != ""
            # Reported, not acted on: the simulator's vLLM counter (0, nothing preempted);
            # the other flavours export none, so unknown (empty), not 0.
            assert util["preemptions"] == ("0.0" if flavor == "vllm" else ""), flavor
            assert util["admission_rejections"] == ""
            # The URL shown is the one detection found (NIM /v1/metrics, TensorRT-LLM
            # /prometheus/metrics), not the first path probed.
            path = ADAPTERS[flavor].metrics_path
            assert util["metrics_url"] == served.url + path, (util["metrics_url"], path)


async def test_saturated_flavour_backs_off(rut: RedisUnderTest, async_redis: aredis.Redis) -> None:
    """llama.cpp with 4 slots and 16 callers: the ramp stops at the 4 slots /props states (no
    overshoot to find them); with 2 slots left, requests are deferred and the target comes
    down."""
    keys = GateKeys.of(rut.prefix, MODEL)
    sim = VllmSimConfig(flavor="llamacpp", model=MODEL, capacity=4, service_ms=80)
    with serve_in_thread(build_app(sim)) as served:
        async with running(_config(rut, served.url, server="llamacpp")), _load(rut, served.url, 16):
            await eventually(
                lambda: _util_is(async_redis, keys, current_target="4"), 10, "the stated 4 slots"
            )
            assert await async_redis.hget(keys.util, "saturated") == "0"
            assert await async_redis.hget(keys.util, "max_requests") == "4.0"  # from /props
            async with httpx.AsyncClient(base_url=served.url) as admin:
                (await admin.post("/admin/capacity", json={"capacity": 2})).raise_for_status()
            await eventually(
                lambda: _util_is(async_redis, keys, reason="decrease", saturated="1"),
                10,
                "a decrease on deferred requests",
            )


async def test_no_metrics_is_unknown_and_named(
    rut: RedisUnderTest, async_redis: aredis.Redis
) -> None:
    keys = GateKeys.of(rut.prefix, MODEL)
    with serve_in_thread(build_app(VllmSimConfig(flavor="sglang", metrics=False))) as served:
        async with running(_config(rut, served.url)):
            await eventually(lambda: async_redis.exists(keys.util), 5, "a snapshot")
            util = await async_redis.hgetall(keys.util)
            assert util["metrics_ok"] == "0" and util["server"] == ""
            assert "server kind not detected" in util["error"] and "HTTP 404" in util["error"]
            assert await async_redis.hget(keys.target, "value") is None  # no target published


@pytest.mark.parametrize("answer", ["html", "json"])
async def test_a_named_server_answered_by_no_metrics_is_a_scrape_error(
    rut: RedisUnderTest,
    async_redis: aredis.Redis,
    caplog: pytest.LogCaptureFixture,
    answer: str,
) -> None:
    """``server = "vllm"`` at a URL that answers 200 with an HTML page, or with trtllm-serve's
    JSON ``/metrics``: a scrape error (metrics_ok 0, the reason in the snapshot, the log and
    the scrape_errors counter) and the target held, as for any unreadable /metrics. Before:
    metrics_ok 1 and no error anywhere (``auto`` did say it)."""
    caplog.set_level(logging.WARNING, logger="fleetgate.coordinator")
    keys = GateKeys.of(rut.prefix, MODEL)
    with contextlib.ExitStack() as stack:
        if answer == "html":
            url = stack.enter_context(serve_metrics()) + "/html"
        else:
            served = stack.enter_context(serve_in_thread(build_app(VllmSimConfig(flavor="trtllm"))))
            url = served.url + "/metrics"
        gate = f'[[gates]]\nname = "{MODEL}"\nmetrics_url = "{url}"\nserver = "vllm"\nfloor = 2\n'
        async with running(config_with(rut, gate)) as coord:
            await eventually(lambda: async_redis.exists(keys.util), 5, "a snapshot")
            await eventually(lambda: _scrape_errors(coord) >= 2, 5, "two failed scrapes")
            util = await async_redis.hgetall(keys.util)
            assert util["metrics_ok"] == "0" and util["server"] == "vllm"
            assert f"{url}: no vllm metrics" in util["error"]
            what = "an HTML page ('Sign in - Model Gateway')" if answer == "html" else "JSON"
            assert f"the body is {what}, not Prometheus text" in util["error"], util["error"]
            assert util["reason"] in {"hold_unknown", "reset"}
            assert await async_redis.hget(keys.target, "value") is None  # nothing published
            # `fleetgate status` says it under the gate's row
            [row] = [g for g in (await gather_status(async_redis, rut.prefix)).gates]
            assert row.metrics_error is not None and "no vllm metrics" in row.metrics_error
            text = format_status(await gather_status(async_redis, rut.prefix), time.time())
            assert f"  metrics unusable: {url}: no vllm metrics" in text, text
    logged = [r.getMessage() for r in caplog.records if "metrics unusable" in r.getMessage()]
    assert logged and "no vllm metrics" in logged[0]


def _scrape_errors(coord: Coordinator) -> float:
    value = coord.registry.get_sample_value(
        "fleetgate_coordinator_scrape_errors_total", {"gate": MODEL}
    )
    return value or 0.0


async def _util_is(r: aredis.Redis, keys: GateKeys, **want: str) -> bool:
    util = await r.hgetall(keys.util)
    return all(util.get(k) == v for k, v in want.items())


@pytest.mark.long
async def test_latency_controller_drives_a_server_without_metrics(
    rut: RedisUnderTest, async_redis: aredis.Redis
) -> None:
    """``--no-metrics``: no gauge at all. The gate has no metrics source, so the coordinator
    drives it from what the callers report (gate.map classifies each call): slow start from
    the floor, then the latency rise past the capacity (a FIFO of 8 slots) stops it near 8."""
    name = "observed"
    keys = GateKeys.of(rut.prefix, name)
    cfg = Config.from_toml_text(
        f"""
[redis]
url = "{rut.url}"
prefix = "{rut.prefix}"
[coordinator]
poll_interval = 0.5
poll_jitter = 0.0
leader_ttl = 2.0
metrics_listen = "127.0.0.1:0"
[[gates]]
name = "{name}"
floor = 2
ceiling = 64
""",
        env={},
    )
    sim = VllmSimConfig(model=MODEL, capacity=8, service_ms=40, metrics=False, max_waiting=8)
    stop = asyncio.Event()
    targets: list[int] = []
    with serve_in_thread(build_app(sim)) as served:
        async with (
            running(cfg),
            Fleet(rut.url, prefix=rut.prefix, registry=CollectorRegistry()) as fleet,
            httpx.AsyncClient(base_url=served.url, timeout=10) as http,
        ):
            gate = fleet.gate(name, floor=2, ceiling=64)

            async def call(_: int) -> httpx.Response:
                return await http.post("/v1/chat/completions", json=CHAT)

            async def worker() -> None:
                while not stop.is_set():
                    await gate.map(call, range(4), retry=False, return_exceptions=True)

            tasks = [asyncio.create_task(worker()) for _ in range(8)]  # up to 32 callers
            try:
                for _ in range(40):  # 20 s at most
                    await asyncio.sleep(0.5)
                    target = await async_redis.hget(keys.target, "value")
                    if target is not None:
                        targets.append(int(target))
                    if len(targets) >= 12 and max(targets) >= 8:
                        break
            finally:
                stop.set()
                await asyncio.gather(*tasks)
            util = await async_redis.hgetall(keys.util)
            obs = await async_redis.hgetall(keys.obs)
            status = await gather_status(async_redis, rut.prefix)
    assert targets and max(targets) >= 8, targets  # grew past the floor to the capacity
    # and came back near it, far below the ceiling (64): a FIFO of 8, 503 past 8 more waiting
    assert 4 <= targets[-1] <= 24, (targets, sorted(util.items()))
    assert util["signal"] == "latency" and util["latency_no_load"] != ""
    # `fleetgate status` shows what drives the gate
    [row] = [g for g in status.gates if g.name == name]
    assert row.signal == "latency" and row.latency_no_load is not None and row.latency_no_load > 0
    assert row.obs_calls is not None
    assert re.search(
        r"observed: latency p50 \d+ ms, no-load \d+ ms; last poll \d+ calls",
        format_status(status, time.time()),
    )
    assert int(obs["ok"]) > 100 and int(obs["lat_n"]) == int(obs["ok"])
