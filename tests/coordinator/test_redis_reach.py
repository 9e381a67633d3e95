"""A coordinator that cannot reach Redis keeps saying so: a WARNING with the URL (no password) and
the error at growing intervals while it lasts, an INFO when Redis answers again, and
``fleetgate_coordinator_redis_up`` / ``_redis_errors_total`` on its /metrics.

Before: one WARNING per distinct error message and loop, then the same line at most once a
minute, no URL, and nothing on /metrics (a coordinator started with a wrong URL looked healthy
there)."""

from __future__ import annotations

import logging

import pytest

from fleetgate.coordinator.daemon import Coordinator
from fleetgate.coordinator.reach import RedisReach, report_delay
from fleetgate.tools.redisproc import RedisProcess

from ..conftest import RedisUnderTest
from ._coordinator import config_with, eventually, running

GATES = """
[[gates]]
name = "llm"
floor = 2
"""


def _reach_lines(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "fleetgate.coordinator" and r.levelno == level and "Redis at" in r.getMessage()
    ]


def _sample(coord: Coordinator, name: str) -> float | None:
    return coord.registry.get_sample_value(name)


async def test_an_unreachable_redis_is_told_until_it_answers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="fleetgate")
    with RedisProcess() as proc:
        proc.stop()  # the URL now names a port nobody listens on: a wrong URL
        cfg = config_with(RedisUnderTest(proc.url, "reach", proc), GATES)
        async with running(cfg) as coord:
            # (set before the coordinator's task first runs) reports 0.3, 0.6, 0.6, ... s apart
            coord.faults.redis.first, coord.faults.redis.most = 0.3, 0.6
            await eventually(
                lambda: len(_reach_lines(caplog, logging.WARNING)) >= 3, 5, "three warnings"
            )
            warnings = _reach_lines(caplog, logging.WARNING)
            # the URL and the error in each; the first says to check the URL
            assert all(proc.url in w and "Connect" in w for w in warnings), warnings
            assert "check the URL" in warnings[0]
            assert "still unreachable after" in warnings[-1]
            # rate-limited: a standby campaigns every 0.67 s here, all loops report
            assert len(warnings) <= 6, warnings
            assert _sample(coord, "fleetgate_coordinator_redis_up") == 0
            errors = _sample(coord, "fleetgate_coordinator_redis_errors_total")
            assert errors is not None and errors >= len(warnings)
            assert not coord.election.is_leader

            proc.start()  # Redis answers at last
            await eventually(lambda: coord.election.is_leader, 5, "the lead")
            await eventually(
                lambda: _sample(coord, "fleetgate_coordinator_redis_up") == 1, 2, "redis_up 1"
            )
            infos = _reach_lines(caplog, logging.INFO)
            assert any(f"reached Redis at {proc.url}" in m for m in infos), infos

            caplog.clear()
            proc.kill()  # an outage of a Redis it had reached
            await eventually(
                lambda: _sample(coord, "fleetgate_coordinator_redis_up") == 0, 5, "redis_up 0"
            )
            await eventually(lambda: _reach_lines(caplog, logging.WARNING), 5, "a warning")
            assert "unreachable" in _reach_lines(caplog, logging.WARNING)[0]
            proc.start()
            await eventually(
                lambda: any("reachable again" in m for m in _reach_lines(caplog, logging.INFO)),
                5,
                "reachable again",
            )
            assert _sample(coord, "fleetgate_coordinator_redis_up") == 1


def test_reports_grow_apart_and_never_show_the_password(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="fleetgate")
    assert [report_delay(n) for n in (1, 2, 3, 4, 5, 6, 50)] == [5, 10, 20, 40, 60, 60, 60]
    now = [0.0]
    reach = RedisReach("redis://admin:s3cret-pw@redis.example:6380/2", clock=lambda: now[0])
    seen_at = []
    for tick in range(0, 1400):  # a call every 0.1 s for 140 s
        now[0] = tick / 10
        before = len(caplog.records)
        reach.failed("election", "ConnectionError: Error 111 connecting to redis.example:6380.")
        if len(caplog.records) > before:
            seen_at.append(now[0])
    assert seen_at == [0.0, 5.0, 15.0, 35.0, 75.0, 135.0]
    lines = [r.getMessage() for r in caplog.records]
    assert all("redis://***@redis.example:6380/2" in m for m in lines), lines
    assert not [m for m in lines if "s3cret" in m]
    assert "1351 calls failed" in lines[-1] and "after 135 s" in lines[-1]
    assert not reach.up
    reach.reached()
    assert reach.up
    assert "reached Redis at redis://***@redis.example:6380/2, 139.9 s after start-up" in (
        caplog.records[-1].getMessage()
    )
    # the next outage starts its reports afresh, worded as an outage
    now[0] = 200.0
    reach.failed("poll", "TimeoutError: Timeout connecting to server")
    assert "Redis at redis://***@redis.example:6380/2 unreachable (poll: Timeout" in (
        caplog.records[-1].getMessage()
    )
    now[0] = 203.5
    reach.reached()
    assert "reachable again after 3.5 s (1 calls failed)" in caplog.records[-1].getMessage()
