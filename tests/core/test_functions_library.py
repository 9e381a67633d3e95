"""The gate scripts as one Redis Functions library: naming, flags, loading and reloading."""

from __future__ import annotations

import redis.asyncio as aredis

from fleetgate.keys import GateKeys
from fleetgate.scripts import (
    FUNCTION_FLAGS,
    SCRIPT_NAMES,
    GateScripts,
    HeartbeatRequest,
    gate_library,
)
from fleetgate.settings import GateSettings
from fleetgate.tools.redisproc import RedisProcess

D = GateSettings(floor=2, ceiling=2)


def test_library_is_named_after_its_code() -> None:
    lib = gate_library()
    digest = lib.name.removeprefix("fleetgate_")
    assert len(digest) == 12 and int(digest, 16) >= 0
    assert lib.source.startswith(f"#!lua name={lib.name}\n")
    assert set(lib.functions) == set(SCRIPT_NAMES)
    for name, function in lib.functions.items():
        assert function == f"fg_{digest}_{name}"
    # the shared library's KEYS[1] line runs in each function, not at load (the library has no
    # KEYS then).
    assert "\nuse_gate(KEYS[1])\n" not in lib.source.split("local function acquire_body")[0]


async def test_loaded_once_with_its_flags(own_redis: RedisProcess) -> None:
    client = aredis.Redis.from_url(own_redis.url, decode_responses=True)
    try:
        keys = GateKeys.of("fg", "fn")
        scripts = GateScripts(client)
        assert (await scripts.acquire(keys, "p:1", 1000, D)).status == 1
        # another client of the same code: "already exists" is fine
        assert await GateScripts(client).release(keys, "p:1")
        (entry,) = await client.function_list(library=gate_library().name)
        listed = dict(zip(entry[::2], entry[1::2], strict=True))
        flags = {}
        for fn in listed["functions"]:
            f = dict(zip(fn[::2], fn[1::2], strict=True))
            flags[f["name"]] = set(f["flags"])
        lib = gate_library()
        for name in SCRIPT_NAMES:
            assert flags[lib.functions[name]] == set(FUNCTION_FLAGS.get(name, ())), name
    finally:
        await client.aclose()


async def test_a_missing_function_is_loaded_and_the_call_sent_again(
    own_redis: RedisProcess,
) -> None:
    """FUNCTION FLUSH (or a restart without persistence) under a client that loaded the
    library: the single call, a pipelined batch and a heartbeat batch all reload and go on."""
    client = aredis.Redis.from_url(own_redis.url, decode_responses=True)
    try:
        keys = GateKeys.of("fg", "fn")
        scripts = GateScripts(client)
        assert (await scripts.acquire(keys, "p:1", 1000, D)).status == 1
        await client.function_flush()
        assert (await scripts.acquire(keys, "p:2", 1000, D)).status == 1
        await client.function_flush()
        snaps = await scripts.batch([scripts.prune_call(keys, 1, 60_000)] * 2)
        assert len(snaps) == 2
        await client.function_flush()
        (hb,) = await scripts.heartbeats(
            [HeartbeatRequest(keys, "p", 10_000, [("p:1", 0), ("p:2", 0)], [])]
        )
        assert not isinstance(hb, Exception) and hb.holders == 2
        assert await scripts.release_many(keys, ["p:1", "p:2"]) == 2
    finally:
        await client.aclose()
