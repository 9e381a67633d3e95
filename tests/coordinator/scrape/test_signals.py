"""Metrics URLs, the bounded scrape (against a real local HTTP server) and the vLLM parser."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetgate.coordinator.scrape.signals import (
    ADAPTERS,
    VLLM,
    Signals,
    combine,
    derive_metrics_url,
    fetch_signals,
    get_adapter,
    parse_signals,
    scrape,
    validate_metrics_url,
)
from fleetgate.errors import ConfigError

# A vLLM (V1, 2026) exposition: process metrics first, two models, two engines each, the
# `_by_reason` gauge, counters with `_total`/`_created`, histograms with buckets.
VLLM_TEXT = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 18231.0
python_gc_objects_collected_total{generation="1"} 3561.0
# HELP process_resident_memory_bytes Resident memory size in bytes.
# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes 1.284521984e+09
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="bge-m3"} 7.0
vllm:num_requests_running{engine="1",model_name="bge-m3"} 5.0
vllm:num_requests_running{engine="0",model_name="llama"} 30.0
vllm:num_requests_running{engine="1",model_name="llama"} 34.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="bge-m3"} 0.0
vllm:num_requests_waiting{engine="1",model_name="bge-m3"} 1.0
vllm:num_requests_waiting{engine="0",model_name="llama"} 6.0
vllm:num_requests_waiting{engine="1",model_name="llama"} 3.0
# HELP vllm:num_requests_waiting_by_reason Number of requests waiting, by the reason they wait.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="bge-m3",reason="capacity"} 0.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="bge-m3",reason="deferred"} 0.0
vllm:num_requests_waiting_by_reason{engine="1",model_name="bge-m3",reason="capacity"} 0.0
vllm:num_requests_waiting_by_reason{engine="1",model_name="bge-m3",reason="deferred"} 1.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="llama",reason="capacity"} 4.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="llama",reason="deferred"} 2.0
vllm:num_requests_waiting_by_reason{engine="1",model_name="llama",reason="capacity"} 3.0
vllm:num_requests_waiting_by_reason{engine="1",model_name="llama",reason="deferred"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="bge-m3"} 0.05
vllm:kv_cache_usage_perc{engine="1",model_name="bge-m3"} 0.07
vllm:kv_cache_usage_perc{engine="0",model_name="llama"} 0.81
vllm:kv_cache_usage_perc{engine="1",model_name="llama"} 0.92
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="llama"} 17.0
vllm:num_preemptions_created{engine="0",model_name="llama"} 1.7712e+09
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="bge-m3"} 912345.0
vllm:prompt_tokens_created{engine="0",model_name="bge-m3"} 1.7712e+09
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="llama"} 1021.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="llama"} 12.0
vllm:request_success_created{engine="0",finished_reason="stop",model_name="llama"} 1.7712e+09
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3",model_name="llama"} 10.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="1.0",model_name="llama"} 700.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="llama"} 1033.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="llama"} 1033.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="llama"} 1544.2
vllm:e2e_request_latency_seconds_created{engine="0",model_name="llama"} 1.7712e+09
# HELP vllm:request_queue_time_seconds Histogram of time spent in WAITING phase.
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_bucket{engine="0",le="0.5",model_name="llama"} 900.0
vllm:request_queue_time_seconds_bucket{engine="0",le="+Inf",model_name="llama"} 1033.0
vllm:request_queue_time_seconds_count{engine="0",model_name="llama"} 1033.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="llama"} 301.5
"""

# vLLM before March 2026: no `_by_reason`, the old KV gauge name.
OLD_VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="llama"} 48.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="llama"} 5.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="llama"} 0.97
"""


# ------------------------------------------------------------------------------------- URLs


@pytest.mark.parametrize(
    ("base", "expected"),
    [
        ("http://vllm-embed.arpa/v1", "http://vllm-embed.arpa/metrics"),
        ("http://vllm-embed.arpa/v1/", "http://vllm-embed.arpa/metrics"),
        ("http://host:8000", "http://host:8000/metrics"),
        ("http://host:8000/", "http://host:8000/metrics"),
        ("https://gw.example/llm/v1", "https://gw.example/llm/metrics"),
        ("http://v1", "http://v1/metrics"),  # a host called v1 is not a path
        ("http://[::1]:8000/v1", "http://[::1]:8000/metrics"),
    ],
)
def test_derive_metrics_url(base: str, expected: str) -> None:
    assert derive_metrics_url(base) == expected


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("http://user:secret@host/metrics", "credentials"),
        ("http://user@host/metrics", "credentials"),
        ("http://host/metrics?x=1", "query"),
        ("http://host/metrics?", "query"),
        ("http://host/metrics#frag", "fragment"),
        ("ftp://host/metrics", "http"),
        ("file:///etc/passwd", "http"),
        ("host/metrics", "http"),
        ("", "non-empty"),
        ("   ", "non-empty"),
        ("http:///metrics", "no host"),
        ("http://host:99999/metrics", "malformed"),
        ("http://ho st/metrics", "whitespace"),
    ],
)
def test_validate_metrics_url_refuses(url: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        validate_metrics_url(url)


def test_refusal_never_echoes_a_password() -> None:
    with pytest.raises(ConfigError) as info:
        derive_metrics_url("http://admin:hunter2@host/v1")
    assert "hunter2" not in str(info.value)


def test_validate_metrics_url_accepts_plain_urls() -> None:
    for url in ("http://host/metrics", "https://host:9000/a/b/metrics", "http://10.0.0.1/metrics"):
        assert validate_metrics_url(url) == url


# ----------------------------------------------------------------------------------- parsing


def test_vllm_sums_over_engines_per_model() -> None:
    bge = parse_signals(VLLM_TEXT, model_name="bge-m3")
    assert bge == Signals(running=12.0, waiting_capacity=0.0, waiting=1.0, kv_cache_usage=0.07)
    assert bge.saturated is False
    llama = parse_signals(VLLM_TEXT, model_name="llama")
    assert llama == Signals(
        running=64.0, waiting_capacity=7.0, waiting=9.0, kv_cache_usage=0.92, preemptions=17.0
    )
    assert llama.saturated is True


def test_no_model_filter_sums_every_model() -> None:
    every = parse_signals(VLLM_TEXT, model_name=None)
    assert every == Signals(
        running=76.0, waiting_capacity=7.0, waiting=10.0, kv_cache_usage=0.92, preemptions=17.0
    )


def test_model_absent_is_unknown_not_zero() -> None:
    sig = parse_signals(VLLM_TEXT, model_name="no-such-model")
    assert sig.ok
    assert (sig.running, sig.waiting_capacity, sig.waiting, sig.kv_cache_usage) == (None,) * 4
    assert sig.saturated is None


def test_absent_family_is_unknown() -> None:
    only_running = "\n".join(
        line for line in VLLM_TEXT.splitlines() if "num_requests_waiting" not in line
    )
    sig = parse_signals(only_running, model_name="llama")
    assert sig.running == 64.0
    assert sig.waiting is None and sig.waiting_capacity is None
    assert parse_signals("", model_name=None) == Signals()


def test_fallback_to_num_requests_waiting_and_old_kv_gauge() -> None:
    sig = parse_signals(OLD_VLLM_TEXT, model_name="llama")
    assert sig == Signals(running=48.0, waiting_capacity=5.0, waiting=5.0, kv_cache_usage=0.97)


def test_prefix_named_metrics_are_not_confused() -> None:
    # Decoys whose *family* names collide with the gauges once prometheus_client strips
    # `_total`/`_created`, and one whose name merely starts with a gauge's name.
    decoys = """\
# TYPE vllm:num_requests_waiting_total counter
vllm:num_requests_waiting_total{model_name="llama"} 1000.0
vllm:num_requests_waiting_created{model_name="llama"} 1.7e9
# TYPE vllm:num_requests_running_max gauge
vllm:num_requests_running_max{model_name="llama"} 500.0
# TYPE vllm:num_requests_waiting_by_reason_seconds histogram
vllm:num_requests_waiting_by_reason_seconds_bucket{le="+Inf",model_name="llama"} 3.0
vllm:num_requests_waiting_by_reason_seconds_count{model_name="llama"} 3.0
vllm:num_requests_waiting_by_reason_seconds_sum{model_name="llama"} 9.0
"""
    sig = parse_signals(decoys + VLLM_TEXT, model_name="llama")
    assert sig == Signals(
        running=64.0, waiting_capacity=7.0, waiting=9.0, kv_cache_usage=0.92, preemptions=17.0
    )
    assert parse_signals(decoys, model_name="llama") == Signals()


def test_capacity_sample_missing_for_model_falls_back_to_waiting() -> None:
    text = OLD_VLLM_TEXT + (
        "# TYPE vllm:num_requests_waiting_by_reason gauge\n"
        'vllm:num_requests_waiting_by_reason{model_name="other",reason="capacity"} 9.0\n'
    )
    assert parse_signals(text, model_name="llama").waiting_capacity == 5.0


@pytest.mark.parametrize("bad", ["NaN", "+Inf", "-Inf", "-1.0"])
def test_invalid_values_are_unknown_and_not_ok(bad: str) -> None:
    text = VLLM_TEXT.replace(
        'vllm:num_requests_running{engine="1",model_name="llama"} 34.0',
        f'vllm:num_requests_running{{engine="1",model_name="llama"}} {bad}',
    )
    sig = parse_signals(text, model_name="llama")
    assert not sig.ok
    assert sig.running is None
    assert sig.error is not None and "vllm:num_requests_running" in sig.error
    assert sig.waiting_capacity == 7.0  # the other signals stay usable


def test_garbage_is_a_failure_not_a_crash() -> None:
    for text in ("<html>502 Bad Gateway</html>", "vllm:num_requests_running{ 3", "\x00\xff" * 50):
        sig = parse_signals(text, model_name=None)
        assert sig.running is None and sig.waiting_capacity is None


def test_huge_body_and_huge_values() -> None:
    big = VLLM_TEXT + "".join(
        f'vllm:some_other_gauge{{engine="{i}",model_name="llama"}} {i}.0\n' for i in range(50_000)
    )
    assert parse_signals(big, model_name="llama").running == 64.0
    text = 'vllm:num_requests_running{model_name="x"} 1e308\n' * 3
    sig = parse_signals(text, model_name="x")
    # 3 * 1e308 overflows to inf: refused rather than passed on.
    assert sig.running is None and not sig.ok


_finite_or_not = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(["NaN", "+Inf", "x", ""])
)


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_arbitrary_text_never_crashes(text: str) -> None:
    sig = parse_signals(text, model_name=None)
    for value in (sig.running, sig.waiting_capacity, sig.waiting, sig.kv_cache_usage):
        assert value is None or (math.isfinite(value) and value >= 0)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(
                [
                    "vllm:num_requests_running",
                    "vllm:num_requests_waiting",
                    "vllm:num_requests_waiting_by_reason",
                    "vllm:kv_cache_usage_perc",
                ]
            ),
            st.sampled_from(["0", "1"]),
            st.sampled_from(["capacity", "deferred"]),
            _finite_or_not,
        ),
        max_size=12,
    )
)
def test_arbitrary_values_never_crash(rows: list[tuple[str, str, str, float | str]]) -> None:
    text = "".join(
        f'{name}{{engine="{engine}",model_name="m",reason="{reason}"}} {value}\n'
        for name, engine, reason, value in rows
    )
    sig = parse_signals(text, model_name="m")
    for value in (sig.running, sig.waiting_capacity, sig.waiting, sig.kv_cache_usage):
        assert value is None or (math.isfinite(value) and value >= 0)
    if sig.error is None:
        assert sig.ok


def test_invalid_kv_gauge_does_not_fail_the_poll() -> None:
    text = VLLM_TEXT.replace(
        'vllm:kv_cache_usage_perc{engine="0",model_name="llama"} 0.81',
        'vllm:kv_cache_usage_perc{engine="0",model_name="llama"} NaN',
    )
    sig = parse_signals(text, model_name="llama")
    assert sig.ok and sig.kv_cache_usage is None and sig.running == 64.0
    assert sig.error is not None and "vllm:kv_cache_usage_perc" in sig.error


def test_adapter_registry() -> None:
    assert ADAPTERS["vllm"] is VLLM and get_adapter("vllm").server == "vllm"
    assert set(ADAPTERS) == {"vllm", "sglang", "tgi", "tei", "llamacpp", "trtllm", "nim"}
    with pytest.raises(ConfigError, match="unknown server kind 'tgx'"):
        get_adapter("tgx")


# ---------------------------------------------------------------------------------- combine


def test_combine_sums_replicas_and_takes_max_kv() -> None:
    a = Signals(running=10, waiting_capacity=0, waiting=1, kv_cache_usage=0.5)
    b = Signals(running=20, waiting_capacity=2, waiting=3, kv_cache_usage=0.9)
    assert combine([a, b]) == Signals(running=30, waiting_capacity=2, waiting=4, kv_cache_usage=0.9)
    assert combine([a]) is a
    assert not combine([]).ok


def test_combine_any_failure_is_unknown_but_keeps_proven_saturation() -> None:
    healthy = Signals(running=10, waiting_capacity=0, waiting=0, kv_cache_usage=0.5)
    saturated = Signals(running=16, waiting_capacity=4, waiting=4, kv_cache_usage=0.9)
    down = Signals.failure("http://b/metrics: HTTP 503")
    calm = combine([healthy, down])
    assert not calm.ok and calm.running is None and calm.waiting_capacity is None
    assert calm.error is not None and "1/2 endpoints failed" in calm.error
    hot = combine([saturated, down])
    assert not hot.ok and hot.waiting_capacity == 4 and hot.saturated is True


_maybe = st.one_of(st.none(), st.floats(min_value=0, max_value=1.7e308))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.builds(Signals, _maybe, _maybe, _maybe, _maybe, st.booleans()), max_size=5))
def test_combine_never_yields_invalid_numbers(parts: list[Signals]) -> None:
    sig = combine(parts)
    for value in (sig.running, sig.waiting_capacity, sig.waiting, sig.kv_cache_usage):
        assert value is None or (math.isfinite(value) and value >= 0)
    if any(not p.ok for p in parts):
        assert not sig.ok


def test_combine_unknown_field_stays_unknown() -> None:
    a = Signals(running=10, waiting_capacity=0)
    b = Signals(running=None, waiting_capacity=0)
    assert combine([a, b]).running is None


# ------------------------------------------------------------------- scrape (real HTTP server)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        path = self.path
        if path == "/metrics":
            self._send(200, VLLM_TEXT.encode(), {"Content-Type": "text/plain; version=0.0.4"})
        elif path == "/old/metrics":
            self._send(200, OLD_VLLM_TEXT.encode())
        elif path == "/missing":
            self._send(404, b"not found")
        elif path == "/redirect":
            self._send(302, b"", {"Location": "/metrics"})
        elif path == "/big":
            self._send(200, b"#" * 100_000)
        elif path in ("/endless", "/trickle"):
            # No Content-Length: the body ends when the connection does.
            self.close_connection = True
            self.send_response(200)
            self.end_headers()
            endless = path == "/endless"
            chunk, pause = (b"# " + b"x" * 8190 + b"\n", 0.001) if endless else (b"#", 0.1)
            deadline = time.monotonic() + 10
            try:
                while time.monotonic() < deadline:
                    self.wfile.write(chunk)
                    self.wfile.flush()
                    time.sleep(pause)
            except OSError:
                pass
        elif path == "/latin1":
            self._send(200, "vllm:num_requests_running 1 # \xe9".encode("latin-1"))
        else:
            self._send(500, b"boom")


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        pass


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    server = _Server(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


async def test_scrape_ok(server_url: str) -> None:
    async with httpx.AsyncClient() as client:
        result = await scrape(client, f"{server_url}/metrics", timeout=2.0, max_bytes=1 << 20)
    assert result.ok and result.status == 200 and result.error is None
    assert result.text == VLLM_TEXT
    assert result.elapsed >= 0


@pytest.mark.parametrize(
    ("path", "needle"),
    [
        ("/missing", "HTTP 404"),
        ("/redirect", "redirect"),
        ("/other", "HTTP 500"),
        ("/big", "cap"),
        ("/endless", "cap"),
        ("/latin1", "UTF-8"),
    ],
)
async def test_scrape_failures(server_url: str, path: str, needle: str) -> None:
    async with httpx.AsyncClient() as client:
        result = await scrape(client, server_url + path, timeout=3.0, max_bytes=64 * 1024)
    assert not result.ok and result.text is None
    assert result.error is not None and needle in result.error
    assert result.elapsed < 3.0


async def test_scrape_redirect_is_not_followed(server_url: str) -> None:
    async with httpx.AsyncClient(follow_redirects=True) as client:
        result = await scrape(client, f"{server_url}/redirect", timeout=2.0, max_bytes=1 << 20)
    assert not result.ok and result.status == 302


async def test_scrape_slow_body_times_out(server_url: str) -> None:
    # One byte every 0.1 s: httpx's per-read timeout never fires, the total one must.
    async with httpx.AsyncClient() as client:
        start = time.monotonic()
        result = await scrape(client, f"{server_url}/trickle", timeout=0.5, max_bytes=1 << 20)
        took = time.monotonic() - start
    assert not result.ok and result.error is not None and "timed out" in result.error
    assert took < 1.5


async def test_scrape_connection_refused() -> None:
    with socket_on_free_port() as port:
        pass  # closed again: nothing listens there now
    async with httpx.AsyncClient() as client:
        result = await scrape(
            client, f"http://127.0.0.1:{port}/metrics", timeout=2.0, max_bytes=1024
        )
    assert not result.ok and result.error


async def test_fetch_signals_combines_replicas(server_url: str) -> None:
    urls = [f"{server_url}/metrics", f"{server_url}/old/metrics"]
    async with httpx.AsyncClient() as client:
        both = await fetch_signals(client, urls, model_name="llama", timeout=2.0, max_bytes=1 << 20)
        one_down = await fetch_signals(
            client,
            [*urls, f"{server_url}/missing"],
            model_name="llama",
            timeout=2.0,
            max_bytes=1 << 20,
        )
    assert both == Signals(running=112.0, waiting_capacity=12.0, waiting=14.0, kv_cache_usage=0.97)
    assert not one_down.ok and one_down.running is None
    assert one_down.waiting_capacity == 12.0  # proven saturation survives
    assert one_down.error is not None and "/missing: HTTP 404" in one_down.error


class socket_on_free_port:
    """Reserve a free port and release it on exit (a port nothing listens on afterwards)."""

    def __enter__(self) -> int:
        import socket

        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        port: int = self._sock.getsockname()[1]
        return port

    def __exit__(self, *exc: object) -> None:
        self._sock.close()


# --------------------------------------------------------- the project's vLLM simulator (ASGI)


@pytest.mark.parametrize("legacy", [False, True])
async def test_parses_the_vllm_simulator(legacy: bool) -> None:
    """The simulator's exposition, loaded: 2 slots busy, 3 requests queued for capacity."""
    sim = pytest.importorskip("fleetgate.tools.sim.vllm")
    app = sim.build_app(
        sim.VllmSimConfig(model="m", engines=2, capacity=2, service_ms=500, legacy_metrics=legacy)
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://sim") as client:
        calls = [
            asyncio.create_task(client.post("/v1/embeddings", json={"model": "m", "input": "x"}))
            for _ in range(5)
        ]
        expected = Signals(
            running=2.0, waiting_capacity=3.0, waiting=3.0, kv_cache_usage=1.0, preemptions=0.0
        )
        for _ in range(100):  # until all five have arrived (well inside the first 500 ms)
            sig = await fetch_signals(
                client, ["http://sim/metrics"], model_name="m", timeout=2.0, max_bytes=1 << 20
            )
            if sig == expected:
                break
            await asyncio.sleep(0.005)
        other = await fetch_signals(
            client, ["http://sim/metrics"], model_name="other", timeout=2.0, max_bytes=1 << 20
        )
        assert [r.status_code for r in await asyncio.gather(*calls)] == [200] * 5
    assert sig == expected
    assert other == Signals()


def test_combine_sums_preemption_counters_and_unknown_stays_unknown() -> None:
    a = Signals(running=1, waiting_capacity=0, preemptions=4, admission_rejections=1)
    b = Signals(running=2, waiting_capacity=0, preemptions=6, admission_rejections=None)
    both = combine([a, b])
    assert (both.preemptions, both.admission_rejections) == (10, None)
