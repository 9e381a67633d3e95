"""An idle proxy's gate shows its settings in ``fleetgate status``: from the proxy's start, before
any request, and again within a heartbeat or two after Redis restarted empty -- not the limit 1
of a gate nobody configured until its next request. The proxy's heartbeat registers its routes'
``gate_defaults`` on a gate without configuration, as a first request would
(``lua/heartbeat_lib.lua``)."""

from __future__ import annotations

import asyncio

import httpx
import redis.asyncio as aredis

from fleetgate.proxy import serve_in_thread
from fleetgate.status import gather_status
from fleetgate.tools.redisproc import RedisProcess
from fleetgate.tools.sim._server import Served

from ._proxy import proxy_config


async def _shown(url: str, gate: str) -> tuple[int, int, int] | None:
    """(limit, floor, ceiling) of ``gate`` as ``fleetgate status`` reads it (None: unlisted)."""
    client = aredis.Redis.from_url(url, decode_responses=True)
    try:
        status = await gather_status(client, "fg")
    finally:
        await client.aclose()
    rows = [g for g in status.gates if g.name == gate]
    return (rows[0].limit, rows[0].floor, rows[0].ceiling) if rows else None


async def _eventually_shown(url: str, gate: str, want: tuple[int, int, int]) -> None:
    seen = None
    for _ in range(250):  # 5 s
        seen = await _shown(url, gate)
        if seen == want:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"status shows {gate} as (limit, floor, ceiling) {seen}, not {want}")


async def test_an_idle_proxy_gate_shows_its_settings_after_an_empty_restart(
    own_redis: RedisProcess, upstream: Served
) -> None:
    config = proxy_config(
        own_redis.url, "fg", upstream.url, gate="px", gate_defaults={"floor": 6, "ceiling": 12}
    )
    with serve_in_thread(config, fleet_options={"heartbeat_interval": 0.2}) as proxy:
        # started, never called: listed with its settings
        await _eventually_shown(own_redis.url, "px", (6, 6, 12))
        async with httpx.AsyncClient(base_url=proxy, timeout=10) as http:
            assert (await http.post("/work", json={"x": 1})).status_code == 200
        own_redis.restart()  # killed and started empty on the same port
        # idle since: the proxy's next heartbeats list the gate again, with its settings
        await _eventually_shown(own_redis.url, "px", (6, 6, 12))
