"""A gate's settings stored in Redis win over a later caller's; the caller is told which differ."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import sys

import pytest
import redis
from prometheus_client import CollectorRegistry

from fleetgate.client import Fleet
from fleetgate.keys import GateKeys
from fleetgate.scripts import script_source
from fleetgate.scripts._argv import publish_argv
from fleetgate.settings import GateSettings, settings_differing

from ..conftest import RedisUnderTest
from . import _token_workers

FIRST = """
import asyncio, sys
from prometheus_client import CollectorRegistry
from fleetgate.client import Fleet

async def main() -> None:
    async with Fleet(sys.argv[1], prefix=sys.argv[2], registry=CollectorRegistry()) as fleet:
        gate = fleet.gate("llm", floor=4, max_queued=20, tenant_weights={"a": 2})
        async with gate.permit(deadline=5):
            pass

asyncio.run(main())
"""


@pytest.mark.long
async def test_settings_another_process_stored_are_named_once(
    rut: RedisUnderTest, caplog: pytest.LogCaptureFixture
) -> None:
    first = await asyncio.create_subprocess_exec(
        sys.executable, "-c", FIRST, rut.url, rut.prefix, stderr=asyncio.subprocess.PIPE
    )
    _, err = await asyncio.wait_for(first.communicate(), 60)
    assert first.returncode == 0, err
    caplog.set_level(logging.WARNING, logger="fleetgate.client")
    async with Fleet(rut.url, prefix=rut.prefix, registry=CollectorRegistry()) as fleet:
        gate = fleet.gate("llm", floor=512, max_queued=20, lease_ms=10_000, tenant_weights={"b": 3})
        for _ in range(3):
            async with gate.permit(deadline=5):
                pass
        snap = await gate.snapshot()
        assert snap.limit == 4  # the stored floor is what holds
        assert snap.differing == {"floor": ("4", "512"), "tenant_weights": ("a=2", "b=3")}
        for _ in range(50):
            lines = [r for r in caplog.records if "Redis holds other settings" in r.getMessage()]
            if lines:
                break
            await asyncio.sleep(0.02)
        [line] = lines  # once, however many calls
        text = line.getMessage()
        assert "'llm'" in text and "floor 4 (asked 512)" in text and "tenant_weights" in text
        assert "max_queued" not in text and "lease_ms" not in text  # the same, or not given
        assert line.levelno == logging.WARNING


async def test_a_gate_this_process_registers_differs_in_nothing(
    rut: RedisUnderTest, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="fleetgate.client")
    async with Fleet(rut.url, prefix=rut.prefix, registry=CollectorRegistry()) as fleet:
        gate = fleet.gate("fresh", floor=7, shed_below=-5)
        async with gate.permit(deadline=5):
            pass
        assert (await gate.snapshot()).differing == {}
        await asyncio.sleep(0.2)
    assert not [r for r in caplog.records if "Redis holds other settings" in r.getMessage()]


def test_only_given_settings_are_compared() -> None:
    asked = GateSettings.for_gate("g", floor=8)
    stored = {"floor": "8", "ceiling": "64", "max_queued": "5", "lease_ms": "10000"}
    assert settings_differing(asked, ["floor"], stored, {}) == {}
    assert settings_differing(asked, ["floor", "ceiling"], stored, {}) == {
        "ceiling": ("64", str(asked.ceiling))
    }
    assert settings_differing(asked, ["floor"], {}, {}) == {}  # nothing stored: nothing differs
    # any stored setting makes the gate configured: a field it lacks is unset, not the caller's
    assert settings_differing(asked, ["floor"], {"token_limit": "5"}, {}) == {
        "floor": ("unset", "8")
    }
    mqpt = GateSettings.for_gate("g", max_queued_per_tenant=3)
    assert settings_differing(mqpt, ["max_queued_per_tenant"], stored, {}) == {
        "max_queued_per_tenant": ("unset", "3")
    }


@pytest.mark.long
def test_across_processes_every_script_follows_the_stored_configuration(
    rut: RedisUnderTest,
) -> None:
    """The coordinator stored gate 'open' without a token budget and gate 'capped' with 100
    tokens; four OS processes ask token_limit=100 of 'open' and 1,000 of 'capped' (2 callers of
    60 tokens each). The arrivals and the hand-offs answer by the stored configuration alike:
    on 'open' no call ever waits (16 units fit every caller), on 'capped' the tokens held never
    exceed 100, whatever the processes asked."""
    r = redis.Redis.from_url(rut.url, decode_responses=True)
    publish = r.register_script(script_source("publish"))
    stored = {
        "open": GateSettings(floor=16, max_queued=10_000),
        "capped": GateSettings(floor=16, max_queued=10_000, token_limit=100),
    }
    for name, settings in stored.items():
        args = publish_argv(1, 60_000, None, settings.as_cfg(), {})
        assert publish(keys=GateKeys.of(rut.prefix, name).script_keys(), args=args)[0] == 1
    asked = {"open": 100, "capped": 1000}
    with mp.get_context("spawn").Pool(4) as pool:
        peaks = {
            name: pool.starmap(
                _token_workers.steady_calls,
                [(rut.url, rut.prefix, name, asked[name], 20, f"{rut.prefix}:{name}")] * 4,
            )
            for name in stored
        }
    stats = {name: r.hgetall(GateKeys.of(rut.prefix, name).stats) for name in stored}
    r.close()
    assert {name: int(s.get("granted", 0)) for name, s in stats.items()} == {
        "open": 80, "capped": 80
    }  # fmt: skip
    # 'open': no budget stored, none applied: nobody parked for tokens (an arrival by the
    # processes' 100 would park a second 60-token call, which a release then hands off anyway)
    assert int(stats["open"].get("parked", 0)) == 0, (stats["open"], peaks["open"])
    # 'capped': the stored 100 holds across the fleet, and it was binding
    assert max(p["tokens"] for p in peaks["capped"]) <= 100, peaks["capped"]
    assert int(stats["capped"].get("parked", 0)) > 0, stats["capped"]
