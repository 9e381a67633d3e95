"""The coordinator's TOML config: decoding, one-line errors naming the field, defaults that fit
together. Environment overrides: test_config_env.py; admission keys: test_config_admission.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetgate.coordinator.config import DEFAULT_CEILING, Config, CoordinatorSettings, load_config
from fleetgate.errors import ConfigError

from ._config import BASE, EXAMPLE, error_of, parse


def test_design_example_decodes() -> None:
    config = parse(BASE)
    embed, rerank = config.gates
    assert embed.metrics_urls == ("http://vllm-embed.arpa/metrics",)
    assert embed.has_metrics and config.is_adaptive(embed)
    assert rerank.metrics_urls == () and not config.is_adaptive(rerank)
    assert rerank.ceiling == DEFAULT_CEILING and rerank.lease_ms == 10_000
    assert config.coordinator.metrics_address == ("127.0.0.1", 9464)
    # 3 polls of 12 s plus one takeover: leader_ttl 10 + a standby's retry 1 + a scrape 2
    assert config.coordinator.target_ttl == pytest.approx(36.0 + 13.0)
    assert config.gate("bge-m3") is embed
    with pytest.raises(KeyError):
        config.gate("nope")


@pytest.mark.parametrize(
    ("coordinator", "takeover"),
    [
        ("", 10.0 + 1.0 + 2.0),  # the defaults: a target lives 3 x 2 s + 13 s = 19 s
        ("leader_ttl = 0.3\npoll_interval = 0.5", 0.3 + 0.1 + 0.5),  # retry ttl/3, scrape <= poll
        ("leader_ttl = 600.0\ntarget_ttl_polls = 1", 600.0 + 1.0 + 2.0),
        ("leader_ttl = 2.0\npoll_interval = 0.5\nscrape_timeout = 0.4", 2.0 + 2 / 3 + 0.4),
    ],
)
def test_a_target_outlives_a_leader_takeover(coordinator: str, takeover: float) -> None:
    """A target's lifetime is target_ttl_polls polls plus the whole takeover: the lease
    lapsing, a standby's next try, the new leader's first scrape. Polls alone (6 s) are shorter
    than a takeover (~10 s): a SIGKILLed leader's successor would restart every gate from its
    floor."""
    c = parse(f"[coordinator]\n{coordinator}\n").coordinator
    assert c.takeover == pytest.approx(takeover)
    assert c.target_ttl == pytest.approx(c.target_ttl_polls * c.poll_interval + takeover)
    assert c.takeover > c.leader_ttl + c.campaign_interval  # the first poll's scrape too


def test_empty_file_gives_defaults() -> None:
    config = parse("")
    assert config.redis.url == "redis://127.0.0.1:6379/0" and config.redis.prefix == "fg"
    assert config.coordinator == CoordinatorSettings()
    assert config.gates == ()


def test_example_file_loads() -> None:
    config = load_config(EXAMPLE, env={})
    names = [g.name for g in config.gates]
    assert names == ["bge-m3", "llama-3.1-8b", "rerank/nemoretriever-500m-v2"]
    llm = config.gate("llama-3.1-8b")
    assert llm.metrics_urls == (
        "http://vllm-llm-0.arpa:8000/metrics",
        "http://vllm-llm-1.arpa:8000/metrics",
    )
    assert llm.model_name == "meta-llama/Llama-3.1-8B-Instruct"
    assert config.gate("bge-m3").model_name is None


def test_single_metrics_url() -> None:
    text = BASE.replace(
        'base_url = "http://vllm-embed.arpa/v1"', 'metrics_url = "http://m/metrics"'
    )
    assert parse(text).gates[0].metrics_urls == ("http://m/metrics",)


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ("floor = 4", "floor = 0", "gates[0].floor: expected int >= 1, got 0"),
        ("floor = 4", 'floor = "4"', "gates[0].floor: expected int, got str"),
        ("floor = 4", "floor = 4.5", "gates[0].floor: expected int, got float"),
        ("floor = 4", "", "gates[0].floor: missing required field"),
        ("floor = 4", "flor = 4", "gates[0].flor: unknown field (did you mean 'floor'?)"),
        (
            "max_queued = 1000\n\n",
            "max_queued = -1\n\n",
            "gates[0].max_queued: expected int >= 0, got -1",
        ),
        ("ceiling = 512", "ceiling = 2", "gates[0].ceiling: expected >= floor (4), got 2"),
        ('name = "bge-m3"', 'name = ""', "gates[0].name: gate name must not be empty"),
        ('name = "bge-m3"', 'name = "a{b}"', "gates[0].name: gate name 'a{b}' contains '{'"),
        ('name = "bge-m3"', "name = 3", "gates[0].name: expected str, got int"),
        (
            'name = "rerank/nemoretriever-500m-v2"',
            'name = "bge-m3"',
            "gates[1].name: duplicate gate name 'bge-m3' (first defined at gates[0])",
        ),
        (
            "floor = 4",
            'floor = 4\nmetrics_url = "http://m/metrics"',
            "gates[0].metrics_url: set base_url or metrics_url, not both",
        ),
        ("http://vllm-embed.arpa/v1", "http://u:pw@vllm-embed.arpa/v1", "gates[0].base_url: URL"),
        ("http://vllm-embed.arpa/v1", "ftp://vllm-embed.arpa/v1", "gates[0].base_url: URL"),
        ("http://vllm-embed.arpa/v1", "http://h/v1?key=1", "gates[0].base_url: URL"),
        ("floor = 4", 'floor = 4\nserver = "tgx"', "gates[0].server: unknown server kind 'tgx'"),
        ("floor = 4", 'floor = 4\nmodel_name = ""', "gates[0].model_name: must not be empty"),
        (
            "poll_interval = 12.0",
            "poll_interval = 0",
            "coordinator.poll_interval: expected float > 0",
        ),
        (
            "poll_interval = 12.0",
            "poll_interval = inf",
            "coordinator.poll_interval: expected float <= 3600.0, got inf",
        ),
        (
            "poll_interval = 12.0",
            "poll_interval = nan",
            "coordinator.poll_interval: expected float > 0",
        ),
        (
            "poll_interval = 12.0",
            "poll_interval = 1.0\nscrape_timeout = 5.0",
            "coordinator.scrape_timeout: must be <= poll_interval (1 s), got 5",
        ),
        (
            "poll_interval = 12.0",
            "poll_interval = 12.0\npoll_jitter = 0.9",
            "coordinator.poll_jitter: expected float <= 0.5, got 0.9",
        ),
        (
            "poll_interval = 12.0",
            "poll_intervall = 12.0",
            "coordinator.poll_intervall: unknown field (did you mean 'poll_interval'?)",
        ),
        (
            'metrics_listen = "127.0.0.1:9464"',
            'metrics_listen = "localhost"',
            "coordinator.metrics_listen: expected 'host:port'",
        ),
        (
            "leader_ttl = 10.0",
            'leader_ttl = "10s"',
            "coordinator.leader_ttl: expected float, got str",
        ),
        (  # 0 whole ms in Redis: every SET of the lease would fail
            "leader_ttl = 10.0",
            "leader_ttl = 0.0005",
            "coordinator.leader_ttl: expected float >= 0.01",
        ),
        ('prefix = "fg"', 'prefix = "a:b"', "redis.prefix: prefix 'a:b' must be"),
        (
            'url = "redis://127.0.0.1:6379/0"',
            'url = "http://:pw@h"',
            "redis.url: expected a redis://, rediss://, unix:// or redis+sentinel:// URL, got "
            "scheme 'http'",
        ),
        ("[redis]", "[rediss]", "rediss: unknown field (did you mean 'redis'?)"),
    ],
)
def test_errors_name_the_field(old: str, new: str, expected: str) -> None:
    assert old in BASE
    assert error_of(BASE.replace(old, new, 1)).startswith(expected)


def test_metrics_url_list_errors() -> None:
    gate = '[[gates]]\nname = "x"\nfloor = 1\n'
    assert error_of(gate + 'metrics_url = ["http://a/metrics", "ftp://b"]').startswith(
        "gates[0].metrics_url[1]: URL 'ftp://b' must use http"
    )
    assert "listed twice" in error_of(gate + 'metrics_url = ["http://a/m", "http://a/m"]')
    assert "empty" in error_of(gate + "metrics_url = []")
    assert error_of(gate + "metrics_url = 3").startswith("gates[0].metrics_url: expected")


def test_wrong_shapes() -> None:
    assert error_of("redis = 3") == "redis: expected table, got int"
    assert error_of("gates = 3") == "gates: expected array, got int"
    assert error_of("[gates]\nname = 'x'") == "gates: expected array, got table"


def test_password_never_echoed() -> None:
    message = error_of(BASE.replace("redis://127.0.0.1:6379/0", "http://:hunter2@h"))
    assert "hunter2" not in message
    message = error_of(BASE.replace("http://vllm-embed.arpa/v1", "http://me:hunter2@h/v1"))
    assert "hunter2" not in message


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match=rf"^{path}: config file not found$"):
        load_config(path, env={})
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path, env={})


def test_bad_toml_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[redis\nurl = 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert str(info.value).startswith(f"{path}: invalid TOML: ")
    path.write_bytes(b"a = '\xff'\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(path, env={})


def test_load_config_reads_env_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c.toml"
    path.write_text(BASE)
    monkeypatch.setenv("FLEETGATE_PREFIX", "envprefix")
    assert load_config(path).redis.prefix == "envprefix"
    assert Config.from_toml_text(BASE).redis.prefix == "envprefix"


# ---------------------------------------------------------------------------- defaults that fit


def test_scrape_timeout_follows_a_short_poll_interval() -> None:
    """``poll_interval = 0.5`` alone is accepted: the unset scrape timeout fits inside it."""
    short = Config.from_toml_text("[coordinator]\npoll_interval = 0.5\n", env={})
    assert short.coordinator.scrape_timeout == 0.5
    default = Config.from_toml_text("", env={}).coordinator
    assert (default.poll_interval, default.scrape_timeout) == (2.0, 2.0)
    slow = Config.from_toml_text("[coordinator]\npoll_interval = 30\n", env={})
    assert slow.coordinator.scrape_timeout == 2.0  # a scrape's own cap, not the poll's
    env = Config.from_toml_text("", env={"FLEETGATE_POLL_INTERVAL": "0.25"})
    assert env.coordinator.scrape_timeout == 0.25
    explicit = Config.from_toml_text(
        "[coordinator]\npoll_interval = 0.5\nscrape_timeout = 0.2\n", env={}
    )
    assert explicit.coordinator.scrape_timeout == 0.2


def test_explicit_scrape_timeout_above_the_poll_is_still_refused() -> None:
    with pytest.raises(ConfigError, match=r"^coordinator\.scrape_timeout: must be <= poll"):
        Config.from_toml_text("[coordinator]\npoll_interval = 0.5\nscrape_timeout = 2\n", env={})
    with pytest.raises(ConfigError, match=r"^coordinator\.scrape_timeout: expected float > 0"):
        Config.from_toml_text("[coordinator]\nscrape_timeout = 0\n", env={})
