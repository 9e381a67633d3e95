"""The coordinator's config decoder, fuzzed: whatever the TOML text, its structure, the gate
tables or the environment, it raises only :class:`ConfigError` (one printable line, no
traceback)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetgate.coordinator.config import Config
from fleetgate.errors import ConfigError

pytestmark = pytest.mark.long  # 800 fuzzed configs: 8-14 s

_KEYS = [
    "redis", "url", "prefix", "coordinator", "poll_interval", "poll_jitter", "leader_ttl",
    "metrics_listen", "target_ttl_polls", "scrape_timeout", "max_body_bytes", "adaptive",
    "gates", "name", "floor", "ceiling", "max_queued", "lease_ms", "waiter_ms", "base_url",
    "metrics_url", "model_name", "server",
]  # fmt: skip
_SCALARS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.text(max_size=30),
    st.sampled_from(
        [
            "redis://127.0.0.1:6379/0",
            "rediss://u:p@h:1/0?ssl_ca_certs=/x",
            "redis://h:notaport/0",
            "http://m/v1",
            "http://u:pw@m/metrics",
            "ftp://m/metrics",
            "127.0.0.1:0",
            "[::1]:99999",
            "vllm",
            "a{b}",
            "",
        ]
    ),
)
_KEY = st.one_of(st.sampled_from(_KEYS), st.text(max_size=8))
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(_KEY, inner, max_size=5)),
    max_leaves=20,
)


def _toml_value(value: Any) -> str:
    """A TOML rendering of ``value`` (possibly invalid TOML: the decoder must cope)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value).replace("inf", "inf").replace("nan", "nan")
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return "{" + ", ".join(f'"{k}" = {_toml_value(v)}' for k, v in value.items()) + "}"


@st.composite
def toml_ish(draw: st.DrawFn) -> str:
    """Section headers, key = value lines and raw junk, in any order."""
    lines = []
    for _ in range(draw(st.integers(0, 12))):
        kind = draw(st.integers(0, 4))
        if kind == 0:
            lines.append(f"[{draw(st.sampled_from(['redis', 'coordinator', 'x']))}]")
        elif kind == 1:
            lines.append("[[gates]]")
        elif kind == 2:
            lines.append(f"{draw(st.sampled_from(_KEYS))} = {_toml_value(draw(_VALUES))}")
        elif kind == 3:
            lines.append(draw(st.text(max_size=40)))
        else:
            lines.append(f'"{draw(st.text(max_size=6))}" = {_toml_value(draw(_SCALARS))}')
    return "\n".join(lines)


def _only_config_errors(call: Callable[[], object]) -> None:
    try:
        call()
    except ConfigError as exc:
        text = str(exc)
        assert text and text.isprintable(), text
        assert "Traceback" not in text


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(toml_ish())
def test_config_text_fuzz_only_config_errors(text: str) -> None:
    _only_config_errors(lambda: Config.from_toml_text(text, env={}))
    _only_config_errors(
        lambda: Config.from_toml_text(text.encode("utf-8", "surrogatepass"), env={})
    )


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(_KEY, _VALUES, max_size=4))
def test_config_structure_fuzz_only_config_errors(raw: dict[str, Any]) -> None:
    _only_config_errors(lambda: Config.from_mapping(raw, env={}))


@settings(max_examples=200, deadline=None)
@given(
    st.fixed_dictionaries(
        {"name": st.text(max_size=12), "floor": _SCALARS},
        optional={k: _VALUES for k in ("ceiling", "max_queued", "metrics_url", "server")},
    ),
    st.dictionaries(
        st.sampled_from(
            ["FLEETGATE_REDIS_URL", "FLEETGATE_POLL_INTERVAL", "FLEETGATE_ADAPTIVE",
             "KG_ADAPTIVE_CONCURRENCY", "MODEL_MAX_CONCURRENCY", "FLEETGATE_METRICS_LISTEN"]
        ),
        st.text(max_size=12),
        max_size=3,
    ),
)  # fmt: skip
def test_gate_tables_and_env_fuzz_only_config_errors(
    gate: dict[str, Any], env: dict[str, str]
) -> None:
    _only_config_errors(lambda: Config.from_mapping({"gates": [gate]}, env=env))
