"""Fixtures of the Lua room."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from ..conftest import RedisUnderTest


@pytest.fixture
def r(rut: RedisUnderTest) -> Iterator[redis.Redis]:
    """A sync client of the Redis under test (strings, not bytes)."""
    client = redis.Redis.from_url(rut.url, decode_responses=True)
    yield client
    client.close()
