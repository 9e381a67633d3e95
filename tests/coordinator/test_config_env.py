"""The coordinator config's environment overrides: which variables win, errors naming the
variable, and the controller parameters they lead to."""

from __future__ import annotations

import pytest

from fleetgate.coordinator.config import GateConfig
from fleetgate.coordinator.controller import ControllerParams
from fleetgate.errors import ConfigError

from ._config import BASE, error_of, parse


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
