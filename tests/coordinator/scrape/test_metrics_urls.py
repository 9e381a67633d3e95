"""Metrics URLs: derived from a base URL, validated, and never echoing a password."""

from __future__ import annotations

import pytest

from fleetgate.coordinator.scrape.signals import derive_metrics_url, validate_metrics_url
from fleetgate.errors import ConfigError


@pytest.mark.parametrize(
    ("base", "expected"),
    [
        ("http://vllm-embed.arpa/v1", "http://vllm-embed.arpa/metrics"),
        ("http://vllm-embed.arpa/v1/", "http://vllm-embed.arpa/metrics"),
        ("http://host:8000", "http://host:8000/metrics"),
        ("http://host:8000/", "http://host:8000/metrics"),
        ("https://gw.example/llm/v1", "https://gw.example/llm/metrics"),
        ("http://v1", "http://v1/metrics"),  # a host called v1 is not a path
        ("http://[::1]:8000/v1", "http://[::1]:8000/metrics"),
    ],
)
def test_derive_metrics_url(base: str, expected: str) -> None:
    assert derive_metrics_url(base) == expected


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("http://user:secret@host/metrics", "credentials"),
        ("http://user@host/metrics", "credentials"),
        ("http://host/metrics?x=1", "query"),
        ("http://host/metrics?", "query"),
        ("http://host/metrics#frag", "fragment"),
        ("ftp://host/metrics", "http"),
        ("file:///etc/passwd", "http"),
        ("host/metrics", "http"),
        ("", "non-empty"),
        ("   ", "non-empty"),
        ("http:///metrics", "no host"),
        ("http://host:99999/metrics", "malformed"),
        ("http://ho st/metrics", "whitespace"),
    ],
)
def test_validate_metrics_url_refuses(url: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        validate_metrics_url(url)


def test_refusal_never_echoes_a_password() -> None:
    with pytest.raises(ConfigError) as info:
        derive_metrics_url("http://admin:hunter2@host/v1")
    assert "hunter2" not in str(info.value)


def test_validate_metrics_url_accepts_plain_urls() -> None:
    for url in ("http://host/metrics", "https://host:9000/a/b/metrics", "http://10.0.0.1/metrics"):
        assert validate_metrics_url(url) == url
