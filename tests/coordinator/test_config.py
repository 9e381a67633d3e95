"""The coordinator's TOML config: decoding, one-line errors naming the field, env overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

import fleetgate.coordinator
from fleetgate.coordinator.config import (
    DEFAULT_CEILING,
    Config,
    CoordinatorSettings,
    GateConfig,
    load_config,
)
from fleetgate.coordinator.controller import ControllerParams
from fleetgate.errors import ConfigError

EXAMPLE = Path(fleetgate.coordinator.__file__).with_name("example.toml")

BASE = """\
[redis]
url = "redis://127.0.0.1:6379/0"
prefix = "fg"

[coordinator]
poll_interval = 12.0
leader_ttl = 10.0
metrics_listen = "127.0.0.1:9464"

[[gates]]
name = "bge-m3"
base_url = "http://vllm-embed.arpa/v1"
floor = 4
ceiling = 512
max_queued = 1000

[[gates]]
name = "rerank/nemoretriever-500m-v2"
floor = 32
max_queued = 1000
"""


def parse(text: str, **env: str) -> Config:
    return Config.from_toml_text(text, env=env)


def error_of(text: str, **env: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse(text, **env)
    message = str(info.value)
    assert "\n" not in message
    return message


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


# ---------------------------------------------------------------------------- env overrides


def test_env_overrides() -> None:
    config = parse(
        BASE,
        FLEETGATE_REDIS_URL="rediss://cache.internal:6380/2",
        FLEETGATE_PREFIX="prod",
        FLEETGATE_POLL_INTERVAL="5",
        FLEETGATE_METRICS_LISTEN="[::1]:9500",
    )
    assert config.redis.url == "rediss://cache.internal:6380/2"
    assert config.redis.prefix == "prod"
    assert config.coordinator.poll_interval == 5.0
    assert config.coordinator.metrics_address == ("::1", 9500)


def test_empty_env_value_counts_as_unset() -> None:
    assert parse(BASE, FLEETGATE_PREFIX="", FLEETGATE_ADAPTIVE="").redis.prefix == "fg"


@pytest.mark.parametrize(
    ("env", "adaptive"),
    [
        ({}, True),
        ({"FLEETGATE_ADAPTIVE": "0"}, False),
        ({"FLEETGATE_ADAPTIVE": "off"}, False),
        ({"KG_ADAPTIVE_CONCURRENCY": "0"}, False),
        ({"KG_ADAPTIVE_CONCURRENCY": "false"}, False),
        ({"KG_ADAPTIVE_CONCURRENCY": "1"}, True),
        ({"FLEETGATE_ADAPTIVE": "1", "KG_ADAPTIVE_CONCURRENCY": "0"}, False),  # off wins
    ],
)
def test_adaptive_switches(env: dict[str, str], adaptive: bool) -> None:
    config = parse(BASE, **env)
    assert config.coordinator.adaptive is adaptive
    assert config.is_adaptive(config.gates[0]) is adaptive


def test_env_can_switch_adaptation_on() -> None:
    text = BASE.replace("[coordinator]", "[coordinator]\nadaptive = false")
    assert parse(text).coordinator.adaptive is False
    assert parse(text, FLEETGATE_ADAPTIVE="yes").coordinator.adaptive is True


def test_model_max_concurrency_is_the_default_ceiling() -> None:
    config = parse(BASE, MODEL_MAX_CONCURRENCY="64")
    embed, rerank = config.gates
    assert embed.ceiling == 512  # set in the file: the file wins
    assert rerank.ceiling == 64
    # A default ceiling never undercuts the gate's own floor.
    assert parse(BASE, MODEL_MAX_CONCURRENCY="8").gates[1].ceiling == 32


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (
            {"FLEETGATE_POLL_INTERVAL": "soon"},
            "FLEETGATE_POLL_INTERVAL: expected seconds, got 'soon'",
        ),
        ({"FLEETGATE_POLL_INTERVAL": "-1"}, "FLEETGATE_POLL_INTERVAL: expected float > 0"),
        ({"FLEETGATE_POLL_INTERVAL": "inf"}, "FLEETGATE_POLL_INTERVAL: expected float <= 3600"),
        ({"FLEETGATE_PREFIX": "a{b"}, "FLEETGATE_PREFIX: prefix 'a{b' must be"),
        ({"FLEETGATE_REDIS_URL": "localhost:6379"}, "FLEETGATE_REDIS_URL: expected a redis://"),
        ({"FLEETGATE_METRICS_LISTEN": "9464"}, "FLEETGATE_METRICS_LISTEN: expected 'host:port'"),
        ({"FLEETGATE_ADAPTIVE": "maybe"}, "FLEETGATE_ADAPTIVE: expected 0/1"),
        ({"KG_ADAPTIVE_CONCURRENCY": "2"}, "KG_ADAPTIVE_CONCURRENCY: expected 0/1"),
        ({"MODEL_MAX_CONCURRENCY": "0"}, "MODEL_MAX_CONCURRENCY: expected an int >= 1, got '0'"),
        ({"MODEL_MAX_CONCURRENCY": "lots"}, "MODEL_MAX_CONCURRENCY: expected an int >= 1"),
        # '²'.isdigit() is true, int('²') raises ValueError
        ({"MODEL_MAX_CONCURRENCY": "²"}, "MODEL_MAX_CONCURRENCY: expected an int >= 1, got '²'"),
    ],
)
def test_bad_env_names_the_variable(env: dict[str, str], expected: str) -> None:
    assert error_of(BASE, **env).startswith(expected)


def test_structs_validate_when_built_directly() -> None:
    with pytest.raises(ConfigError, match="ceiling"):
        GateConfig(name="x", floor=600)  # default ceiling 512 < floor
    with pytest.raises(ConfigError, match="name"):
        GateConfig(name="", floor=1)


def test_controller_params_for_gate() -> None:
    config = parse(BASE)
    embed, rerank = config.gates
    params = ControllerParams.for_gate(embed, config.coordinator)
    assert (params.floor, params.ceiling, params.adaptive) == (4, 512, True)
    assert params.poll_interval == 12.0 and params.unknown_reset_polls == 3
    assert ControllerParams.for_gate(rerank, config.coordinator).adaptive is False
    off = parse(BASE, FLEETGATE_ADAPTIVE="0")
    assert ControllerParams.for_gate(off.gates[0], off.coordinator).adaptive is False


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


# ----------------------------------------------------------------------------- admission order

ADMISSION_GATE = """\
[[gates]]
name = "llm"
floor = 8
max_queued = 1000
max_queued_per_tenant = 200
shed_below = -10

[gates.tenant_weights]
search = 3
batch = 1
"weird name/with space" = 1000
"""


def test_admission_keys_decode_and_reach_the_settings() -> None:
    gate = parse(ADMISSION_GATE).gates[0]
    assert gate.max_queued_per_tenant == 200 and gate.shed_below == -10
    assert dict(gate.tenant_weights) == {"search": 3, "batch": 1, "weird name/with space": 1000}
    s = gate.settings
    assert (s.max_queued_per_tenant, s.shed_below) == (200, -10)
    assert s.as_cfg()["tenant_weights"] == "batch}1}search}3}weird name/with space}1000"
    assert s.argv()[5:] == [200, -10, "batch}1}search}3}weird name/with space}1000"]


def test_admission_keys_default() -> None:
    gate = parse(BASE).gates[0]
    assert (gate.max_queued_per_tenant, gate.shed_below, dict(gate.tenant_weights)) == (None, 0, {})
    assert gate.settings.as_cfg()["max_queued_per_tenant"] == ""  # unset: deleted by publish


def test_config_with_tenant_weights_stays_hashable() -> None:
    config = parse(ADMISSION_GATE)
    assert hash(config) == hash(parse(ADMISSION_GATE))


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        (
            "max_queued_per_tenant = 200",
            "max_queued_per_tenant = -1",
            "gates[0].max_queued_per_tenant: expected int >= 0, got -1",
        ),
        (
            "max_queued_per_tenant = 200",
            'max_queued_per_tenant = "200"',
            "gates[0].max_queued_per_tenant: expected int | null, got str",
        ),
        ("shed_below = -10", "shed_below = -101", "gates[0].shed_below: expected int >= -100"),
        ("shed_below = -10", "shed_below = 101", "gates[0].shed_below: expected int <= 100"),
        ("shed_below = -10", "shed_below = 1.5", "gates[0].shed_below: expected int, got float"),
        (
            "search = 3",
            "search = 0",
            "gates[0].tenant_weights['search']: expected int in [1, 1000]",
        ),
        (
            "search = 3",
            "search = 1001",
            "gates[0].tenant_weights['search']: expected int in [1, 1000], got 1001",
        ),
        ("search = 3", 'search = "3"', "gates[0].tenant_weights['search']: expected int, got str"),
        (
            "search = 3",
            "search = true",
            "gates[0].tenant_weights['search']: expected int, got bool",
        ),
        (
            "search = 3",
            '"a b{" = 3',
            "gates[0].tenant_weights['a b{']: tenant 'a b{' contains '{': braces and control "
            "characters are not allowed",
        ),
        ("search = 3", '"" = 3', "gates[0].tenant_weights['']: tenant must not be empty"),
        (
            "search = 3",
            '"a\\tb" = 3',
            "gates[0].tenant_weights['a\\tb']: tenant 'a\\tb' contains '\\t'",
        ),
        (
            "[gates.tenant_weights]",
            "[gates.tenant_weight]",
            "gates[0].tenant_weight: unknown field (did you mean 'tenant_weights'?)",
        ),
        ("shed_below = -10", "shedbelow = -10", "gates[0].shedbelow: unknown field (did you mean"),
    ],
)
def test_admission_errors_name_the_field(old: str, new: str, expected: str) -> None:
    assert old in ADMISSION_GATE
    assert error_of(ADMISSION_GATE.replace(old, new, 1)).startswith(expected)


def test_tenant_weights_shape_and_size() -> None:
    gate = '[[gates]]\nname = "x"\nfloor = 1\n'
    assert (
        error_of(gate + "tenant_weights = [1]")
        == "gates[0].tenant_weights: expected table, got array"
    )
    assert (
        error_of(gate + "tenant_weights = 3") == "gates[0].tenant_weights: expected table, got int"
    )
    many = "\n".join(f"t{i} = 1" for i in range(10_001))
    assert error_of(gate + "[gates.tenant_weights]\n" + many) == (
        "gates[0].tenant_weights: at most 10000 tenants, got 10001"
    )
    ok = "\n".join(f"t{i} = 1" for i in range(10_000))
    assert len(parse(gate + "[gates.tenant_weights]\n" + ok).gates[0].tenant_weights) == 10_000


def test_structs_validate_admission_keys_when_built_directly() -> None:
    with pytest.raises(ConfigError, match=r"^tenant_weights\['a\{'\]: tenant 'a\{' contains"):
        GateConfig(name="x", floor=1, tenant_weights={"a{": 2})
    gate = GateConfig(name="x", floor=1, tenant_weights={"b": 2, "a": 1})
    assert list(gate.tenant_weights) == ["a", "b"] and hash(gate)


def test_documented_admission_example_decodes() -> None:
    """The commented admission keys of example.toml and deploy/coordinator.toml are valid
    once uncommented."""
    root = EXAMPLE.parent.parent
    for path in (EXAMPLE, root / "deploy" / "coordinator.toml"):
        lines = path.read_text().splitlines()
        keys = ("max_queued_per_tenant", "shed_below", "[gates.tenant_weights]", "search", "batch")
        out = [
            line[2:] if line.startswith("# ") and line[2:].startswith(keys) else line
            for line in lines
        ]
        assert out != lines, path
        gate = parse("\n".join(out)).gate("bge-m3")
        assert gate.max_queued_per_tenant == 200 and gate.shed_below == 0
        assert gate.tenant_weights["search"] == 3
