"""Writing a poll's outcome to Redis: one pipeline per poll, epoch-fenced targets.

Each poll the leader registers every gate's configuration (the coordinator's config wins over
client defaults) and the gate registry, publishes targets through ``set_target.lua`` (which
refuses a lower epoch and hands new room to waiters at once) and stores the utilisation snapshot
with the controller state, from which a new leader resumes (warm failover).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import msgspec

from fleetgate._redis import AnyRedis, is_cluster
from fleetgate.keys import GateKeys, fleet_keys
from fleetgate.scripts import GateScripts

from .config import GateConfig
from .controller import ControllerParams, ControllerState, Decision, dump_state, load_state
from .signals import Signals

__all__ = ["Publication", "Publisher"]


class Publication(msgspec.Struct, frozen=True):
    """What one poll decided for one gate."""

    gate: GateConfig
    decision: Decision
    signals: Signals | None
    in_flight: int | None
    polled_at: float  # Redis server time, seconds


def _cfg_mapping(gate: GateConfig) -> dict[str, int]:
    return {
        "floor": gate.floor,
        "ceiling": gate.ceiling,
        "max_queued": gate.max_queued,
        "lease_ms": gate.lease_ms,
        "waiter_ms": gate.waiter_ms,
    }


def _util_mapping(p: Publication) -> dict[str, str]:
    s, d = p.signals, p.decision

    def fmt(v: float | None) -> str:
        return "" if v is None else repr(float(v))

    return {
        "running": fmt(s.running if s else None),
        "waiting_capacity": fmt(s.waiting_capacity if s else None),
        "kv_cache_usage": fmt(s.kv_cache_usage if s else None),
        "current_target": str(d.target),
        "floor": str(p.gate.floor),
        "ceiling": str(p.gate.ceiling),
        "metrics_ok": "1" if (s is not None and s.ok) else "0",
        "saturated": "1" if d.saturated else "0",
        "last_poll": repr(p.polled_at),
        "metrics_url": ",".join(p.gate.metrics_urls),
        "server": (s.server or "") if s is not None else "",
        "reason": str(d.reason.value),
        "in_flight": "" if p.in_flight is None else str(p.in_flight),
        "error": (s.error or "") if s is not None else "",
        "state": dump_state(d.state).decode(),
    }


class Publisher:
    """Reads and writes the coordinator's keys for one prefix."""

    def __init__(self, client: AnyRedis, prefix: str) -> None:
        self.client = client
        self.prefix = prefix
        self.fleet = fleet_keys(prefix)
        self.scripts = GateScripts(client)
        self._keys: dict[str, GateKeys] = {}

    def keys(self, name: str) -> GateKeys:
        found = self._keys.get(name)
        if found is None:
            found = self._keys[name] = GateKeys.of(self.prefix, name)
        return found

    async def server_time(self) -> float:
        sec, usec = await self.client.time()
        return float(sec) + float(usec) / 1e6

    async def in_flight(self, gates: Sequence[GateConfig]) -> dict[str, int]:
        """Leases held fleet-wide per gate (one pipeline)."""
        pipe = self.client.pipeline(transaction=False)
        for g in gates:
            pipe.zcard(self.keys(g.name).holders)
        counts = await pipe.execute()
        return {g.name: int(c) for g, c in zip(gates, counts, strict=True)}

    async def load_states(
        self, gates: Sequence[GateConfig], params: dict[str, ControllerParams]
    ) -> dict[str, ControllerState]:
        """The controller states the previous leader stored (cold start where none)."""
        pipe = self.client.pipeline(transaction=False)
        for g in gates:
            pipe.hget(self.keys(g.name).util, "state")
        raw = await pipe.execute()
        return {g.name: load_state(r, params[g.name]) for g, r in zip(gates, raw, strict=True)}

    async def publish(
        self, epoch: int, target_ttl_ms: int, pubs: Sequence[Publication]
    ) -> list[bool]:
        """Register configs, publish targets and snapshots in one pipeline.

        Returns, per publication, whether the target was accepted (False: a newer epoch owns the
        gate, so this coordinator has been deposed). Publications whose decision says not to
        publish (static, unknown signals) still refresh the snapshot but leave the target alone.
        """
        if is_cluster(self.client):
            return await self._publish_each(epoch, target_ttl_ms, pubs)
        pipe = self.client.pipeline(transaction=False)
        pipe.sadd(self.fleet.gates, *[p.gate.name for p in pubs])
        target_slots: list[int] = []
        for p in pubs:
            keys = self.keys(p.gate.name)
            pipe.hset(keys.cfg, mapping=_cfg_mapping(p.gate))  # type: ignore[arg-type]
            if p.decision.publish:
                target_slots.append(len(pipe.command_stack))
                await self._set_target(pipe, keys, p.decision.target, epoch, target_ttl_ms)
            else:
                target_slots.append(-1)
            pipe.hset(keys.util, mapping=_util_mapping(p))  # type: ignore[arg-type]
        results = await pipe.execute()
        return [slot < 0 or int(results[slot][0]) == 1 for slot in target_slots]

    async def _publish_each(
        self, epoch: int, target_ttl_ms: int, pubs: Sequence[Publication]
    ) -> list[bool]:
        """Redis Cluster blocks scripts in pipelines: the same writes, concurrently per gate."""
        await self.client.sadd(self.fleet.gates, *[p.gate.name for p in pubs])

        async def one(p: Publication) -> bool:
            keys = self.keys(p.gate.name)
            await self.client.hset(keys.cfg, mapping=_cfg_mapping(p.gate))
            accepted = True
            if p.decision.publish:
                ttl = target_ttl_ms
                accepted = await self.scripts.set_target(keys, p.decision.target, epoch, ttl)
            await self.client.hset(keys.util, mapping=_util_mapping(p))
            return accepted

        return list(await asyncio.gather(*(one(p) for p in pubs)))

    async def _set_target(
        self, pipe: Any, keys: GateKeys, value: int, epoch: int, ttl_ms: int
    ) -> None:
        # On a pipeline, awaiting the script only queues its EVALSHA (and the pipeline loads
        # the script first if the server lacks it).
        script = self.scripts.script("set_target")
        await script(keys=keys.script_keys(), args=[value, epoch, ttl_ms], client=pipe)

    async def registered_gates(self) -> list[str]:
        return sorted(str(n) for n in await self.client.smembers(self.fleet.gates))

    async def sweep(self, names: Sequence[str]) -> None:
        """Reap expired leases and waiters of ``names`` and move their queues (one pipeline)."""
        if not names:
            return
        if is_cluster(self.client):
            await asyncio.gather(
                *(self.scripts.heartbeat(self.keys(n), "", 0, [], []) for n in names)
            )
            return
        pipe = self.client.pipeline(transaction=False)
        script = self.scripts.script("heartbeat")
        for name in names:
            # The heartbeat with an empty pod id renews nothing: it only reaps and hands off.
            await script(keys=self.keys(name).script_keys(), args=["", 0, 0, 0], client=pipe)
        await pipe.execute()
