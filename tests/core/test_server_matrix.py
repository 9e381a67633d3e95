"""The server matrix itself: a test marked ``servers`` talks to the server of its id."""

from __future__ import annotations

import pytest
import redis

from .._servers import MatrixServer
from ..conftest import RedisUnderTest

# the one test that skips, with the reason, on a server of the matrix that cannot be had
pytestmark = pytest.mark.servers(report_missing=True)


def test_each_matrix_test_talks_to_its_server(
    rut: RedisUnderTest, matrix_server: MatrixServer
) -> None:
    with redis.Redis.from_url(rut.url, decode_responses=True) as client:
        info = client.info("server")
    # Valkey answers redis_version 7.2.4 (compatibility) and names itself in server_name
    name = str(info.get("server_name") or "redis")
    version = str(info.get(f"{name}_version") or info["redis_version"])
    assert matrix_server.name == f"{name}-{'.'.join(version.split('.')[:2])}"
