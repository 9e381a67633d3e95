"""fleetgate.observed: latency buckets, readings of the obs hash, windows, quantiles, tallies."""

from __future__ import annotations

import itertools
import math

import pytest

from fleetgate.admission import lane_class
from fleetgate.errors import ConfigError
from fleetgate.observed import (
    BOUNDS,
    OVERFLOW,
    Reading,
    TokenUsage,
    bucket_of,
    delta,
    encode_report,
    quantile,
    tally,
    typical_latency,
    validate_outcome,
)


def test_bounds_are_geometric_from_1ms_to_a_minute() -> None:
    assert BOUNDS[0] == pytest.approx(0.001)
    assert BOUNDS[-1] == pytest.approx(65.536)
    for lo, hi in itertools.pairwise(BOUNDS):
        assert hi / lo == pytest.approx(2**0.25)
    assert OVERFLOW == len(BOUNDS) == 65


@pytest.mark.parametrize(
    ("latency", "bucket"),
    [
        (0.0, 0),
        (-1.0, 0),
        (0.0005, 0),
        (0.001, 0),
        (0.0010001, 1),
        (0.002, 4),
        (1.0, 40),
        (65.536, 64),
        (65.6, 65),
        (1e9, 65),
        (math.inf, 65),
    ],
)
def test_bucket_of(latency: float, bucket: int) -> None:
    assert bucket_of(latency) == bucket


def test_every_latency_lies_in_its_bucket() -> None:
    for i in range(1, OVERFLOW):
        lo, hi = BOUNDS[i - 1], BOUNDS[i]
        assert bucket_of(hi) == i
        assert bucket_of((lo + hi) / 2) == i
        assert bucket_of(lo * (1 + 1e-9)) == i


def test_tally_sums_reports_into_hincrby_pairs() -> None:
    reports = [
        encode_report("ok", 0.1),
        encode_report("ok", 0.1),
        encode_report("ok", None),  # ok without a latency: counted, no latency
        encode_report("overloaded", 2.0),  # latency of a failure is not counted
        encode_report("timeout", None),
        encode_report("error", None),
        "",  # no report
    ]
    pairs = tally(reports)
    got = dict(zip(pairs[::2], pairs[1::2], strict=True))
    b = f"b{bucket_of(0.1)}"
    assert got == {
        "ok": 3,
        "lat_n": 2,
        "lat_us": 200_000,
        b: 2,
        "overloaded": 1,
        "timeout": 1,
        "error": 1,
    }
    assert tally([]) == [] and tally(["", ""]) == []


def test_token_reports_are_summed_per_tenant_and_read_back() -> None:
    reports = [
        encode_report("ok", 0.1, (400, 100, lane_class(0, "chat"))),
        encode_report("ok", None, (600, 300, lane_class(10, "chat"))),
        encode_report("error", None, (50, 0, lane_class(0, None))),
        encode_report("ok", 0.1, (10, 10, lane_class(0, "a;b"))),  # a tenant may hold ';'
        encode_report("ok", 0.1, (0, 30, lane_class(0, "free"))),  # asked none: not settled
    ]
    pairs = tally(reports)
    got = dict(zip(pairs[::2], pairs[1::2], strict=True))
    assert (got["tn:chat"], got["ta:chat"], got["tu:chat"]) == (2, 1000, 400)
    assert (got["tn:"], got["ta:"], got["tu:"]) == (1, 50, 0)
    assert got["ta:a;b"] == 10 and got["ok"] == 4 and got["lat_n"] == 3
    # settlements per lane class (band and tenant): used - asked of the calls that asked tokens
    assert (got["vc:100}chat"], got["vc:090}chat"], got["vc:"]) == (-300, -300, -50)
    assert got["vc:100}a;b"] == 0 and "vc:100}free" not in got
    usage = TokenUsage.parse({k: str(v) for k, v in got.items()} | {"tn:x": "garbage"})
    assert usage["chat"] == TokenUsage(reports=2, asked=1000, used=400)
    assert usage["chat"].ratio == 0.4 and usage["x"].reports == 0
    assert (
        usage["chat"].use_per_call(least_reports=2) == 200 and usage["chat"].use_per_call() is None
    )
    assert usage["chat"].estimate(1000, least_reports=2) == 200  # what its calls use per call
    assert usage["chat"].estimate(1000) == 1000  # fewer than 20 reports: what is asked
    assert TokenUsage(reports=50, asked=5_000, used=45_000).estimate(100) == 100  # never above
    assert Reading.parse({k: str(v) for k, v in got.items()}).ok == 4  # other fields ignored


def test_validate_outcome() -> None:
    for outcome in ("ok", "overloaded", "timeout", "error"):
        assert validate_outcome(outcome) == outcome
    for bad in ("OK", "429", "", None, 1):
        with pytest.raises(ConfigError, match="outcome"):
            validate_outcome(bad)


def test_reading_parse_and_delta() -> None:
    raw = {b"ok": b"10", b"overloaded": b"2", b"lat_n": b"10", b"lat_us": b"1000000", b"b40": b"10"}
    first = Reading.parse(raw, at=100.0)
    assert (first.ok, first.overloaded, first.lat_n, first.buckets) == (10, 2, 10, {40: 10})
    assert first.calls == 12 and first.mean_latency == pytest.approx(0.1)
    raw2 = {
        "ok": "25",
        "overloaded": "2",
        "timeout": "1",
        "lat_n": "25",
        "lat_us": "2500000",
        "b40": "20",
        "b41": "5",
        "junk": "x",
        "b99": "3",
        "error": "nope",
    }
    second = Reading.parse(raw2, at=102.0)
    w = delta(first, second)
    assert w is not None
    assert (w.ok, w.overloaded, w.timeout, w.error, w.lat_n, w.lat_us) == (
        15,
        0,
        1,
        0,
        15,
        1_500_000,
    )
    assert w.buckets == {40: 10, 41: 5}
    assert w.seconds == pytest.approx(2.0)
    assert w.busy == pytest.approx(0.75)  # 1.5 s of latency over 2 s
    assert delta(None, second) is None


def test_delta_is_unknown_after_a_reset() -> None:
    before = Reading(ok=10, lat_n=10, lat_us=10, buckets={3: 10}, at=1.0)
    assert delta(before, Reading(at=2.0)) is None  # key deleted / Redis restarted
    assert delta(before, Reading(ok=11, lat_n=11, lat_us=11, buckets={4: 11}, at=2.0)) is None
    assert delta(before, Reading(ok=12, lat_n=12, lat_us=12, buckets={3: 12}, at=0.5)) is None
    same = delta(before, before)
    assert same is not None and same.calls == 0 and same.buckets == {}


def test_quantile_interpolates_inside_the_bucket() -> None:
    assert quantile({}, 0.5) is None
    assert quantile({40: 0}, 0.5) is None
    lo, hi = BOUNDS[39], BOUNDS[40]
    assert quantile({40: 10}, 0.5) == pytest.approx(lo + (hi - lo) / 2)
    assert quantile({40: 10}, 1.0) == pytest.approx(hi)
    # 90 fast, 10 slow: the median is fast, the p95 slow
    spread = {20: 90, 60: 10}
    assert bucket_of(quantile(spread, 0.5) or 0) == 20
    assert bucket_of(quantile(spread, 0.95) or 0) == 60
    assert quantile({OVERFLOW: 5}, 0.5) == BOUNDS[-1]


def test_typical_latency_prefers_the_exact_mean_in_the_quantile_bucket() -> None:
    # every call took 0.2 s: the median bucket holds the mean, so the mean is exact
    w = Reading(ok=100, lat_n=100, lat_us=100 * 200_000, buckets={bucket_of(0.2): 100})
    assert typical_latency(w) == pytest.approx(0.2)
    # a mean pulled away by a slow tail: the interpolated median stands
    w = Reading(
        ok=100,
        lat_n=100,
        lat_us=90 * 10_000 + 10 * 30_000_000,
        buckets={bucket_of(0.01): 90, bucket_of(30.0): 10},
    )
    assert bucket_of(typical_latency(w) or 0) == bucket_of(0.01)
    assert typical_latency(Reading()) is None


@pytest.mark.parametrize("true_share", [0.25, 0.6, 1.0])
def test_a_caller_charged_by_estimate_converges_to_its_true_use(true_share: float) -> None:
    """A caller that asks ``raw`` at most, is charged ``estimate(raw)`` and reports what it used
    (``true_share`` of raw) against that charge: its charge settles at what it uses. (A ratio
    used / asked applied to asks already scaled by it settles at sqrt(true_share) x raw: 1,000
    of 2,000 tokens for calls that use 500.)"""
    raw, usage = 2_000, TokenUsage()
    used = math.ceil(true_share * raw)
    charges = []
    for _ in range(300):
        charge = usage.estimate(raw)
        charges.append(charge)
        usage = TokenUsage(usage.reports + 1, usage.asked + charge, usage.used + used)
    assert charges[0] == raw  # nothing learnt yet: what is asked
    assert charges[-1] == used


def test_a_reading_sums_the_settlements_of_every_tenant() -> None:
    """tn/ta/tu per tenant summed (the coordinator's token budget reads the gate's used /
    charged), and a window of them as of every counter."""
    from fleetgate.observed import Reading, delta

    first = Reading.parse({b"tn:": b"2", b"ta:": b"400", b"tu:": b"300", b"ok": b"2"}, at=1.0)
    second = Reading.parse(
        {
            "tn:": "3",
            "ta:": "600",
            "tu:": "420",
            "tn:a": "5",
            "ta:a": "1000",
            "tu:a": "500",
            "ok": "2",
        },
        at=2.0,
    )
    assert (first.tok_reports, first.tok_asked, first.tok_used) == (2, 400, 300)
    window = delta(first, second)
    assert window is not None
    assert (window.tok_reports, window.tok_asked, window.tok_used) == (6, 1200, 620)
    assert delta(second, first) is None  # counters went down: the window is unknown
