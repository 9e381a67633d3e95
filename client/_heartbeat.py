"""The heartbeat: one background loop per process that renews every gate's leases and waiters.

Each gate is renewed on its own schedule: a gate with leases or waiters every
``min(heartbeat_interval, TTL / 3)`` -- the TTLs in force, learnt from every acquire and
heartbeat reply, so a short ``lease_ms`` set by the coordinator is honoured from the very first
grant -- and an idle gate every ``register_period`` (to stay a counted live pod). One beat of a
gate is one script call (``heartbeat.lua``): it renews what the gate hands it
(:meth:`Gate.renewal`) and the gate applies the reply (:meth:`Gate.on_heartbeat`): lost leases,
grants whose wake-up was lost, expired waiters, the limit and the live-pod count.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from fleetgate.keys import fleet_keys

from ._gate import Gate
from ._runtime import OUTAGE_ERRORS, Runtime

__all__ = ["Heartbeat"]

log = logging.getLogger("fleetgate.client")


class Heartbeat:
    """Renews the leases and waiters of ``gates`` (the fleet's live mapping of its gates)."""

    def __init__(self, runtime: Runtime, gates: Mapping[str, Gate]) -> None:
        self.runtime = runtime
        self.gates = gates

    async def run(self) -> None:
        rt = self.runtime
        loop = asyncio.get_running_loop()
        while not rt.closing:
            try:
                now = loop.time()
                gates = list(self.gates.values())
                due = [g for g in gates if now >= self._next_beat(g)]
                if rt.fallback_active or not due:
                    nxt = min((self._next_beat(g) for g in gates), default=now + 3600)
                    wait = rt.heartbeat_interval if rt.fallback_active else nxt - now
                    await self._nap(max(0.001, wait))
                    continue
                for g in due:
                    g.renewed_at = now
                await asyncio.gather(*(self._beat(g) for g in due))
            except Exception as exc:  # never ends: the next round retries
                rt.background_error("heartbeat", exc)
                await asyncio.sleep(min(1.0, rt.heartbeat_interval))

    def _next_beat(self, gate: Gate) -> float:
        if gate.busy:
            return gate.renewed_at + min(self.runtime.heartbeat_interval, gate.ttl_ms / 3000)
        return gate.renewed_at + self.runtime.register_period

    async def _nap(self, seconds: float) -> None:
        """Sleep ``seconds`` or until the runtime's ``replan`` is set (no asyncio.wait_for:
        see _deadline)."""
        replan = self.runtime.replan
        handle = asyncio.get_running_loop().call_later(seconds, replan.set)
        try:
            await replan.wait()
        finally:
            handle.cancel()
            replan.clear()

    async def _beat(self, gate: Gate) -> None:
        rt = self.runtime
        sent_at = asyncio.get_running_loop().time()
        renewal = gate.renewal()
        pod_ttl_ms = int(max(10.0, 10 * rt.heartbeat_interval) * 1000)
        if not gate.in_registry:
            await self._list_in_registry(gate)
        try:
            reply = await rt.scripts.heartbeat(
                gate.keys,
                rt.pod_key,
                pod_ttl_ms,
                renewal.leases,
                renewal.waiters,
                max_token=renewal.max_token,
                defaults=gate.defaults,
            )
        except OUTAGE_ERRORS as exc:
            if rt.on_redis_error == "fail":
                gate.fail_waiters(rt.unreachable(exc))
                log.warning("gate %s: heartbeat failed: %s", gate.name, exc)
            else:
                rt.on_outage(exc)
            return
        except Exception as exc:
            rt.background_error("heartbeat", exc, gate.name)
            return
        gate.on_heartbeat(reply, renewal, sent_at)

    async def _list_in_registry(self, gate: Gate) -> None:
        # The registry lives outside the gate's slot: a separate command, once. A broken
        # registry (say a key of the wrong type) must never stop the lease renewal.
        rt = self.runtime
        try:
            await rt.redis.sadd(fleet_keys(rt.prefix).gates, gate.name)
            gate.in_registry = True
        except OUTAGE_ERRORS:
            pass  # the heartbeat meets the same outage and handles it
        except Exception as exc:
            rt.background_error("registry", exc, gate.name)
            gate.in_registry = True  # do not retry every beat
