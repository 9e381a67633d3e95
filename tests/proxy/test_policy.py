"""The proxy's pure parts: configuration errors naming the field, the header policy (parse and
clamp), hop-by-hop headers, outcomes, Retry-After, and the CLI's configuration."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from fleetgate.cli import build_parser
from fleetgate.errors import ConfigError
from fleetgate.proxy import ProxyConfig, load_config, one_route
from fleetgate.proxy.main import config_from_args
from fleetgate.proxy.policy import (
    Ask,
    BadHeader,
    classify,
    forward_request_headers,
    forward_response_headers,
    parse_ask,
    retry_after,
)

ROOT = Path(__file__).resolve().parents[2]


def _config(**route: Any) -> ProxyConfig:
    raw = {"routes": [{"upstream": "http://up:8000", "gate": "g", **route}]}
    config: ProxyConfig = ProxyConfig.from_mapping(raw, env={})
    return config


def _h(**headers: str) -> list[tuple[bytes, bytes]]:
    return [(k.replace("_", "-").lower().encode(), v.encode()) for k, v in headers.items()]


# -- configuration ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "strip", "raw", "forwarded"),
    [
        ("/rerank", False, b"/rerank/v1/ranking", b"/rerank/v1/ranking"),
        ("/rerank", True, b"/rerank/v1/ranking", b"/v1/ranking"),
        ("/rerank/", True, b"/rerank/v1/ranking", b"/v1/ranking"),
        ("/rerank", True, b"/rerank", b"/"),
        ("/rerank", True, b"/rerank/", b"/"),
        ("/rerank", True, b"/rerank/a%2Fb", b"/a%2Fb"),  # the rest is forwarded as sent
        ("/", True, b"/x/y", b"/x/y"),
        ("/rerank", True, b"/re%72ank/x", None),  # the prefix itself was percent-encoded
    ],
)
def test_strip_path(path: str, strip: bool, raw: bytes, forwarded: bytes | None) -> None:
    route = _config(path=path, strip_path=strip).routes[0]
    assert route.upstream_path(raw) == forwarded


def test_the_example_config_loads() -> None:
    config = load_config(ROOT / "proxy/example.toml", env={})
    assert [r.gate for r in config.routes] == [
        "rerank/nemoretriever-500m-v2",
        "llama-3.1-8b",
        "bge-m3",
    ]
    rerank = config.routes[0]
    assert rerank.priority_range == (-10, 10) and rerank.weight_cap == 512
    assert config.routes[1].matches_path("/v1/chat/completions")
    assert not rerank.matches_path("/v1/rankings") and rerank.matches_path("/v1/ranking")


@pytest.mark.parametrize(
    ("route", "wanted"),
    [
        ({"upstream": "ftp://x"}, "routes[0].upstream: expected an http:// or https:// URL"),
        ({"upstream": "http://user:sekrit@x"}, "credentials in the URL are refused"),
        ({"upstream": "http://x/?key=1"}, "routes[0].upstream"),
        ({"gate": "a{b"}, "routes[0].gate: gate name 'a{b' contains '{'"),
        ({"path": "v1"}, "routes[0].path: expected a path prefix starting with '/'"),
        ({"weight": 0}, "routes[0].weight: expected int >= 1"),
        ({"priority": 500}, "routes[0].priority: expected int <= 100"),
        ({"priority": 5, "max_priority": 3}, "routes[0].priority: 5 is outside"),
        ({"weight": 4, "max_weight": 2}, "routes[0].weight: 4 is above max_weight 2"),
        ({"tenants": ["ok", "b}ad"]}, "routes[0].tenants[1]: tenant 'b}ad' contains '}'"),
        ({"gate_defaults": {"floor": 0}}, "routes[0].gate_defaults: gate 'g': floor"),
        ({"gate_defaults": {"flor": 2}}, "routes[0].gate_defaults"),
        ({"deadline_ms": 0}, "routes[0].deadline_ms: expected int >= 1"),
        ({"bogus": 1}, "routes[0].bogus: unknown field"),
    ],
)
def test_a_bad_route_names_its_field(route: dict[str, Any], wanted: str) -> None:
    with pytest.raises(ConfigError) as err:
        _config(**route)
    assert wanted in str(err.value)
    assert "sekrit" not in str(err.value)


def test_bad_top_level_values_name_their_field() -> None:
    cases = [
        ({"routes": []}, "routes: at least one"),
        ({"routes": [{"gate": "g"}]}, "routes[0].upstream: missing required field"),
        ({"proxy": {"listen": "nope"}}, "proxy.listen: expected 'host:port'"),
        ({"proxy": {"max_header_bytes": 10}}, "proxy.max_header_bytes: expected int >= 1024"),
        ({"redis": {"url": "http://x"}}, "redis.url"),
        ({"proxy": {"metrics_path": "/v1"}}, "routes[0].path: '/v1' is the proxy's own"),
    ]
    for extra, wanted in cases:
        raw: dict[str, Any] = {"routes": [{"upstream": "http://u", "gate": "g", "path": "/v1"}]}
        raw.update(extra)
        with pytest.raises(ConfigError) as err:
            ProxyConfig.from_mapping(raw, env={})
        assert wanted in str(err.value), (extra, str(err.value))


def test_invalid_toml_and_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "p.toml"
    bad.write_text("[[routes]\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml")


def test_environment_fills_redis_and_flags_win() -> None:
    env = {"FLEETGATE_REDIS_URL": "redis://envhost:1/0", "FLEETGATE_PREFIX": "envp"}
    config = ProxyConfig.from_mapping({"routes": [{"upstream": "http://u", "gate": "g"}]}, env)
    assert (config.redis.url, config.redis.prefix) == ("redis://envhost:1/0", "envp")
    over = config.with_overrides(listen="0.0.0.0:9", redis="redis://flag:2/0", prefix="fp")
    assert over.proxy.address == ("0.0.0.0", 9)
    assert (over.redis.url, over.redis.prefix) == ("redis://flag:2/0", "fp")
    with pytest.raises(ConfigError, match=r"proxy\.listen"):
        config.with_overrides(listen="x")


def test_the_environment_wins_over_the_file_as_for_every_command() -> None:
    """flags > environment > file > defaults, as the coordinator and `fleetgate status` do (a
    Secret's URL in the environment over a ConfigMap's file)."""
    env = {"FLEETGATE_REDIS_URL": "redis://envhost:1/0"}
    raw = {"routes": [{"upstream": "http://u", "gate": "g"}], "redis": {"url": "redis://file:2/0"}}
    config = ProxyConfig.from_mapping(raw, env)
    assert (config.redis.url, config.redis.prefix) == ("redis://envhost:1/0", "fg")
    assert ProxyConfig.from_mapping(raw, {}).redis.url == "redis://file:2/0"


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["proxy", *argv])


def test_cli_one_route_and_config(tmp_path: Path) -> None:
    config = config_from_args(
        _args("--upstream", "http://up:1/", "--gate", "g", "--listen", "127.0.0.1:0")
    )
    assert config.routes[0].upstream == "http://up:1" and config.routes[0].path == "/"
    assert config.proxy.address == ("127.0.0.1", 0)
    with pytest.raises(ConfigError, match="--upstream: expected an http"):
        config_from_args(_args("--upstream", "nope", "--gate", "g"))
    with pytest.raises(ConfigError, match="give --config FILE, or both"):
        config_from_args(_args("--gate", "g"))
    example = str(ROOT / "proxy/example.toml")
    with pytest.raises(ConfigError, match="route of their own"):
        config_from_args(_args("--config", example, "--gate", "g"))
    assert config_from_args(_args("--config", example, "--prefix", "zz")).redis.prefix == "zz"


def test_cli_one_route_takes_the_gate_settings() -> None:
    """Without a coordinator the gate's floor is its cap: the one-route flags set it (else the
    default floor, 1, caps every caller of the proxy at one call at a time)."""
    config = config_from_args(
        _args(
            "--upstream", "http://up:1", "--gate", "g",
            "--floor", "8", "--ceiling", "32", "--max-queued", "50",
        )
    )  # fmt: skip
    assert config.routes[0].gate_defaults == {"floor": 8, "ceiling": 32, "max_queued": 50}
    one = ("--upstream", "http://u", "--gate", "g")
    assert config_from_args(_args(*one)).routes[0].gate_defaults == {}
    with pytest.raises(ConfigError, match="--floor: "):
        config_from_args(_args(*one, "--floor", "0"))
    with pytest.raises(ConfigError, match="--ceiling"):
        config_from_args(_args(*one, "--floor", "8", "--ceiling", "4"))
    example = str(ROOT / "proxy/example.toml")
    with pytest.raises(ConfigError, match="gate_defaults"):
        config_from_args(_args("--config", example, "--floor", "8"))


def test_one_route_defaults() -> None:
    config = one_route(upstream="http://u", gate="g", env={})
    assert config.proxy.listen == "127.0.0.1:8080"
    assert config.routes[0].describe() == "/ -> http://u via gate 'g'"


# -- the header policy --------------------------------------------------------------------------


def test_absent_headers_take_the_route_defaults() -> None:
    route = _config(priority=2, max_priority=5, tenant="t", weight=3, deadline_ms=1500).routes[0]
    assert parse_ask([], route) == Ask(priority=2, tenant="t", weight=3, deadline=1.5)


def test_headers_are_clamped_to_the_route() -> None:
    route = _config(
        min_priority=-5,
        max_priority=10,
        tenants=["search", "ingest"],
        max_weight=64,
        max_deadline_ms=60_000,
    ).routes[0]
    ask = parse_ask(
        _h(
            x_fleetgate_priority="100",
            x_fleetgate_tenant="search",
            x_fleetgate_weight="1000",
            x_fleetgate_deadline_ms="999999",
        ),
        route,
    )
    assert ask == Ask(priority=10, tenant="search", weight=64, deadline=60.0)
    low = parse_ask(_h(x_fleetgate_priority="-100", x_fleetgate_tenant="intruder"), route)
    assert (low.priority, low.tenant) == (-5, None)  # an unlisted tenant: the route's own
    assert parse_ask(_h(x_fleetgate_priority=" 7 "), route).priority == 7


def test_by_default_the_headers_cannot_raise_a_caller() -> None:
    route = _config().routes[0]
    ask = parse_ask(_h(x_fleetgate_priority="100", x_fleetgate_tenant="vip"), route)
    assert (ask.priority, ask.tenant, ask.weight) == (0, None, 1)
    anyone = _config(tenants=["*"]).routes[0]
    assert parse_ask(_h(x_fleetgate_tenant="vip"), anyone).tenant == "vip"


@pytest.mark.parametrize(
    ("headers", "wanted"),
    [
        ({"x_fleetgate_priority": "high"}, "X-Fleetgate-Priority: expected an integer"),
        ({"x_fleetgate_priority": "101"}, "X-Fleetgate-Priority: expected an integer in"),
        ({"x_fleetgate_priority": "1e3"}, "X-Fleetgate-Priority"),
        ({"x_fleetgate_priority": "9" * 400}, "X-Fleetgate-Priority: expected an integer"),
        ({"x_fleetgate_weight": "0"}, "X-Fleetgate-Weight: expected an integer >= 1, got 0"),
        ({"x_fleetgate_weight": "2.5"}, "X-Fleetgate-Weight"),
        ({"x_fleetgate_deadline_ms": "-5"}, "X-Fleetgate-Deadline-Ms: expected milliseconds"),
        ({"x_fleetgate_deadline_ms": ""}, "X-Fleetgate-Deadline-Ms"),
        ({"x_fleetgate_tenant": "a{b"}, "X-Fleetgate-Tenant: tenant 'a{b' contains '{'"),
        ({"x_fleetgate_tenant": "x" * 300}, "X-Fleetgate-Tenant: tenant"),
    ],
)
def test_malformed_headers_are_refused(headers: dict[str, str], wanted: str) -> None:
    route = _config(max_priority=100, tenants=["*"], max_weight=10).routes[0]
    with pytest.raises(BadHeader) as err:
        parse_ask(_h(**headers), route)
    assert wanted in str(err.value)
    assert len(str(err.value)) < 400


def test_a_header_given_twice_is_refused() -> None:
    route = _config().routes[0]
    twice = [(b"x-fleetgate-weight", b"1"), (b"x-fleetgate-weight", b"1")]
    with pytest.raises(BadHeader, match="given more than once"):
        parse_ask(twice, route)


def test_hop_by_hop_and_fleetgate_headers_stop_at_the_proxy() -> None:
    headers = [
        (b"host", b"proxy:8080"),
        (b"connection", b"keep-alive, X-Hop-Secret"),
        (b"x-hop-secret", b"1"),
        (b"keep-alive", b"timeout=5"),
        (b"te", b"trailers"),
        (b"transfer-encoding", b"chunked"),
        (b"upgrade", b"h2c"),
        (b"proxy-authorization", b"Basic eA=="),
        (b"authorization", b"Bearer sk-1"),
        (b"x-fleetgate-tenant", b"a"),
        (b"x-forwarded-for", b"10.0.0.1"),
        (b"content-type", b"application/json"),
    ]
    out = dict(forward_request_headers(headers, client_ip="127.0.0.1", trusted=True))
    assert out == {
        b"authorization": b"Bearer sk-1",
        b"content-type": b"application/json",
        b"x-forwarded-for": b"10.0.0.1, 127.0.0.1",
        b"via": b"1.1 fleetgate",
    }
    # from a peer that is no trusted proxy, the chain is its address alone
    untrusted = dict(forward_request_headers(headers, client_ip="127.0.0.1"))
    assert untrusted[b"x-forwarded-for"] == b"127.0.0.1"
    back = forward_response_headers(
        [
            (b"Content-Type", b"text/event-stream"),
            (b"Transfer-Encoding", b"chunked"),
            (b"Connection", b"close, X-Private"),
            (b"X-Private", b"1"),
            (b"Content-Encoding", b"gzip"),
        ]
    )
    assert back == [
        (b"content-type", b"text/event-stream"),
        (b"content-encoding", b"gzip"),
        (b"via", b"1.1 fleetgate"),
    ]


@pytest.mark.parametrize(
    ("status", "headers", "length_kept"),
    [
        (200, [(b"Content-Length", b"5")], True),
        (200, [(b"Transfer-Encoding", b"chunked"), (b"Content-Length", b"3")], False),
        (304, [(b"Content-Length", b"1234"), (b"ETag", b'"v1"')], False),
        (204, [(b"Content-Length", b"99")], False),
        (404, [(b"Content-Length", b"9")], True),
    ],
)
def test_a_response_length_that_frames_nothing_is_dropped(
    status: int, headers: list[tuple[bytes, bytes]], length_kept: bool
) -> None:
    back = dict(forward_response_headers(headers, status))
    assert (b"content-length" in back) == length_kept
    assert b"transfer-encoding" not in back and back[b"via"] == b"1.1 fleetgate"


@pytest.mark.parametrize(
    ("status", "timed_out", "outcome"),
    [
        (200, False, "ok"),
        (204, False, "ok"),
        (304, False, "ok"),
        (400, False, "ok"),
        (404, False, "ok"),
        (429, False, "overloaded"),
        (503, False, "overloaded"),
        (529, False, "overloaded"),
        (408, False, "timeout"),
        (504, False, "timeout"),
        (500, False, "error"),
        (502, False, "error"),
        (None, False, "error"),
        (None, True, "timeout"),
        (200, True, "timeout"),
    ],
)
def test_classify(status: int | None, timed_out: bool, outcome: str) -> None:
    assert classify(status, timed_out=timed_out) == outcome


def test_retry_after_is_an_integer_of_at_least_one() -> None:
    assert [retry_after(s) for s in (0, 0.2, 1, 1.01, 7.9, -3)] == [1, 1, 1, 2, 8, 1]
    assert retry_after(float("nan")) == 1 and retry_after(float("inf")) == 1
