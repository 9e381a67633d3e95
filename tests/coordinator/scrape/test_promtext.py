"""The selective exposition reader: its fast path agrees with prometheus_client's parser."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from fleetgate.coordinator.scrape.promtext import _plain, select_samples

_names = st.sampled_from(["vllm:num_requests_running", "te_queue_size", "x", "a:b_c9", "9bad"])
_label_names = st.sampled_from(["model_name", "engine", "le", "a", "_x", "0no"])
_label_values = st.one_of(
    st.text(alphabet="abc:/.-0_", max_size=8), st.text(alphabet='ab =,"\\\n{}#é', max_size=6)
)
_values = st.one_of(
    st.sampled_from(["1", "0.5", "NaN", "+Inf", "-Inf", "1e3", "1_0", "0x1A", "", "- 1", "1 2"]),
    st.floats(allow_nan=False).map(repr),
)


@st.composite
def _lines(draw: st.DrawFn) -> str:
    name = draw(_names)
    pairs = draw(st.lists(st.tuples(_label_names, _label_values), max_size=3))
    sep = draw(st.sampled_from([",", ",", ", ", ",,"]))
    labels = sep.join(f'{k}="{v}"' for k, v in pairs)
    braces = draw(st.sampled_from(["{%s}", "{%s}", "{%s,}", "%s", "{ %s }"]))
    body = braces % labels if (pairs or "{" in braces) else ""
    gap = draw(st.sampled_from([" ", "\t", "  "]))
    tail = draw(st.sampled_from(["", "", " ", " 1700000000", ' # {a="b"} 1']))
    return f"{name}{body}{gap}{draw(_values)}{tail}"


@settings(max_examples=2000, deadline=None)
@given(_lines())
@pytest.mark.long
def test_fast_path_agrees_with_prometheus_client(line: str) -> None:
    fast = _plain(line)
    if fast is None:
        return  # the slow path (prometheus_client itself) reads it
    samples = [s for f in text_string_to_metric_families(line + "\n") for s in f.samples]
    assert len(samples) == 1, line
    slow = samples[0]
    assert (fast.name, fast.labels) == (slow.name, slow.labels), line
    value = float(slow.value)
    assert fast.value == value or (math.isnan(fast.value) and math.isnan(value)), line


def test_escaped_and_odd_lines_go_to_prometheus_client() -> None:
    text = (
        'x{a="q\\"uote"} 1\n'  # an escaped quote: not plain
        'x{a="b", c="d"} 2\n'  # a blank inside the braces: not plain
        "x 3 1700000000\n"  # a timestamp: not plain
        'x{a="b"} 4\n'  # plain
    )
    samples = select_samples(text, frozenset({"x"}))
    assert [(s.labels, s.value) for s in samples] == [
        ({"a": "b"}, 4.0),
        ({"a": 'q"uote'}, 1.0),
        ({"a": "b", "c": "d"}, 2.0),
        ({}, 3.0),
    ]
