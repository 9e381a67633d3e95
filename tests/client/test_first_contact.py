"""A process that never reached Redis is told loudly (a wrong URL), unlike an outage."""

from __future__ import annotations

import asyncio
import logging

import pytest
from prometheus_client import CollectorRegistry

from fleetgate.client import Fleet
from fleetgate.tools.redisproc import RedisProcess, free_port

from ..conftest import RedisUnderTest

NEVER = "has not answered since this process started"


async def test_a_url_nothing_answers_is_an_error_not_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="fleetgate.client")
    url = f"redis://user:s3cret@127.0.0.1:{free_port()}/0"
    async with Fleet(url, registry=CollectorRegistry(), heartbeat_interval=0.2) as fleet:
        assert fleet.reached_redis is False
        async with fleet.gate("g").permit(deadline=5):  # the fallback still serves
            pass
        for _ in range(100):
            errors = [r for r in caplog.records if NEVER in r.getMessage()]
            if errors:
                break
            await asyncio.sleep(0.02)
        [line] = errors
        assert line.levelno == logging.ERROR
        text = line.getMessage()
        assert "s3cret" not in text and f":{url.rsplit(':', 1)[1]}" in text  # the URL, redacted
        assert "wrong" in text  # says what it likely is
        assert fleet.reached_redis is False


async def test_a_reachable_redis_is_reached_before_start_returns(
    rut: RedisUnderTest, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="fleetgate.client")
    async with Fleet(rut.url, prefix=rut.prefix, registry=CollectorRegistry()) as fleet:
        assert fleet.reached_redis is True
    assert not [r for r in caplog.records if NEVER in r.getMessage()]


async def test_redis_that_comes_up_later_is_reached(caplog: pytest.LogCaptureFixture) -> None:
    """Redis started after the process (a pod before its Redis): reached as it answers."""
    caplog.set_level(logging.WARNING, logger="fleetgate.client")
    server = RedisProcess()  # its port picked, not yet listening
    async with Fleet(server.url, registry=CollectorRegistry(), heartbeat_interval=0.2) as fleet:
        assert fleet.reached_redis is False
        with server:  # starts it
            for _ in range(400):
                if fleet.reached_redis:
                    break
                await asyncio.sleep(0.025)
            assert fleet.reached_redis is True
    assert [r for r in caplog.records if NEVER in r.getMessage()]  # it was said meanwhile
