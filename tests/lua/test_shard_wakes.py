"""The wake-ups a granting script sends (``lua/lib_wakes.lua`` ``send_wakes``): ``SPUBLISH`` on
the shard channel named like the pod's wake list, the ids of one call in one message; the list
(``RPUSH`` + ``PEXPIRE``) when nobody heard it: no subscriber, or a server or ACL that refuses
``SPUBLISH``. Against a real redis-server (the scripts as the Functions library the client
calls)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
import redis
import redis.asyncio as aredis

from fleetgate.keys import GateKeys
from fleetgate.scripts import GRANTED, PARKED, GateScripts
from fleetgate.settings import GateSettings

from ..conftest import RedisUnderTest

# the scripts against each server of the matrix (tests/_servers.py)
pytestmark = pytest.mark.servers

D = GateSettings(floor=1, ceiling=8)


@pytest.fixture
def subscriber(rut: RedisUnderTest) -> Iterator[redis.client.PubSub]:
    client = redis.Redis.from_url(rut.url, decode_responses=True)
    pubsub = client.pubsub()
    yield pubsub
    pubsub.close()
    client.close()


def _messages(pubsub: redis.client.PubSub, wait: float = 1.0) -> list[str]:
    out: list[str] = []
    end = time.monotonic() + wait
    while time.monotonic() < end:
        msg = pubsub.get_sharded_message(timeout=0.05)
        if msg is not None and msg["type"] == "smessage":
            out.append(msg["data"])
        elif out:
            break
    return out


async def _two_parked(scripts: GateScripts, keys: GateKeys, pods: tuple[str, str]) -> None:
    assert (await scripts.acquire(keys, "h:1", 5000, D)).status == GRANTED
    for pod in pods:
        for n in (1, 2):
            assert (await scripts.acquire(keys, f"{pod}:{n}", 5000, D)).status == PARKED


async def test_a_subscribed_pod_gets_one_message_per_call_and_no_list(
    rut: RedisUnderTest, async_redis: aredis.Redis, subscriber: redis.client.PubSub
) -> None:
    """Limit 1 -> 5 hands off 4 waiters, two of pod ``ps`` (subscribed to its channel) and two
    of pod ``pl`` (not): ``ps`` gets both ids in one message and nothing in its list, ``pl``
    gets both in its list, as before."""
    keys = GateKeys.of(rut.prefix, "sw")
    scripts = GateScripts(async_redis)
    subscriber.ssubscribe(keys.wake("ps"))
    assert subscriber.get_sharded_message(timeout=1.0)["type"] == "ssubscribe"  # type: ignore[index]
    await _two_parked(scripts, keys, ("ps", "pl"))
    assert await scripts.set_target(keys, 5, epoch=1, ttl_ms=10_000)
    [message] = _messages(subscriber)
    ids = [v.partition("=")[0] for v in message.split("\n")]
    assert ids == ["ps:1", "ps:2"], message
    assert all(v.partition("=")[2].isdigit() for v in message.split("\n"))
    assert await async_redis.exists(keys.wake("ps")) == 0
    listed = await async_redis.lrange(keys.wake("pl"), 0, -1)
    assert [v.partition("=")[0] for v in listed] == ["pl:1", "pl:2"]
    assert await async_redis.pttl(keys.wake("pl")) > 0


async def test_spublish_refused_by_the_acl_falls_back_to_the_list(
    rut: RedisUnderTest, async_redis: aredis.Redis
) -> None:
    """A user whose ACL grants no channel (an ACL written before the wake channels): the
    script's SPUBLISH fails inside pcall, the wake goes to the list, the grant stands."""
    user = f"nochan-{uuid.uuid4().hex[:8]}"
    await async_redis.execute_command(
        "ACL", "SETUSER", user, "on", ">pw", "~*", "resetchannels", "+@all"
    )
    limited = aredis.Redis.from_url(rut.url, username=user, password="pw", decode_responses=True)
    try:
        keys = GateKeys.of(rut.prefix, "acl")
        scripts = GateScripts(limited)
        await _two_parked(scripts, keys, ("pa", "pb"))
        assert await scripts.release(keys, "h:1")
        [wake] = await async_redis.lrange(keys.wake("pa"), 0, -1)
        assert wake.startswith("pa:1=")
        assert await async_redis.zscore(keys.holders, "pa:1") is not None
    finally:
        await limited.aclose()
        await async_redis.execute_command("ACL", "DELUSER", user)
