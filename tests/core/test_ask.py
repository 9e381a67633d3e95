"""One Ask: a permit's weight, priority, tenant and deadline as one checked, immutable value,
taken by the client beside its keyword form; and the gate settings as keywords."""

from __future__ import annotations

import asyncio
import dataclasses
import math

import pytest

from fleetgate.admission import lane_class, tokens_of, waiter_member, weight_of, weighted_id
from fleetgate.ask import DEFAULT_ASK, Ask
from fleetgate.client import ConfigError, DeadlineExceeded, Fleet, SyncFleet
from fleetgate.settings import GateSettings, GateSettingsKwargs

from ..conftest import RedisUnderTest


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"weight": 0}, "weight"),
        ({"weight": True}, "weight"),
        ({"priority": 101}, "priority"),
        ({"tenant": ""}, "tenant"),
        ({"tenant": "a b{"}, "tenant"),
        ({"deadline": 0}, "deadline"),
        ({"deadline": math.nan}, "deadline"),
        ({"deadline": "30"}, "deadline"),
    ],
)
def test_a_bad_field_is_refused_when_the_ask_is_made(fields: dict[str, object], named: str) -> None:
    for make in (Ask, Ask.of):
        with pytest.raises(ConfigError, match=rf"^{named}\b"):
            make(**fields)  # type: ignore[arg-type]


def test_an_ask_is_immutable_and_normalised() -> None:
    assert Ask(deadline=math.inf).deadline is None
    assert Ask(deadline=5) == Ask(deadline=5.0)
    assert Ask.of() is DEFAULT_ASK and Ask.of(deadline=None) is Ask.of(deadline=None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT_ASK.weight = 2  # type: ignore[misc]


def test_the_ask_encodes_itself_as_the_admission_wire_format() -> None:
    ask = Ask(weight=3, priority=-7, tenant="search")
    assert ask.lane == lane_class(-7, "search")
    # the band (100 - priority) before the weight: the band shares count by it
    assert ask.lease_id("p:1") == weighted_id("p:1", 3, 0, -7) == "p:1b107w3"
    assert weight_of("p:1b107w3t5") == 3 and tokens_of("p:1b107w3t5") == 5
    assert ask.member(42, "p:1b107w3") == waiter_member(-7, "search", 42, "p:1b107w3")
    assert DEFAULT_ASK.lane == "" and DEFAULT_ASK.lease_id("p:2") == "p:2"


async def test_a_gate_takes_a_ready_ask(fleet: Fleet) -> None:
    gate = fleet.gate("ask", floor=4)
    ask = Ask(weight=2, priority=5, tenant="t", deadline=10.0)
    async with gate.permit(ask=ask) as lease:
        assert (lease.ask, lease.weight, lease.priority, lease.tenant) == (ask, 2, 5, "t")
        assert lease.id.endswith("w2")
    lease = await gate.acquire(ask=ask)
    await lease.release()
    with pytest.raises(ConfigError, match=r"^ask: "):
        await gate.acquire(weight=2, ask=ask)
    with pytest.raises(ConfigError, match=r"^ask: "):
        await gate.acquire(None, ask=ask)
    with pytest.raises(ConfigError, match=r"^ask: "):
        await gate.acquire(ask=(2, 5, "t"))  # type: ignore[arg-type]


async def test_a_ready_asks_deadline_applies(fleet: Fleet) -> None:
    gate = fleet.gate("ask-deadline", floor=1, ceiling=1)
    async with gate.permit():
        started = asyncio.get_running_loop().time()
        with pytest.raises(DeadlineExceeded):
            await gate.acquire(ask=Ask(deadline=0.2))
        assert asyncio.get_running_loop().time() - started < 5


def test_a_sync_gate_takes_a_ready_ask(rut: RedisUnderTest) -> None:
    with SyncFleet(rut.url, prefix=rut.prefix) as fleet:
        gate = fleet.gate("ask-sync", floor=2)
        with gate.permit(ask=Ask(weight=2)) as lease:
            assert lease.weight == 2
        lease = gate.acquire(ask=Ask(tenant="t"))
        assert lease.tenant == "t"
        gate.release(lease)


def test_the_settings_keywords_are_the_settings_fields() -> None:
    assert tuple(GateSettingsKwargs.__annotations__) == GateSettings.__struct_fields__


async def test_an_unknown_setting_is_a_type_error_even_for_a_known_gate(fleet: Fleet) -> None:
    fleet.gate("known", floor=2)
    for name in ("known", "new"):
        with pytest.raises(TypeError, match=r"^Fleet\.gate\(\) got an unexpected keyword"):
            fleet.gate(name, flor=2)  # type: ignore[call-arg]
