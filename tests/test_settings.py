"""One gate-settings struct: its defaults and bounds, and ``lua/lib.lua`` agreeing with them on a
real redis-server."""

from __future__ import annotations

from typing import Any

import pytest
import redis.asyncio as aredis

from fleetgate import scripts as scripts_module
from fleetgate.coordinator.config import Config, GateConfig
from fleetgate.errors import ConfigError
from fleetgate.keys import GateKeys
from fleetgate.scripts import GRANTED, SCHEMA, GateScripts
from fleetgate.settings import (
    FIELDS,
    GateSettings,
    bounds,
    validate_gate_settings,
)

from .conftest import RedisUnderTest


@pytest.fixture
def keys(rut: RedisUnderTest) -> GateKeys:
    return GateKeys.of(rut.prefix, "settings")


@pytest.fixture
def scripts(async_redis: aredis.Redis) -> GateScripts:
    return GateScripts(async_redis)


def _effective(snap: scripts_module.Snapshot) -> dict[str, int]:
    return {name: getattr(snap, name) for name in FIELDS}


async def test_lib_lua_defaults_are_the_structs(scripts: GateScripts, keys: GateKeys) -> None:
    """No configuration and no caller defaults: the scripts use GateSettings()."""
    snap = await scripts.snapshot(keys, 0)
    assert snap.cfg == {}
    assert _effective(snap) == GateSettings().as_cfg()


async def test_lib_lua_lower_bounds_are_the_structs(
    scripts: GateScripts, keys: GateKeys, async_redis: aredis.Redis
) -> None:
    """Stored values below the bounds (and then caller defaults below them) are raised to the
    struct's lower bounds."""
    lowest = {name: low for name, (low, _) in bounds().items()}
    below = {name: low - 1 for name, low in lowest.items()}
    await async_redis.hset(keys.cfg, mapping=dict[Any, Any](below))
    assert _effective(await scripts.snapshot(keys, 0)) == lowest

    await async_redis.delete(keys.cfg)
    snap = await scripts.snapshot(keys, 0, defaults=GateSettings(**below))
    assert _effective(snap) == lowest


async def test_acquire_registers_and_applies_the_struct(
    scripts: GateScripts, keys: GateKeys, async_redis: aredis.Redis
) -> None:
    """What acquire registers from argv() is read back as the same settings."""
    s = GateSettings(floor=3, ceiling=7, max_queued=9, lease_ms=1234, waiter_ms=567)
    reply = await scripts.acquire(keys, "p:1", 1000, s)
    assert reply.status == GRANTED and reply.holders == 1
    assert (reply.lease_ms, reply.waiter_ms) == (1234, 567)
    stored = await async_redis.hgetall(keys.cfg)
    assert stored.pop("schema") == str(SCHEMA)
    assert {k: int(v) for k, v in stored.items()} == s.as_cfg()
    assert _effective(await scripts.snapshot(keys, 0)) == s.as_cfg()


def test_script_arguments_follow_the_field_order() -> None:
    assert GateSettings().argv() == [1, 512, 1000, 10_000, 5_000]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"floor": 0},
            "gate 'x': floor: expected int >= 1, got 0 (a cap <= 0 would block every call)",
        ),
        ({"max_queued": -1}, "gate 'x': max_queued: expected int >= 0, got -1"),
        ({"lease_ms": 99}, "gate 'x': lease_ms: expected int >= 100, got 99"),
        ({"waiter_ms": True}, "gate 'x': waiter_ms: expected int >= 100, got True"),
        ({"ceiling": "8"}, "gate 'x': ceiling: expected int >= 1, got '8'"),
        ({"floor": 4, "ceiling": 2}, "gate 'x': ceiling: expected >= floor (4), got 2"),
        ({"lease_ms": 10**9}, "gate 'x': lease_ms: expected int <= 86400000, got 1000000000"),
    ],
)
def test_validation_names_the_gate_and_the_field(values: dict[str, object], message: str) -> None:
    full = {**GateSettings().as_cfg(), **values}
    with pytest.raises(ConfigError) as info:
        GateSettings.validated("x", **full)
    assert str(info.value).startswith(message)
    with pytest.raises(ConfigError):
        validate_gate_settings("x", full)  # type: ignore[arg-type]


def test_for_gate_defaults_the_ceiling_to_at_least_the_floor() -> None:
    assert GateSettings.for_gate("x") == GateSettings()
    assert GateSettings.for_gate("x", floor=600).ceiling == 600
    assert GateSettings.for_gate("x", floor=2, lease_ms=500) == GateSettings(2, 512, 1000, 500)


def test_coordinator_gate_config_shares_types_and_defaults() -> None:
    assert GateConfig(name="g", floor=2).settings == GateSettings(floor=2)
    for name, (low, high) in bounds().items():
        for bad in (low - 1, high + 1):
            raw = {"gates": [{"name": "g", "floor": 2, "ceiling": 10, name: bad}]}
            with pytest.raises(ConfigError, match=rf"gates\[0\]\.{name}: expected int"):
                Config.from_mapping(raw, env={})
