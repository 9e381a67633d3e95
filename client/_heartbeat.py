"""The heartbeat: one background loop per process that renews every gate's leases and waiters.

Each gate is renewed on its own schedule: a gate with leases or waiters every
``min(heartbeat_interval, TTL / 3)`` -- the TTLs in force, learnt from every acquire and
heartbeat reply, so a short ``lease_ms`` set by the coordinator is honoured from the very first
grant -- and an idle gate every ``register_period`` (to stay a counted live pod). One beat of a
gate is one script call (``heartbeat.lua``): it renews what the gate hands it
(:meth:`Gate.renewal`) and the gate applies the reply (:meth:`Gate.on_heartbeat`): lost leases,
grants whose wake-up was lost, expired waiters, the limit and the live-pod count.

The beats of one round go out together (:meth:`GateScripts.heartbeats`: on a standalone Redis
one ``heartbeat_many.lua`` call per ~1 ms of server time, one round trip each; on Cluster one
call per slot in use -- per gate with plain names, per group's gates with grouped names --, sent
as one pipeline per node per ~1 ms of server time), and
a round takes every gate that would be due within half its period anyway: renewing early is
always safe, and the gates' schedules fall into step, so a pod with many gates sends a few calls
per heartbeat period instead of one per gate. A gate's renewal is never later
than its own schedule.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping

from fleetgate._redis import error_text
from fleetgate.registry import register
from fleetgate.scripts import HeartbeatRequest

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
                if rt.fallback_active or not any(now >= self._next_beat(g) for g in gates):
                    nxt = min((self._next_beat(g) for g in gates), default=now + 3600)
                    wait = rt.heartbeat_interval if rt.fallback_active else nxt - now
                    await self._nap(max(0.001, wait))
                    continue
                # Due now, or within half its period: beat together. A beat asked for by a
                # time (Gate.beat_after) is never sent early, and stays asked for until then.
                due = [g for g in gates if self._due(g, now)]
                for g in due:
                    g.renewed_at = now
                    if now >= g.beat_by:
                        g.beat_by = math.inf
                await self._beat(due)
            except Exception as exc:  # never ends: the next round retries
                rt.background_error("heartbeat", exc)
                await asyncio.sleep(min(1.0, rt.heartbeat_interval))

    def _next_beat(self, gate: Gate) -> float:
        return min(gate.renewed_at + gate.renewal_period, gate.beat_by)

    def _due(self, gate: Gate, now: float) -> bool:
        return now >= gate.beat_by or now >= gate.renewed_at + gate.renewal_period / 2

    async def _nap(self, seconds: float) -> None:
        """Sleep ``seconds`` or until the runtime's ``replan`` is set (no asyncio.wait_for:
        see _deadline). ``Runtime.heartbeat_wakes_at`` says until when, meanwhile."""
        rt = self.runtime
        replan = rt.replan
        loop = asyncio.get_running_loop()
        handle = loop.call_later(seconds, replan.set)
        rt.heartbeat_wakes_at = handle.when()
        try:
            await replan.wait()
        finally:
            rt.heartbeat_wakes_at = math.inf
            handle.cancel()
            replan.clear()

    async def _beat(self, gates: list[Gate]) -> None:
        rt = self.runtime
        sent_at = asyncio.get_running_loop().time()
        pod_ttl_ms = int(max(10.0, 10 * rt.heartbeat_interval) * 1000)
        renewals = [g.renewal() for g in gates]
        requests = [
            HeartbeatRequest(
                g.keys,
                rt.pod_key,
                pod_ttl_ms,
                r.leases,
                r.waiters,
                max_token=r.max_token,
                defaults=g.defaults,
                fence_ms=rt.fence_ms,
            )
            for g, r in zip(gates, renewals, strict=True)
        ]
        try:
            replies = await rt.scripts.heartbeats(requests)
        except OUTAGE_ERRORS as exc:
            if rt.on_redis_error == "fail":
                for g in gates:
                    g.fail_waiters(rt.unreachable(exc))
                log.warning("heartbeat of %d gate(s) failed: %s", len(gates), error_text(exc))
            else:
                rt.on_outage(exc)
            return
        for g, renewal, reply in zip(gates, renewals, replies, strict=True):
            if isinstance(reply, Exception):
                rt.background_error("heartbeat", reply, g.name)
            else:
                if reply.pod_new:
                    g.in_registry = False  # first beat, or the gate was pruned or wiped
                g.on_heartbeat(reply, renewal, sent_at)
        # Listed after the beat that made this pod a live pod of the gate, never before: a
        # prune never deletes a gate with a live pod, and a prune that came before this beat
        # made it create the pod's entry anew (pod_new), so the gate is listed again here.
        # Listed before the beat, a prune between the SADD and the beat left the gate out of
        # the registry while in use (its pod_new taken for the first registration).
        unlisted = [g for g in gates if not g.in_registry]
        if unlisted:
            await self.list_in_registry(unlisted)

    async def list_in_registry(self, gates: list[Gate]) -> None:
        """List ``gates`` in the fleet's registry (``fleetgate status``); never raises."""
        # The registry lives outside the gates' slots: a separate command (one for all), once
        # per gate. A broken registry (say a key of the wrong type) must never stop the lease
        # renewal.
        rt = self.runtime
        try:
            await register(rt.redis, rt.prefix, [g.name for g in gates])
            for g in gates:
                g.in_registry = True
        except OUTAGE_ERRORS:
            pass  # the heartbeat meets the same outage and handles it
        except Exception as exc:
            rt.background_error("registry", exc, gates[0].name)
            for g in gates:
                g.in_registry = True  # do not retry every beat
