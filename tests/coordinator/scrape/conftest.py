"""Fixtures of the scrape room."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ._metrics_server import serve_metrics


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    """The base URL of a :class:`MetricsServer` (one per test module)."""
    with serve_metrics() as url:
        yield url
