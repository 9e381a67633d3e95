"""The servers' signals: parsing a vLLM exposition (per model, over engines, unknown rather
than zero, never crashing) and combining replicas."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetgate.coordinator.scrape.signals import (
    ADAPTERS,
    VLLM,
    Signals,
    combine,
    get_adapter,
    parse_signals,
)
from fleetgate.errors import ConfigError

from ._metrics_server import OLD_VLLM_TEXT, VLLM_TEXT

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
@pytest.mark.long
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
@pytest.mark.long
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


def test_combine_sums_preemption_counters_and_unknown_stays_unknown() -> None:
    a = Signals(running=1, waiting_capacity=0, preemptions=4, admission_rejections=1)
    b = Signals(running=2, waiting_capacity=0, preemptions=6, admission_rejections=None)
    both = combine([a, b])
    assert (both.preemptions, both.admission_rejections) == (10, None)
