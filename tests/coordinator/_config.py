"""Shared by the coordinator config tests: the packaged example file, a two-gate config,
and the decoders that return the config or its one-line error."""

from __future__ import annotations

from pathlib import Path

import pytest

import fleetgate.coordinator
from fleetgate.coordinator.config import Config
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
    """``text`` decoded with ``env`` as the whole environment."""
    return Config.from_toml_text(text, env=env)


def error_of(text: str, **env: str) -> str:
    """The one-line error decoding ``text`` raises."""
    with pytest.raises(ConfigError) as info:
        parse(text, **env)
    message = str(info.value)
    assert "\n" not in message
    return message
