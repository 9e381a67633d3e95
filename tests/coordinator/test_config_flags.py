"""`fleetgate coordinator --redis/--prefix` win over the file and the environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetgate.cli import build_parser
from fleetgate.coordinator.config import load_config
from fleetgate.errors import ConfigError

TOML = '[redis]\nurl = "redis://file:1/0"\nprefix = "filep"\n\n[[gates]]\nname = "g"\nfloor = 2\n'


def test_flags_win_over_the_environment_and_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(TOML)
    env = {"FLEETGATE_REDIS_URL": "redis://env:2/0"}
    assert load_config(path, env).redis.url == "redis://env:2/0"  # environment over the file
    both = load_config(path, env, redis="redis://flag:3/0", prefix="flagp")
    assert (both.redis.url, both.redis.prefix) == ("redis://flag:3/0", "flagp")
    assert load_config(path, {}, prefix="p2").redis.url == "redis://file:1/0"
    with pytest.raises(ConfigError, match="--redis: "):
        load_config(path, {}, redis="localhost:6379")


def test_the_coordinator_command_takes_the_flags() -> None:
    args = build_parser().parse_args(
        ["coordinator", "--config", "c.toml", "--redis", "redis://r:1/0", "--prefix", "p"]
    )
    assert (args.redis, args.prefix) == ("redis://r:1/0", "p")
