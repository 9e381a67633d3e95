"""The util hash codec (fleetgate.util_hash) and the units held (fleetgate.units): the one
writer's text reads back as the values written, garbage reads as unknown."""

from __future__ import annotations

import pytest

from fleetgate.units import units_held
from fleetgate.util_hash import LATENCY_FIELDS, OBSERVED_FIELDS, UtilHash

FULL = UtilHash(
    running=3.0,
    waiting_capacity=0.0,
    kv_cache_usage=0.5,
    preemptions=2.0,
    admission_rejections=None,
    max_requests=64.0,
    metrics_ok=True,
    metrics_url="http://a/metrics,http://b/metrics",
    server="vllm",
    error=None,
    current_target=12,
    floor=2,
    ceiling=64,
    reason="increase",
    saturated=True,
    in_flight=7,
    last_poll=1700000000.25,
    state='{"target":12}',
    obs_calls=30,
    obs_overloaded=1,
    obs_timeout=0,
    signal="latency",
    latency_p50=0.125,
    latency_no_load=0.1,
)


def test_what_is_written_reads_back() -> None:
    text = FULL.encode()
    assert text["running"] == "3.0" and text["latency_p50"] == "0.125000"
    assert text["metrics_ok"] == "1" and text["admission_rejections"] == ""
    assert text["max_requests"] == "64.0"  # the request capacity the server states
    assert UtilHash.decode(text) == FULL
    assert UtilHash.decode(UtilHash().encode()) == UtilHash()


def test_groups_written_only_when_they_apply() -> None:
    held = FULL.encode(observed=False)
    assert not set(OBSERVED_FIELDS) & set(held)
    metrics_gate = UtilHash(current_target=4).encode()
    assert not set(LATENCY_FIELDS) & set(metrics_gate)
    assert {metrics_gate[k] for k in OBSERVED_FIELDS} == {""}


@pytest.mark.parametrize("junk", ["", "x", "nan", "inf", "1e999"])
def test_garbage_reads_as_unknown(junk: str) -> None:
    raw = {k: junk for k in ("current_target", "obs_calls", "in_flight", "floor")}
    util = UtilHash.decode({**raw, "metrics_ok": junk, "saturated": junk})
    assert (util.current_target, util.obs_calls, util.in_flight, util.floor) == (None,) * 4
    assert util.metrics_ok is False and util.saturated is False


def test_units_held() -> None:
    assert units_held(3, None) == 3
    assert units_held(3, b"4") == units_held(3, "4") == 7
    assert units_held(0, "4") == 0  # a counter left without leases counts nothing
    for junk in ("-2", "x", b"\xff", "nan", str(2**53)):
        assert units_held(2, junk) == 2
