"""The per-server adapters, detection, the selective reader and the per-gate metrics source."""

from __future__ import annotations

import logging

import httpx
import pytest

from fleetgate.coordinator.config import Config
from fleetgate.coordinator.scrape.adapters import (
    ADAPTERS,
    detect_kind,
    get_adapter,
    validate_server,
)
from fleetgate.coordinator.scrape.promtext import sample_names_present, select_samples
from fleetgate.coordinator.scrape.sources import MetricsSource, candidate_urls
from fleetgate.errors import ConfigError
from fleetgate.tools.sim import serve_in_thread
from fleetgate.tools.sim.vllm import VllmSimConfig, build_app

SGLANG_TP = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{dp_rank="0",engine_type="u",model_name="s",pp_rank="0",tp_rank="0"} 5.0
sglang:num_running_reqs{dp_rank="0",engine_type="u",model_name="s",pp_rank="0",tp_rank="1"} 5.0
sglang:num_running_reqs{dp_rank="1",engine_type="u",model_name="s",pp_rank="0",tp_rank="0"} 3.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{dp_rank="0",engine_type="u",model_name="s",pp_rank="0",tp_rank="0"} 2.0
sglang:num_queue_reqs{dp_rank="0",engine_type="u",model_name="s",pp_rank="0",tp_rank="1"} 2.0
sglang:num_queue_reqs{dp_rank="1",engine_type="u",model_name="s",pp_rank="0",tp_rank="0"} 0.0
# TYPE sglang:token_usage gauge
sglang:token_usage{dp_rank="0",engine_type="u",model_name="s",pp_rank="0",tp_rank="0"} 0.4
sglang:token_usage{dp_rank="1",engine_type="u",model_name="s",pp_rank="0",tp_rank="0"} 0.7
"""

TRTLLM = """\
# HELP trtllm_num_requests_running Number of active requests
# TYPE trtllm_num_requests_running gauge
trtllm_num_requests_running{engine_type="undefined",model_name="undefined",pid="41"} 7.0
# HELP trtllm_num_requests_waiting Number of queued requests
# TYPE trtllm_num_requests_waiting gauge
trtllm_num_requests_waiting{engine_type="undefined",model_name="undefined",pid="41"} 1.0
# HELP trtllm_kv_cache_utilization KV cache utilization
# TYPE trtllm_kv_cache_utilization gauge
trtllm_kv_cache_utilization{engine_type="undefined",model_name="undefined",pid="41"} 0.5
"""

TEI = """\
# TYPE te_request_count counter
te_request_count{method="single"} 4

# TYPE te_queue_size gauge
te_queue_size 3

# TYPE te_batch_next_size histogram
te_batch_next_size_bucket{le="1"} 2
te_batch_next_size_bucket{le="+Inf"} 2
te_batch_next_size_sum 2
te_batch_next_size_count 2

"""

TGI = """\
# HELP tgi_queue_size Current queue size
# TYPE tgi_queue_size gauge
tgi_queue_size 4

# HELP tgi_batch_current_size Current batch size
# TYPE tgi_batch_current_size gauge
tgi_batch_current_size 32

"""

LLAMACPP = """\
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 4
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 9
# HELP llamacpp:n_busy_slots_per_decode Average number of busy slots per llama_decode() call
# TYPE llamacpp:n_busy_slots_per_decode gauge
llamacpp:n_busy_slots_per_decode 3.5
"""

NIM = """\
# TYPE num_requests_running gauge
num_requests_running{model_name="meta/llama-3.1-8b-instruct"} 12.0
# TYPE num_requests_waiting gauge
num_requests_waiting{model_name="meta/llama-3.1-8b-instruct"} 0.0
# TYPE gpu_cache_usage_perc gauge
gpu_cache_usage_perc{model_name="meta/llama-3.1-8b-instruct"} 0.25
"""


def test_sglang_takes_one_value_per_tp_shard_and_sums_dp_ranks() -> None:
    sig = get_adapter("sglang").parse(SGLANG_TP, None)
    assert (sig.running, sig.waiting_capacity, sig.kv_cache_usage) == (8.0, 2.0, 0.7)


def test_trtllm_pid_series_and_undefined_model() -> None:
    sig, model = get_adapter("trtllm").read(TRTLLM, None, prefer="llama")
    assert (sig.running, sig.waiting_capacity, sig.kv_cache_usage, model) == (7.0, 1.0, 0.5, None)


def test_tei_has_no_in_flight_gauge_and_no_histogram_confusion() -> None:
    sig = get_adapter("tei").parse(TEI, None)
    assert sig.ok and sig.running is None and sig.waiting_capacity == 3.0
    assert sig.kv_cache_usage is None


@pytest.mark.parametrize(
    ("kind", "text", "running", "waiting"),
    [("tgi", TGI, 32.0, 4.0), ("llamacpp", LLAMACPP, 4.0, 9.0), ("nim", NIM, 12.0, 0.0)],
)
def test_other_kinds(kind: str, text: str, running: float, waiting: float) -> None:
    sig = get_adapter(kind).parse(text, None)
    assert (sig.running, sig.waiting_capacity, sig.waiting) == (running, waiting, waiting)


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        (SGLANG_TP, "sglang"),
        (TRTLLM, "trtllm"),
        (TEI, "tei"),
        (TGI, "tgi"),
        (LLAMACPP, "llamacpp"),
        (NIM, "nim"),
        ('vllm:num_requests_running{model_name="x"} 1\nnum_requests_running 2\n', "vllm"),
        ("# HELP vllm:num_requests_running x\n", None),  # a comment is no sample
        ('[{"numActiveRequests": 3}]', None),  # trtllm-serve's JSON /metrics
        ("te_queue_size_total 3\n", None),  # a longer name is not the gauge
        ("", None),
    ],
)
def test_detect_kind(text: str, kind: str | None) -> None:
    assert detect_kind(text) == kind


def test_model_defaults_to_gate_name_when_exposed() -> None:
    text = (
        NIM + 'num_requests_running{model_name="g"} 3.0\nnum_requests_waiting{model_name="g"} 1\n'
    )
    nim = get_adapter("nim")
    assert nim.read(text, None, prefer="g")[0].running == 3.0
    assert nim.read(text, None, prefer="absent") == (nim.parse(text, None), None)
    assert nim.parse(text, None).running == 15.0
    assert nim.read(text, "g", prefer="other")[1] == "g"  # model_name wins


def test_select_samples_skips_other_lines_and_prefixes() -> None:
    text = 'x_total 1\n  x 2\n# x 3\nx{a="b"} 4\nxy 5\n'
    assert [(s.name, s.value) for s in select_samples(text, frozenset({"x"}))] == [
        ("x", 2.0),
        ("x", 4.0),
    ]
    assert sample_names_present(text, ["x", "xy", "z"]) == {"x", "xy"}


def test_validate_server() -> None:
    assert validate_server("auto") == "auto"
    assert all(validate_server(k) == k for k in ADAPTERS)
    with pytest.raises(ConfigError, match="known: auto, llamacpp, nim, sglang"):
        validate_server("triton")


def test_candidate_urls_and_named_paths() -> None:
    assert candidate_urls("http://h:8000/v1") == (
        "http://h:8000/metrics",
        "http://h:8000/prometheus/metrics",
        "http://h:8000/v1/metrics",
    )
    cfg = Config.from_toml_text(
        '[[gates]]\nname = "a"\nfloor = 1\nbase_url = "http://h/v1"\nserver = "nim"\n'
        '[[gates]]\nname = "b"\nfloor = 1\nbase_url = "http://h/v1"\nserver = "trtllm"\n'
        '[[gates]]\nname = "c"\nfloor = 1\nbase_url = "http://h/v1"\n'
        '[[gates]]\nname = "d"\nfloor = 1\nmetrics_url = "http://h:9000/metrics"\nserver = "tei"\n',
        env={},
    )
    assert [g.metrics_urls[0] for g in cfg.gates] == [
        "http://h/v1/metrics",
        "http://h/prometheus/metrics",
        "http://h/metrics",
        "http://h:9000/metrics",  # metrics_url always wins
    ]
    assert cfg.gate("c").server == "auto"


def _gate(text: str) -> Config:
    return Config.from_toml_text(f'[[gates]]\nname = "sim-model"\nfloor = 1\n{text}\n', env={})


async def test_source_probes_past_trtllm_json_and_logs_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "fleetgate.coordinator")
    with serve_in_thread(build_app(VllmSimConfig(flavor="trtllm"))) as served:
        gate = _gate(f'base_url = "{served.url}/v1"').gates[0]
        async with httpx.AsyncClient() as client:
            source = MetricsSource(gate, client)
            first = await source.read(timeout=2, max_bytes=1 << 20)
            second = await source.read(timeout=2, max_bytes=1 << 20)
    assert first.ok and first.server == "trtllm" and first.running == 0.0
    assert second.server == "trtllm" and source.urls == (f"{served.url}/prometheus/metrics",)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("server detected as trtllm" in m for m in messages) == 1
    assert sum("counting every model" in m for m in messages) == 1  # model_name="undefined"


async def test_source_counts_gate_model_when_exposed(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "fleetgate.coordinator")
    with serve_in_thread(build_app(VllmSimConfig(flavor="nim"))) as served:
        gate = _gate(f'base_url = "{served.url}"\nserver = "nim"').gates[0]
        async with httpx.AsyncClient() as client:
            sig = await MetricsSource(gate, client).read(timeout=2, max_bytes=1 << 20)
    assert sig.ok and sig.server == "nim" and sig.running == 0.0
    assert any("counting model_name='sim-model'" in r.getMessage() for r in caplog.records)


async def test_source_named_kind_on_wrong_server_is_unknown() -> None:
    with serve_in_thread(build_app(VllmSimConfig(flavor="sglang"))) as served:
        gate = _gate(f'metrics_url = "{served.url}/metrics"\nserver = "llamacpp"').gates[0]
        async with httpx.AsyncClient() as client:
            sig = await MetricsSource(gate, client).read(timeout=2, max_bytes=1 << 20)
    # Named kinds are not second-guessed: nothing of llama.cpp's is there, so all is unknown,
    # and the scrape failed, saying what it found instead
    assert sig.server == "llamacpp" and sig.running is None and sig.waiting_capacity is None
    assert not sig.ok and sig.error is not None
    assert f"{served.url}/metrics: no llamacpp metrics" in sig.error
    assert 'the metrics are of a sglang server (set server = "sglang" or "auto")' in sig.error


@pytest.mark.parametrize(
    ("path", "said"),
    [
        ("/html", "the body is an HTML page ('Sign in - Model Gateway'), not Prometheus text"),
        ("/text", "the body is not Prometheus text (a line reads 'It works!')"),
    ],
)
async def test_a_named_kind_answered_by_no_metrics_is_a_failed_scrape(
    server_url: str, path: str, said: str
) -> None:
    """Before: ``server = "vllm"`` read an HTML page as a good scrape with every value unknown
    (metrics_ok 1, no error anywhere)."""
    gate = _gate(f'metrics_url = "{server_url}{path}"\nserver = "vllm"').gates[0]
    async with httpx.AsyncClient() as client:
        sig = await MetricsSource(gate, client).read(timeout=2, max_bytes=1 << 20)
    assert not sig.ok and sig.running is None and sig.waiting_capacity is None
    assert sig.error is not None and sig.error.startswith(f"{server_url}{path}: no vllm metrics")
    assert "vllm:num_requests_running and vllm:num_requests_waiting absent" in sig.error
    assert said in sig.error, sig.error


def test_a_prometheus_text_without_the_gauges_yet_stays_unknown() -> None:
    """TGI and TEI export a gauge only once they have set it: a fresh server's text of other
    samples, or an empty one, is unknown (ok), not a failed scrape; another kind's is one."""
    fresh_tgi = "# TYPE tgi_request_count counter\ntgi_request_count 0\n\n"
    for text in (fresh_tgi, "", "# just a comment\n"):
        sig = ADAPTERS["tgi"].parse(text, None)
        assert sig.ok and sig.error is None and sig.running is None, (text, sig)
    wrong = ADAPTERS["sglang"].parse(TRTLLM, None)
    assert not wrong.ok and "the metrics are of a trtllm server" in (wrong.error or "")


@pytest.mark.parametrize("server", ["auto", "vllm"])
async def test_json_at_the_metrics_path_is_named(server: str) -> None:
    """trtllm-serve's ``/metrics`` is JSON: read as vLLM's path it is a failed scrape naming
    JSON (``auto`` probes on to ``/prometheus/metrics`` from a base URL, not from a URL)."""
    with serve_in_thread(build_app(VllmSimConfig(flavor="trtllm"))) as served:
        gate = _gate(f'metrics_url = "{served.url}/metrics"\nserver = "{server}"').gates[0]
        async with httpx.AsyncClient() as client:
            sig = await MetricsSource(gate, client).read(timeout=2, max_bytes=1 << 20)
    assert not sig.ok and "the body is JSON, not Prometheus text" in (sig.error or ""), sig


async def test_probing_shares_one_timeout_and_stops_at_an_unreachable_server() -> None:
    gate = _gate('base_url = "http://127.0.0.1:1/v1"').gates[0]
    async with httpx.AsyncClient() as client:
        source = MetricsSource(gate, client)
        sig = await source.read(timeout=1, max_bytes=1024)
    assert not sig.ok and sig.error is not None and sig.server is None
    assert sig.error.count("http://127.0.0.1:1/") == 1  # no probing of the other paths
    assert source.kind is None and source.urls is None  # retried next poll


# ------------------------------------------- expert-parallel ranks, preemption, the old KV gauge

# SGLang with tensor parallelism 4 and expert parallelism 4 (--tp 4 --ep 4): every scheduler
# reports the same batch, labelled with its tp_rank and its moe_ep_rank.
SGLANG_EP = "".join(
    f'sglang:{name}{{dp_rank="0",engine_type="unified",model_name="s",moe_ep_rank="{r}",'
    f'pp_rank="0",tp_rank="{r}"}} {value}\n'
    for name, value in (("num_running_reqs", 6.0), ("num_queue_reqs", 1.0), ("token_usage", 0.3))
    for r in range(4)
) + "".join(
    f'sglang:num_retracted_reqs{{dp_rank="0",engine_type="unified",model_name="s",'
    f'moe_ep_rank="{r}",pp_rank="0",tp_rank="{r}"}} 2.0\n'
    for r in range(4)
)


def test_sglang_expert_parallel_ranks_count_once() -> None:
    """moe_ep_rank is a shard label: the four ranks' series count once (summed: 24, not 6)."""
    sig = get_adapter("sglang").parse(SGLANG_EP, None)
    assert (sig.running, sig.waiting_capacity, sig.kv_cache_usage) == (6.0, 1.0, 0.3)
    assert sig.preemptions == 2.0


VLLM_COUNTERS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 4.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 0.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 17.0
vllm:num_preemptions_total{engine="1",model_name="m"} 5.0
vllm:num_preemptions_created{engine="0",model_name="m"} 1.7712e+09
# TYPE vllm:admission_rejections_total counter
vllm:admission_rejections_total{engine="0",model_name="m"} 2.0
vllm:admission_rejections_total{engine="1",model_name="m"} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.4
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.9
"""

TRTLLM_PAUSED = (
    TRTLLM
    + "# TYPE trtllm_num_paused_requests gauge\n"
    + 'trtllm_num_paused_requests{engine_type="undefined",model_name="undefined",pid="41"} 3.0\n'
)


def test_preemption_and_rejection_counters_are_read() -> None:
    sig = get_adapter("vllm").parse(VLLM_COUNTERS, "m")
    assert (sig.preemptions, sig.admission_rejections) == (22.0, 3.0)  # summed over engines
    assert get_adapter("trtllm").parse(TRTLLM_PAUSED, None).preemptions == 3.0


@pytest.mark.parametrize(
    ("kind", "text"),
    [
        ("vllm", 'vllm:num_requests_running{model_name="m"} 1\n'),
        ("sglang", SGLANG_TP),
        ("trtllm", TRTLLM),
        ("tgi", TGI),
        ("llamacpp", LLAMACPP),
        ("nim", NIM),
    ],
)
def test_absent_preemption_counters_are_unknown_not_zero(kind: str, text: str) -> None:
    sig = get_adapter(kind).parse(text, None)
    assert sig.ok and sig.preemptions is None and sig.admission_rejections is None


def test_invalid_preemption_counter_is_named_but_does_not_fail_the_poll() -> None:
    text = VLLM_COUNTERS.replace(
        '{engine="1",model_name="m"} 5.0', '{engine="1",model_name="m"} NaN'
    )
    sig = get_adapter("vllm").parse(text, "m")
    assert sig.ok and sig.running == 7.0 and sig.preemptions is None
    assert sig.error is not None and "vllm:num_preemptions_total" in sig.error


def test_old_vllm_kv_gauge_is_only_a_fallback() -> None:
    """vllm:gpu_cache_usage_perc no longer exists in current vLLM; an exposition with both (a
    proxy merging versions) reads the current name."""
    assert get_adapter("vllm").parse(VLLM_COUNTERS, "m").kv_cache_usage == 0.4
    old = VLLM_COUNTERS.replace("vllm:kv_cache_usage_perc", "vllm:other")
    assert get_adapter("vllm").parse(old, "m").kv_cache_usage == 0.9
