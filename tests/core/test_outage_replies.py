"""Which Redis replies are an outage (the fair-share fallback serves) and which are data errors
(the caller gets them): ``fleetgate._redis.unavailable_reply``."""

from __future__ import annotations

import pytest
import redis

from fleetgate._redis import ServerUnavailable, unavailable_reply


@pytest.mark.parametrize(
    "message",
    [
        "MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist",
        "BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSCRIPT.",
        "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
        "LOADING Redis is loading the dataset in memory",
        "NOREPLICAS Not enough good replicas to write.",
        "TRYAGAIN Multiple keys request during rehashing of slot",
        "CLUSTERDOWN The cluster is down",
    ],
)
def test_replies_that_mean_cannot_serve_now_are_outages(message: str) -> None:
    assert unavailable_reply(redis.ResponseError(message))
    assert issubclass(ServerUnavailable, redis.ConnectionError)


def test_data_errors_are_not_outages() -> None:
    assert not unavailable_reply(redis.ResponseError("WRONGTYPE Operation against a key"))
    assert not unavailable_reply(redis.ResponseError("BUSYKEY Target key name already exists"))
    assert unavailable_reply(redis.exceptions.ReadOnlyError("You can't write"))
    assert unavailable_reply(redis.exceptions.OutOfMemoryError("command not allowed"))


def test_refusals_redis_py_maps_to_classes_of_their_own_are_outages() -> None:
    """Codes redis-py strips from the message are read from the class or ``status_code``."""
    assert unavailable_reply(redis.exceptions.TryAgainError("Multiple keys request"))
    assert unavailable_reply(redis.exceptions.ClusterDownError("The cluster is down"))
    assert unavailable_reply(
        redis.ResponseError("Not enough good replicas", status_code="NOREPLICAS")
    )
    assert not unavailable_reply(
        redis.ResponseError("Operation against a key", status_code="WRONGTYPE")
    )
