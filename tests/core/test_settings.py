"""One gate-settings struct: its defaults and bounds, and the Lua library (``lua/lib_cfg.lua``)
agreeing with them on a real redis-server."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import redis.asyncio as aredis

from fleetgate import scripts as scripts_module
from fleetgate.admission import TenantWeights
from fleetgate.coordinator.config import Config, GateConfig
from fleetgate.errors import ConfigError
from fleetgate.keys import GateKeys
from fleetgate.scripts import GRANTED, SCHEMA, GateScripts
from fleetgate.settings import (
    ADMISSION_FIELDS,
    BAND_FIELDS,
    FIELDS,
    REVOKE_FIELDS,
    TIME_FIELDS,
    TOKEN_FIELDS,
    GateSettings,
    bounds,
    validate_gate_settings,
)

from ..conftest import RedisUnderTest


@pytest.fixture
def keys(rut: RedisUnderTest) -> GateKeys:
    return GateKeys.of(rut.prefix, "settings")


@pytest.fixture
def scripts(async_redis: aredis.Redis) -> GateScripts:
    return GateScripts(async_redis)


def _effective(snap: scripts_module.Snapshot) -> dict[str, int]:
    return {name: getattr(snap, name) for name in FIELDS}


def _int_fields(s: GateSettings) -> dict[str, int]:
    """The settings lib_cfg.lua's load_cfg reads (FIELDS), as ``_effective`` shows them."""
    return {name: getattr(s, name) for name in FIELDS}


async def test_lib_lua_defaults_are_the_structs(scripts: GateScripts, keys: GateKeys) -> None:
    """No configuration and no caller defaults: the scripts use GateSettings()."""
    snap = await scripts.snapshot(keys, 0)
    assert snap.cfg == {}
    assert _effective(snap) == _int_fields(GateSettings())


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
    # max_queued_per_tenant None is not stored (the scripts read "same as max_queued")
    assert {k: int(v) for k, v in stored.items()} == {
        **_int_fields(s), "shed_below": 0, "deadline_admission": 1
    }  # fmt: skip
    assert _effective(await scripts.snapshot(keys, 0)) == _int_fields(s)


async def test_acquire_registers_the_admission_settings(
    scripts: GateScripts, keys: GateKeys, async_redis: aredis.Redis
) -> None:
    """argv()'s last three values: max_queued_per_tenant and shed_below into cfg, the tenant
    weights into their own hash; a publish of as_cfg() replaces them."""
    s = GateSettings(
        floor=2, max_queued_per_tenant=4, shed_below=-7, tenant_weights={"b": 2, "a": 5}
    )
    assert (await scripts.acquire(keys, "p:1", 1000, s)).status == GRANTED
    stored = await async_redis.hgetall(keys.cfg)
    assert (stored["max_queued_per_tenant"], stored["shed_below"]) == ("4", "-7")
    assert await async_redis.hgetall(keys.tenant_weights) == {"a": "5", "b": "2"}
    snap = await scripts.snapshot(keys, 0)
    assert (snap.max_queued_per_tenant, snap.shed_below) == (4, -7)
    assert snap.tenant_weights == {"a": "5", "b": "2"}

    published = GateSettings(floor=2, shed_below=3, tenant_weights={"c": 9})
    assert await scripts.publish(keys, 1, 10_000, None, published.as_cfg(), {})
    assert await async_redis.hgetall(keys.tenant_weights) == {"c": "9"}
    snap = await scripts.snapshot(keys, 0)
    assert (snap.shed_below, snap.tenant_weights) == (3, {"c": "9"})
    assert await scripts.publish(keys, 1, 10_000, None, GateSettings(floor=2).as_cfg(), {})
    assert await async_redis.exists(keys.tenant_weights) == 0


def test_script_arguments_follow_the_field_order() -> None:
    assert GateSettings().argv() == [1, 512, 1000, 10_000, 5_000, "", 0, "", "", 1, "", "", ""]
    s = GateSettings(
        floor=2,
        max_queued_per_tenant=7,
        shed_below=-10,
        tenant_weights={"search": 3, "batch": 1},
    )
    assert s.argv() == [2, 512, 1000, 10_000, 5_000, 7, -10, "", "", 1, "", "", "batch}1}search}3"]
    # band shares: '<100 - priority as 3 digits>=<thousandths>', by priority
    shares = GateSettings(band_share={-10: 0.3, 0: 0.7}).argv()[10]
    assert shares == "100=700,110=300"
    assert GateSettings(deadline_admission=False).argv()[9] == 0
    # deadline admission: 0 off, 1 by the start (True, "start"), 2 by the end of the call
    modes = (False, True, "start", "finish")
    assert [GateSettings(deadline_admission=m).argv()[9] for m in modes] == [0, 1, 1, 2]
    assert GateSettings(deadline_admission="finish").as_cfg()["deadline_admission"] == 2
    tokens = GateSettings(token_limit=4_000, token_ceiling=8_000).argv()
    assert tokens[7:9] == [4_000, 8_000]
    assert GateSettings(max_queued_per_tenant=0).argv()[5] == 0  # 0 is a bound, not "unset"


def test_fields_are_the_int_fields_then_the_admission_ones_then_the_token_budget() -> None:
    assert FIELDS == ("floor", "ceiling", "max_queued", "lease_ms", "waiter_ms")
    assert ADMISSION_FIELDS == ("max_queued_per_tenant", "shed_below", "tenant_weights")
    assert TOKEN_FIELDS == ("token_limit", "token_ceiling")
    assert TIME_FIELDS == ("deadline_admission",)
    assert BAND_FIELDS == ("band_share",)
    assert REVOKE_FIELDS == ("revoke_after",)
    fields = FIELDS + ADMISSION_FIELDS + TOKEN_FIELDS + TIME_FIELDS + BAND_FIELDS + REVOKE_FIELDS
    assert fields == GateSettings.__struct_fields__
    assert set(bounds()) == set(FIELDS)


def test_as_cfg_shape() -> None:
    old = {"floor": 1, "ceiling": 512, "max_queued": 1000, "lease_ms": 10_000, "waiter_ms": 5_000}
    # unset: '' (publish.lua deletes the field, so a removed bound goes from Redis too)
    assert GateSettings().as_cfg() == {
        **old,
        "max_queued_per_tenant": "",
        "shed_below": 0,
        "tenant_weights": "",
        "token_limit": "",
        "token_ceiling": "",
        "deadline_admission": 1,
        "band_share": "",
        "revoke_after_ms": "",
    }
    s = GateSettings(max_queued_per_tenant=50, shed_below=5, tenant_weights={"b": 2, "a": 9})
    assert s.as_cfg() == {
        **old,
        "max_queued_per_tenant": 50,
        "shed_below": 5,
        "tenant_weights": "a}9}b}2",
        "token_limit": "",
        "token_ceiling": "",
        "deadline_admission": 1,
        "band_share": "",
        "revoke_after_ms": "",
    }
    budget = GateSettings(token_limit=4_000).as_cfg()
    assert (budget["token_limit"], budget["token_ceiling"]) == (4_000, "")
    assert list(s.as_cfg())[:5] == list(FIELDS)
    assert GateSettings(revoke_after=2.5).as_cfg()["revoke_after_ms"] == 2500


@pytest.mark.parametrize("bad", [0, 0.05, 3601, "5", True])
def test_revoke_after_takes_seconds_or_none(bad: object) -> None:
    base = msgspec.structs.asdict(GateSettings())
    with pytest.raises(ConfigError, match=r"gate 'g': revoke_after: expected None or seconds"):
        GateSettings.validated("g", **{**base, "revoke_after": bad})
    assert GateSettings.for_gate("g", revoke_after=5).argv()[11] == 5000
    assert GateSettings.for_gate("g").argv()[11] == ""


def test_settings_stay_hashable_and_immutable() -> None:
    """The scripts cache a gate's encoded ARGV by its settings (functools.lru_cache)."""
    a = GateSettings(tenant_weights={"b": 2, "a": 3})
    b = GateSettings(tenant_weights=TenantWeights([("a", 3), ("b", 2)]))
    assert isinstance(a.tenant_weights, TenantWeights)
    assert a == b and hash(a) == hash(b) and a.tenant_weights == {"a": 3, "b": 2}
    assert a != GateSettings(tenant_weights={"a": 3})
    assert GateSettings() == GateSettings(tenant_weights={})
    with pytest.raises(TypeError):
        a.tenant_weights["c"] = 1  # type: ignore[index]
    replaced = msgspec.structs.replace(a, tenant_weights={"z": 4})
    assert replaced.argv()[-1] == "z}4" and hash(replaced)


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
        (
            {"max_queued_per_tenant": -1},
            "gate 'x': max_queued_per_tenant: expected None or int in [0, 10000000], got -1",
        ),
        (
            {"max_queued_per_tenant": 10**8},
            "gate 'x': max_queued_per_tenant: expected None or int in [0, 10000000]",
        ),
        ({"max_queued_per_tenant": 2.0}, "gate 'x': max_queued_per_tenant: expected None or"),
        ({"shed_below": -101}, "gate 'x': shed_below: expected int in [-100, 100], got -101"),
        ({"shed_below": 101}, "gate 'x': shed_below: expected int in [-100, 100], got 101"),
        ({"shed_below": False}, "gate 'x': shed_below: expected int in [-100, 100], got False"),
        ({"shed_below": None}, "gate 'x': shed_below: expected int in [-100, 100], got None"),
        (
            {"tenant_weights": {"a b{": 2}},
            "gate 'x': tenant_weights['a b{']: tenant 'a b{' contains '{'",
        ),
        (
            {"tenant_weights": {"": 2}},
            "gate 'x': tenant_weights['']: tenant must not be empty",
        ),
        (
            {"tenant_weights": {3: 2}},
            "gate 'x': tenant_weights[3]: tenant must be a string, got int",
        ),
        (
            {"tenant_weights": {"a": 0}},
            "gate 'x': tenant_weights['a']: expected int in [1, 1000], got 0",
        ),
        (
            {"tenant_weights": {"a": 1001}},
            "gate 'x': tenant_weights['a']: expected int in [1, 1000], got 1001",
        ),
        (
            {"tenant_weights": {"a": True}},
            "gate 'x': tenant_weights['a']: expected int in [1, 1000], got True",
        ),
        (
            {"tenant_weights": [("a", 1)]},
            "gate 'x': tenant_weights: expected a mapping of tenant name -> int, got list",
        ),
        (
            {"tenant_weights": {f"t{i}": 1 for i in range(10_001)}},
            "gate 'x': tenant_weights: at most 10000 tenants, got 10001",
        ),
        ({"tenant_weight": {}}, "gate 'x': tenant_weight: unknown setting"),
    ],
)
def test_validation_names_the_gate_and_the_field(values: dict[str, object], message: str) -> None:
    full = {**msgspec.structs.asdict(GateSettings()), **values}
    with pytest.raises(ConfigError) as info:
        GateSettings.validated("x", **full)
    assert str(info.value).startswith(message)
    with pytest.raises(ConfigError):
        validate_gate_settings("x", full)  # type: ignore[arg-type]


def test_for_gate_defaults_the_ceiling_to_at_least_the_floor() -> None:
    assert GateSettings.for_gate("x") == GateSettings()
    assert GateSettings.for_gate("x", floor=600).ceiling == 600
    assert GateSettings.for_gate("x", floor=2, lease_ms=500) == GateSettings(2, 512, 1000, 500)


def test_for_gate_takes_the_admission_settings() -> None:
    s = GateSettings.for_gate(
        "x", max_queued_per_tenant=20, tenant_weights={"search": 4}, shed_below=-3
    )
    assert (s.max_queued_per_tenant, s.shed_below, dict(s.tenant_weights)) == (
        20,
        -3,
        {"search": 4},
    )
    assert GateSettings.for_gate("x", max_queued_per_tenant=None).max_queued_per_tenant is None
    for bad, field in (
        ({"max_queued_per_tenant": -1}, "max_queued_per_tenant"),
        ({"shed_below": 200}, "shed_below"),
        ({"tenant_weights": {"a": 0}}, r"tenant_weights\['a'\]"),
    ):
        with pytest.raises(ConfigError, match=rf"^gate 'x': {field}: "):
            GateSettings.for_gate("x", **bad)  # type: ignore[arg-type]


def test_coordinator_gate_config_shares_types_and_defaults() -> None:
    assert GateConfig(name="g", floor=2).settings == GateSettings(floor=2)
    gate = GateConfig(
        name="g", floor=2, max_queued_per_tenant=9, shed_below=-1, tenant_weights={"a": 2}
    )
    assert gate.settings == GateSettings(
        floor=2, max_queued_per_tenant=9, shed_below=-1, tenant_weights={"a": 2}
    )
    assert gate.settings.as_cfg()["tenant_weights"] == "a}2"
    for name, (low, high) in bounds().items():
        for bad in (low - 1, high + 1):
            raw = {"gates": [{"name": "g", "floor": 2, "ceiling": 10, name: bad}]}
            with pytest.raises(ConfigError, match=rf"gates\[0\]\.{name}: expected int"):
                Config.from_mapping(raw, env={})


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("max_queued_per_tenant = -1", "gates[0].max_queued_per_tenant: expected int >= 0, got -1"),
        (
            "max_queued_per_tenant = 10000001",
            "gates[0].max_queued_per_tenant: expected int <= 10000000",
        ),
        ("shed_below = -101", "gates[0].shed_below: expected int >= -100, got -101"),
        ("shed_below = 101", "gates[0].shed_below: expected int <= 100, got 101"),
    ],
)
def test_coordinator_admission_bounds_are_the_structs(entry: str, message: str) -> None:
    text = f'[[gates]]\nname = "g"\nfloor = 1\n{entry}\n'
    with pytest.raises(ConfigError) as info:
        Config.from_toml_text(text, env={})
    assert str(info.value).startswith(message)


@pytest.mark.parametrize("bad", ["end", "", 1, None])
def test_deadline_admission_takes_a_flag_or_start_or_finish(bad: object) -> None:
    base = msgspec.structs.asdict(GateSettings())
    with pytest.raises(ConfigError, match=r"gate 'g': deadline_admission: expected true, false"):
        GateSettings.validated("g", **{**base, "deadline_admission": bad})
    assert GateSettings.validated("g", **{**base, "deadline_admission": "finish"})
