"""One gate's bad input never stops the coordinator for the others: an exception in one gate's
decision costs that gate's poll only (were it to abort the whole poll while the leader keeps its
lease, every adaptive gate would decay to its floor with no standby taking over), and odd inputs
(a non-UTF-8 field, an absurd count, a window of zeros, a non-ASCII metrics URL) are unknown,
not errors."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
import redis.asyncio as aredis
from prometheus_client import CollectorRegistry

from fleetgate.coordinator import controller, daemon
from fleetgate.coordinator.config import Config
from fleetgate.coordinator.controller import ControllerParams, ControllerState, Observation, step
from fleetgate.coordinator.gradient import GradientParams, GradientState, LatencyView, step_latency
from fleetgate.errors import ConfigError
from fleetgate.keys import GateKeys
from fleetgate.observed import Reading
from fleetgate.tools.sim import serve_in_thread

from .._stub import StubValues, metrics_stub
from ..conftest import RedisUnderTest
from ._coordinator import config_with, eventually, running


def _config(rut: RedisUnderTest, metrics_url: str) -> Config:
    gates = "\n".join(
        f'[[gates]]\nname = "{name}"\nfloor = 4\nceiling = {ceiling}\n'
        f'metrics_url = "{metrics_url}"\n'
        for name, ceiling in (("good", 64), ("bad", 13))
    )
    return config_with(rut, gates)


async def test_a_gate_whose_decision_fails_leaves_the_others_published(
    rut: RedisUnderTest, async_redis: aredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    good, bad = GateKeys.of(rut.prefix, "good"), GateKeys.of(rut.prefix, "bad")
    # Two faults on gate "bad": a field of its obs hash that is no UTF-8 (anyone with the
    # client ACL can write it), and a controller step that raises (a bug of ours, simulated).
    await async_redis.hset(bad.obs, b"\xff", 1)
    real_step = controller.step

    def step_failing_for_bad(state: Any, obs: Any, params: ControllerParams, now: float) -> Any:
        if params.ceiling == 13:
            raise RuntimeError("simulated bug in one gate's decision")
        return real_step(state, obs, params, now)

    monkeypatch.setattr(controller, "step", step_failing_for_bad)
    with serve_in_thread(metrics_stub(StubValues(running=0))) as served:
        async with running(_config(rut, f"{served.url}/metrics")) as coord:
            await eventually(lambda: async_redis.hexists(good.target, "value"), 5, "a target")
            first = int(await async_redis.hget(good.target, "expires_at") or 0)
            # Still published poll after poll (its lease renewed), by the same leader.
            await eventually(
                lambda: _after(async_redis.hget(good.target, "expires_at"), first), 5, "renewal"
            )
            assert coord.election.is_leader
            # The failing gate is unknown: held unpublished (its target decays to the floor).
            assert await async_redis.hget(bad.target, "value") is None


async def _after(value: Any, first: int) -> bool:
    return int(await value or 0) > first


def test_a_non_utf8_field_of_the_obs_hash_is_ignored() -> None:
    reading = Reading.parse({b"\xff": b"3", b"ok": b"5"})
    assert reading.ok == 5


def test_an_absurd_but_finite_running_count_is_no_capacity() -> None:
    """``running`` 1e308 over a KV usage of 0.5 made the KV estimate infinite, and the
    controller's floor() of it raised OverflowError."""
    p = ControllerParams(floor=4, ceiling=64)
    state = ControllerState.initial(p)
    obs = Observation(1e308, 0.0, 4.0, True, 0.5)
    for t in range(5):
        d = step(state, obs, p, float(t))
        assert p.floor <= d.target <= p.ceiling
        state = d.state
    assert state.capacity is None or math.isfinite(state.capacity)


def test_a_latency_window_of_zeros_is_no_latency() -> None:
    """Latencies of 0 s (``lease.report("ok", 0.0)`` is allowed) gave a p50 of 0 and a
    division by zero once the gate had left slow start."""
    p = GradientParams(floor=4, ceiling=64)
    state = GradientState(target=32, slow_start=False, no_load=0.5)
    zeros = Reading(ok=200, lat_n=200, lat_us=0, buckets={0: 200}, at=10.0, seconds=2.0)
    d = step_latency(state, LatencyView(Reading(ok=200, at=10.0, seconds=2.0), zeros, 32), p, 10.0)
    assert p.floor <= d.target <= p.ceiling


async def test_a_metrics_listen_host_that_does_not_resolve_names_the_field(
    rut: RedisUnderTest,
) -> None:
    """Accepted by the config (only the port is checked there), it fails at start with an
    error naming the field, not a bare ``gaierror``."""
    cfg = Config.from_toml_text(
        f"""
[redis]
url = "{rut.url}"
prefix = "{rut.prefix}"
[coordinator]
metrics_listen = "no-such-host.invalid:9464"
[[gates]]
name = "g"
floor = 2
""",
        env={},
    )
    coord = daemon.Coordinator(cfg, registry=CollectorRegistry())
    with pytest.raises(ConfigError, match=r"^metrics_listen: cannot listen on no-such-host"):
        await coord.run(asyncio.Event())


async def test_a_gate_held_by_failing_decisions_restarts_from_the_floor(
    rut: RedisUnderTest, async_redis: aredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Held polls count as unknown: after unknown_reset_polls of them the gate's state restarts
    from the floor, as its target has run out (a held state of 40 would be published at once by
    the first good poll, to a fleet at the floor)."""
    keys = GateKeys.of(rut.prefix, "good")
    with serve_in_thread(metrics_stub(StubValues(running=0))) as served:
        cfg = _config(rut, f"{served.url}/metrics")
        await async_redis.hset(keys.util, "state", '{"target":40,"slow_start":false}')
        sec, _ = await async_redis.time()
        live = {"value": 40, "expires_at": sec * 1000 + 1500}
        await async_redis.hset(keys.target, mapping=live)  # type: ignore[arg-type]
        real_step = controller.step
        failing = True

        def step(state: Any, obs: Any, params: ControllerParams, now: float) -> Any:
            if failing:
                raise RuntimeError("simulated bug in the decision")
            return real_step(state, obs, params, now)

        monkeypatch.setattr(controller, "step", step)
        async with running(cfg) as coord:
            await eventually(lambda: _floor_state(coord), 10, "the state back at the floor")
            failing = False
            await eventually(
                lambda: _published_after(async_redis, keys, sec + 2), 10, "a fresh target"
            )
            assert int(await async_redis.hget(keys.target, "value") or 0) <= 8


async def _floor_state(coord: daemon.Coordinator) -> bool:
    state = coord.states.get("good")
    return state is not None and state.target == 4


async def _published_after(r: aredis.Redis, keys: GateKeys, sec: int) -> bool:
    expires = await r.hget(keys.target, "expires_at")
    return expires is not None and float(expires) > sec * 1000


async def test_a_metrics_url_that_is_no_ascii_fails_only_its_own_scrape(
    rut: RedisUnderTest, async_redis: aredis.Redis
) -> None:
    """A metrics URL with a non-ASCII path passes the config (it parses as a URL): its GET is
    sent percent-encoded (the stub answers 404, a failed scrape of that gate alone), and the
    other gates are published poll after poll."""
    good = GateKeys.of(rut.prefix, "good")
    with serve_in_thread(metrics_stub(StubValues(running=0))) as served:
        gates = "\n".join(
            f'[[gates]]\nname = "{name}"\nfloor = 4\nceiling = 64\nmetrics_url = "{url}"\n'
            for name, url in (("good", f"{served.url}/metrics"), ("bad", f"{served.url}/métrics"))
        )
        async with running(config_with(rut, gates)) as coord:
            await eventually(lambda: async_redis.hexists(good.target, "value"), 5, "a target")
            first = int(await async_redis.hget(good.target, "expires_at") or 0)
            await eventually(
                lambda: _after(async_redis.hget(good.target, "expires_at"), first), 5, "renewal"
            )
            assert coord.election.is_leader
            errors = coord.metrics.scrape_errors.labels("bad")._value.get()
            assert errors >= 1
