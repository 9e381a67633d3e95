"""Fixtures of the proxy tests: the upstream they forward to, and both request parsers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture
def upstream() -> Iterator[Any]:
    """The proxy tests' upstream (``tests/proxy/_proxy.py``'s ``upstream_app``) on a thread: the
    ``Served`` of fleetgate.tools.sim (``.url``; what it saw: ``upstream_log``)."""
    from fleetgate.tools.sim._server import serve_in_thread

    from ._proxy import upstream_app

    with serve_in_thread(upstream_app()) as served:
        yield served


@pytest.fixture(params=["httptools", "h11"])
def parser(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """A proxy test on both request parsers (httptools: the fast extra's; h11: the fallback)."""
    if request.param == "h11":
        monkeypatch.setattr("fleetgate.proxy.server._http_protocol", lambda: "h11")
    name: str = request.param
    return name
