"""What servers state about themselves, read from recorded expositions: the requests they admit
at once (NIM, TensorRT-LLM, llama.cpp's ``/props`` slots), their KV cache in tokens (vLLM's
``cache_config_info``, SGLang), preemptions and rejections as the increase between polls, and
llama.cpp's uncounted dispatch queue."""

from __future__ import annotations

import httpx
import msgspec
import pytest

from fleetgate.coordinator.config import Config
from fleetgate.coordinator.scrape.adapters import get_adapter
from fleetgate.coordinator.scrape.published import counter_increase, props_url, stated_slots
from fleetgate.coordinator.scrape.signals import ScrapeResult
from fleetgate.coordinator.scrape.sources import PROPS_EVERY, MetricsSource
from fleetgate.tools.sim import serve_in_thread
from fleetgate.tools.sim.vllm import VllmSimConfig, build_app

# NIM for LLMs at /v1/metrics (docs: "Observability for NVIDIA NIM for LLMs").
NIM = """\
# TYPE num_requests_running gauge
num_requests_running{model_name="meta/llama-3.1-8b-instruct"} 12.0
# TYPE num_requests_waiting gauge
num_requests_waiting{model_name="meta/llama-3.1-8b-instruct"} 0.0
# TYPE num_request_max gauge
num_request_max{model_name="meta/llama-3.1-8b-instruct"} 256.0
# TYPE gpu_cache_usage_perc gauge
gpu_cache_usage_perc{model_name="meta/llama-3.1-8b-instruct"} 0.25
"""

# trtllm-serve with return_perf_metrics, prometheus_client multiprocess mode (pid label).
TRTLLM = """\
# HELP trtllm_num_requests_running Number of active requests
# TYPE trtllm_num_requests_running gauge
trtllm_num_requests_running{engine_type="undefined",model_name="undefined",pid="41"} 7.0
trtllm_num_requests_running{engine_type="undefined",model_name="undefined",pid="42"} 7.0
# HELP trtllm_num_requests_waiting Number of queued requests
# TYPE trtllm_num_requests_waiting gauge
trtllm_num_requests_waiting{engine_type="undefined",model_name="undefined",pid="41"} 1.0
# HELP trtllm_max_num_active_requests Maximum number of active requests
# TYPE trtllm_max_num_active_requests gauge
trtllm_max_num_active_requests{engine_type="undefined",model_name="undefined",pid="41"} 64.0
trtllm_max_num_active_requests{engine_type="undefined",model_name="undefined",pid="42"} 64.0
# HELP trtllm_num_paused_requests Number of paused requests
# TYPE trtllm_num_paused_requests gauge
trtllm_num_paused_requests{engine_type="undefined",model_name="undefined",pid="41"} 0.0
# HELP trtllm_kv_cache_max_blocks Engine KV cache block capacity
# TYPE trtllm_kv_cache_max_blocks gauge
trtllm_kv_cache_max_blocks{engine_type="undefined",model_name="undefined",pid="41"} 1000.0
trtllm_kv_cache_max_blocks{engine_type="undefined",model_name="undefined",pid="42"} 1000.0
# HELP trtllm_kv_cache_tokens_per_block Tokens per KV-cache block
# TYPE trtllm_kv_cache_tokens_per_block gauge
trtllm_kv_cache_tokens_per_block{engine_type="undefined",model_name="undefined",pid="41"} 64.0
trtllm_kv_cache_tokens_per_block{engine_type="undefined",model_name="undefined",pid="42"} 64.0
"""

# TGI 3 (metrics-exporter-prometheus; set at warm-up, backends/v3/src/lib.rs).
TGI = """\
# TYPE tgi_batch_current_size gauge
tgi_batch_current_size 5
# TYPE tgi_queue_size gauge
tgi_queue_size 0
# TYPE tgi_batch_current_max_tokens gauge
tgi_batch_current_max_tokens 2304
# TYPE tgi_batch_max_total_tokens gauge
tgi_batch_max_total_tokens 131072
"""

# TEI: a queue, no KV cache.
TEI = """\
# TYPE te_queue_size gauge
te_queue_size 3
"""

# vLLM V1: cache_config_info is an info gauge (value 1), the configuration in its labels, one
# series per engine; num_gpu_blocks is "None" until the engine has profiled its memory.
VLLM = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 4.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 0.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",gpu_memory_utilization="0.9",num_gpu_blocks="27000",prefix_caching_hash_algo="sha256"} 1.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="1",gpu_memory_utilization="0.9",num_gpu_blocks="27000",prefix_caching_hash_algo="sha256"} 1.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 17.0
vllm:num_preemptions_total{engine="1",model_name="m"} 5.0
# HELP vllm:admission_rejections_total Number of admission attempts rejected
# TYPE vllm:admission_rejections_total counter
vllm:admission_rejections_total{engine="0",model_name="m"} 2.0
"""  # noqa: E501

SGLANG = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="s",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 6.0
sglang:num_running_reqs{engine_type="unified",model_name="s",moe_ep_rank="1",pp_rank="0",tp_rank="1"} 6.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{engine_type="unified",model_name="s",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 0.0
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{engine_type="unified",model_name="s",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 480000.0
sglang:max_total_num_tokens{engine_type="unified",model_name="s",moe_ep_rank="1",pp_rank="0",tp_rank="1"} 480000.0
# TYPE sglang:num_retracted_reqs gauge
sglang:num_retracted_reqs{engine_type="unified",model_name="s",moe_ep_rank="0",pid="7",pp_rank="0",tp_rank="0"} 2.0
"""  # noqa: E501

LLAMACPP = """\
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 4
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 0
"""

# GET /props of llama-server -np 4 (tools/server/README.md): the slots among other settings.
PROPS = '{"default_generation_settings":{"n_ctx":4096},"total_slots":4,"model_path":"m.gguf"}'


def test_stated_request_capacity_per_kind() -> None:
    """NIM's num_request_max and TensorRT-LLM's max_num_active_requests (its pid series count
    once, as every gauge of a multiprocess registry); kinds that state none: unknown."""
    assert get_adapter("nim").parse(NIM, None).max_requests == 256.0
    sig = get_adapter("trtllm").parse(TRTLLM, None)
    assert (sig.running, sig.max_requests, sig.preempted) == (7.0, 64.0, 0.0)
    assert get_adapter("vllm").parse(VLLM, "m").max_requests is None
    assert get_adapter("llamacpp").parse(LLAMACPP, None).max_requests is None  # it is in /props


@pytest.mark.parametrize(
    ("kind", "text", "model", "tokens"),
    [
        ("vllm", VLLM, "m", 2 * 27000 * 16),  # each engine's blocks x block size, summed
        ("sglang", SGLANG, None, 480000.0),  # once per shard
        ("tgi", TGI, None, 131072.0),
        # the pid series of one process count once: 1,000 blocks of 64 tokens
        ("trtllm", TRTLLM, None, 1000.0 * 64),
        ("nim", NIM, None, None),
        ("llamacpp", LLAMACPP, None, None),
        ("tei", TEI, None, None),
    ],
)
def test_kv_cache_tokens_per_kind(
    kind: str, text: str, model: str | None, tokens: float | None
) -> None:
    """The KV cache in tokens each kind states (what a gate's token budget is tuned to), from
    a recorded exposition; unknown for the kinds that state none."""
    sig = get_adapter(kind).parse(text, model)
    assert sig.ok and sig.kv_tokens == tokens


def test_kv_cache_tokens_are_unknown_until_stated() -> None:
    """vLLM writes num_gpu_blocks "None" until it has profiled its memory; TensorRT-LLM's
    blocks without their size are no token count."""
    unprofiled = VLLM.replace('num_gpu_blocks="27000"', 'num_gpu_blocks="None"')
    sig = get_adapter("vllm").parse(unprofiled, "m")
    assert sig.ok and sig.kv_tokens is None
    sizeless = "\n".join(ln for ln in TRTLLM.splitlines() if "tokens_per_block" not in ln)
    sig = get_adapter("trtllm").parse(sizeless, None)
    assert sig.ok and sig.kv_tokens is None


def test_vllm_admission_rejections_have_their_documented_name() -> None:
    """vLLM documents the counter as vllm:admission_rejections (sample ..._total); the name
    read before, num_admission_rejections_total, does not exist."""
    assert get_adapter("vllm").parse(VLLM, "m").admission_rejections == 2.0
    old = VLLM.replace("vllm:admission_rejections_total", "vllm:num_admission_rejections_total")
    assert get_adapter("vllm").parse(old, "m").admission_rejections is None


def test_gauges_of_preemption_are_this_polls_preemptions() -> None:
    """SGLang's retracted and TensorRT-LLM's paused requests are gauges: their value is the
    signal. vLLM's are counters: no signal from one reading alone."""
    assert get_adapter("sglang").parse(SGLANG, None).preempted == 2.0
    assert get_adapter("vllm").parse(VLLM, "m").preempted is None


def test_counter_increase_between_polls() -> None:
    assert counter_increase(None, 5.0) is None  # first poll: no rate yet
    assert counter_increase(5.0, None) is None
    assert counter_increase(17.0, 17.0) == 0.0
    assert counter_increase(17.0, 20.0) == 3.0
    assert counter_increase(17.0, 2.0) is None  # reset (the server restarted): unknown


def test_llamacpp_hides_its_dispatch_queue() -> None:
    assert get_adapter("llamacpp").parse(LLAMACPP, None).hidden_queue
    assert not get_adapter("vllm").parse(VLLM, "m").hidden_queue


def test_props_url_and_slots() -> None:
    assert props_url("http://h:8080/metrics", "/props") == "http://h:8080/props"
    assert props_url("https://h/llama/metrics", "/props") == "https://h/llama/props"
    assert stated_slots(PROPS) == 4.0
    for bad in (
        "",
        "[]",
        "{}",
        '{"total_slots": 0}',
        '{"total_slots": "4"}',
        "not json",
        '{"total_slots": 1e400}',
        '{"total_slots": true}',
    ):
        assert stated_slots(bad) is None, bad


class Canned:
    """A fetcher answering from a dict of URL -> (status, text); records every GET."""

    def __init__(self, answers: dict[str, tuple[int, str]]) -> None:
        self.answers = answers
        self.gets: list[str] = []

    async def get(self, url: str, *, timeout: float, max_bytes: int) -> ScrapeResult:
        self.gets.append(url)
        status, text = self.answers.get(url, (404, ""))
        if status != 200:
            return ScrapeResult(url, False, error=f"HTTP {status}", status=status)
        return ScrapeResult(url, True, text=text, status=status)

    async def aclose(self) -> None:
        pass


def _source(fetcher: Canned, kind: str = "llamacpp") -> MetricsSource:
    toml = '[[gates]]\nname = "g"\nfloor = 1\nmetrics_url = "http://h:8080/metrics"\n'
    gate = Config.from_toml_text(toml + f'server = "{kind}"\n', env={}).gates[0]
    return MetricsSource(gate, fetcher)


async def test_llamacpp_slots_are_read_from_props_rarely() -> None:
    """llama.cpp states its slots in /props, not /metrics: one extra GET when the server is
    first read, then every PROPS_EVERY polls (a restart with other -np is followed) and after a
    failed scrape (a restart), never on every poll."""
    fetcher = Canned(
        {"http://h:8080/metrics": (200, LLAMACPP), "http://h:8080/props": (200, PROPS)}
    )
    source = _source(fetcher)
    for _ in range(PROPS_EVERY):
        sig = await source.read(timeout=1, max_bytes=1 << 16)
        assert sig.ok and sig.max_requests == 4.0 and sig.hidden_queue
    assert fetcher.gets.count("http://h:8080/props") == 1
    fetcher.answers["http://h:8080/props"] = (
        200,
        PROPS.replace('"total_slots":4', '"total_slots":8'),
    )
    sig = await source.read(timeout=1, max_bytes=1 << 16)
    assert sig.max_requests == 8.0 and fetcher.gets.count("http://h:8080/props") == 2
    # A failed scrape: the slots are read again with the next good one.
    fetcher.answers["http://h:8080/metrics"] = (503, "")
    assert not (await source.read(timeout=1, max_bytes=1 << 16)).ok
    fetcher.answers["http://h:8080/metrics"] = (200, LLAMACPP)
    await source.read(timeout=1, max_bytes=1 << 16)
    assert fetcher.gets.count("http://h:8080/props") == 3


async def test_props_failure_leaves_the_slots_unknown_not_the_poll() -> None:
    fetcher = Canned({"http://h:8080/metrics": (200, LLAMACPP)})
    sig = await _source(fetcher).read(timeout=1, max_bytes=1 << 16)
    assert sig.ok and sig.running == 4.0 and sig.max_requests is None


async def test_counters_give_the_increase_since_the_last_poll() -> None:
    fetcher = Canned({"http://h:8080/metrics": (200, VLLM)})
    source = _source(fetcher, "vllm")
    first = await source.read(timeout=1, max_bytes=1 << 16)
    assert first.preempted is None  # one reading: no rate
    assert (await source.read(timeout=1, max_bytes=1 << 16)).preempted == 0.0
    more = VLLM.replace('engine="1",model_name="m"} 5.0', 'engine="1",model_name="m"} 8.0')
    fetcher.answers["http://h:8080/metrics"] = (200, more)
    assert (await source.read(timeout=1, max_bytes=1 << 16)).preempted == 3.0
    assert "props" not in " ".join(fetcher.gets)  # only llama.cpp has /props


@pytest.mark.parametrize("field", ["max_requests", "kv_tokens", "preempted", "hidden_queue"])
def test_signals_default_to_unknown(field: str) -> None:
    assert msgspec.structs.asdict(get_adapter("tgi").parse("tgi_queue_size 1\n", None))[field] in (
        None,
        False,
    )


# SGLang with --enable-priority-scheduling: the total under priority="", one series per priority
# beside it (observability/metrics_collector.py, _log_gauge_queue_count).
SGLANG_PRIORITY = "".join(
    f'sglang:{name}{{engine_type="unified",model_name="s",moe_ep_rank="0",pp_rank="0",'
    f'priority="{prio}",tp_rank="0"}} {value}\n'
    for name, series in (
        ("num_running_reqs", (("", 6.0), ("0", 4.0), ("1", 2.0))),
        ("num_queue_reqs", (("", 3.0), ("0", 1.0), ("1", 2.0))),
    )
    for prio, value in series
)


def test_sglang_priority_breakdown_is_not_added_to_its_total() -> None:
    """The per-priority series repeat the total's requests: summing them counted each twice."""
    sig = get_adapter("sglang").parse(SGLANG_PRIORITY, None)
    assert (sig.running, sig.waiting_capacity) == (6.0, 3.0)


async def test_llamacpp_simulator_states_its_slots_in_props() -> None:
    """The llama.cpp flavour of the simulator answers /props as llama-server does, so the
    coordinator against it reads the capacity as stated."""
    config = VllmSimConfig(flavor="llamacpp", capacity=6)
    with serve_in_thread(build_app(config)) as served:
        gate = Config.from_toml_text(
            f'[[gates]]\nname = "g"\nfloor = 1\nmetrics_url = "{served.url}/metrics"\n', env={}
        ).gates[0]
        async with httpx.AsyncClient() as client:
            sig = await MetricsSource(gate, client).read(timeout=2, max_bytes=1 << 20)
    assert (sig.server, sig.max_requests, sig.hidden_queue) == ("llamacpp", 6.0, True)
