"""The per-process fleet handle: connections, scripts and background tasks for all gates."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import uuid
from collections.abc import Coroutine
from types import TracebackType
from typing import Any, Literal

import msgspec
import redis.asyncio as aredis
from prometheus_client import CollectorRegistry
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential

from fleetgate._redis import connect, prepare, redact
from fleetgate.errors import ConfigError, FleetgateError, RedisUnavailable
from fleetgate.keys import GateKeys, fleet_keys, validate_gate_name, validate_prefix
from fleetgate.scripts import GateDefaults, GateScripts

from ._gate import REDIS_ERRORS, Gate
from ._metrics import ClientMetrics, client_metrics

__all__ = ["Fleet", "GateUtilization"]

log = logging.getLogger("fleetgate.client")

OnRedisError = Literal["fair_share", "fail"]
_MAX_POD_ID = 64
# While Redis is unreachable each pod probes it every PROBE_PERIOD seconds (at most). After it
# answers again, a pod waits RECOVERY_GRACE seconds (its running work adopted, no new local
# permit started) before it is granted from Redis: longer than the other pods' probe period, so
# they adopt their running work first, and short enough that the fleet is back within about a
# heartbeat (1 s by default) of Redis returning. See Fleet._probe_loop.
PROBE_PERIOD = 0.25
RECOVERY_GRACE = 0.4


class GateUtilization(msgspec.Struct, kw_only=True):
    """A snapshot of one gate: the seed's ``get_utilization`` fields plus fleet-wide state."""

    name: str
    limit: int
    #: the limit the gate applies now (the seed's name for it): live target, else floor
    current_target: int
    #: the coordinator's published target while its lease is live, else None
    target: int | None
    in_flight: int
    queued: int
    floor: int
    ceiling: int
    max_queued: int
    epoch: int | None
    live_pods: int
    running: float | None = None
    waiting_capacity: float | None = None
    metrics_ok: bool = False
    saturated: bool = False
    last_poll: float | None = None
    metrics_url: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)


def _default_pod_id() -> str:
    host = socket.gethostname().replace(":", "-")[:40]
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Fleet:
    """Owns the Redis connections and background tasks of one process; hands out gates.

    ``async with Fleet("redis://redis:6379/0") as fleet:`` then ``fleet.gate("bge-m3")``.

    on_redis_error: ``"fair_share"`` (default) keeps serving while Redis is unreachable, each pod
    bounded by ``ceil(last limit / last live pods)`` of the gate (1 while it has not counted its
    peers yet), and returns to fleet mode when Redis answers again; ``"fail"`` raises
    :class:`RedisUnavailable` instead.

    pod_id is a label (logs, the worker's metrics); lease ids stay unique per process whatever
    it says (:attr:`pod_key` adds a random suffix), so several processes may share one.
    """

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        prefix: str = "fg",
        pod_id: str | None = None,
        on_redis_error: OnRedisError = "fair_share",
        heartbeat_interval: float = 1.0,
        wake_block: float = 2.0,
        registry: CollectorRegistry | None = None,
        redis_options: dict[str, Any] | None = None,
    ) -> None:
        if on_redis_error not in ("fair_share", "fail"):
            raise ConfigError(
                f"on_redis_error: expected 'fair_share' or 'fail', got {on_redis_error!r}"
            )
        if heartbeat_interval <= 0:
            raise ConfigError(f"heartbeat_interval: expected > 0, got {heartbeat_interval}")
        self.url = url
        self.prefix = validate_prefix(prefix)
        self.pod_id = pod_id or _default_pod_id()
        if len(self.pod_id) > _MAX_POD_ID:
            raise ConfigError(f"pod_id: at most {_MAX_POD_ID} characters, got {len(self.pod_id)}")
        validate_gate_name(self.pod_id)  # same character rules as gate names
        # What lease ids, wake lists and the live-pod registry use: unique per process even
        # when several processes are given the same pod_id ($HOSTNAME with several workers):
        # two processes minting the same lease ids would share holder entries (limit 2 -> 3
        # running; tests/test_fault_holes.py::test_processes_sharing_a_pod_id_keep_the_cap).
        self.pod_key = self.pod_id if pod_id is None else f"{self.pod_id}-{uuid.uuid4().hex[:8]}"
        self.on_redis_error = on_redis_error
        self.heartbeat_interval = heartbeat_interval
        # Every pod registers itself as live on each gate it uses at least this often (an idle
        # gate's heartbeat); a live-pod count is trusted one such period after registering.
        self.register_period = 3 * heartbeat_interval
        self.wake_block = wake_block
        self.metrics: ClientMetrics = client_metrics(registry)
        self._redis_options = dict(redis_options or {})
        self._ids = itertools.count(1)
        self._gates: dict[str, Gate] = {}
        self._listeners: dict[str, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._heartbeat: asyncio.Task[None] | None = None
        self._probe: asyncio.Task[None] | None = None
        self._redis: aredis.Redis | None = None
        self._scripts: GateScripts | None = None
        self._poke = asyncio.Event()  # wakes the heartbeat loop to re-plan (see _nap)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        self.fallback_active = False
        # Redis answers again after an outage: running work is being adopted, no new local
        # permit starts until fleet mode resumes (see _probe_loop).
        self.recovering = False

    # -- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> Fleet:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def start(self) -> None:
        """Open the connection pool and start the heartbeat. Redis need not be up yet."""
        if self._redis is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._redis = connect(self.url, **self._redis_options)
        await prepare(self._redis)
        self._scripts = GateScripts(self._redis)
        self._heartbeat = asyncio.create_task(self._heartbeat_loop(), name="fleetgate-heartbeat")
        log.debug("fleet %s started against %s", self.pod_id, redact(self.url))

    async def close(self) -> None:
        """Stop background tasks, leave every wait list, release held leases, close connections."""
        self._closing = True
        tasks = [t for t in (self._heartbeat, self._probe, *self._listeners.values()) if t]
        for t in tasks:
            t.cancel()
        # redis-py may hold a blocking call on a dedicated connection until it returns (at most
        # wake_block), or turn the cancellation into a connection error; the loops also stop on
        # the flag, and close() never waits longer than that.
        if tasks:
            await asyncio.wait(tasks, timeout=self.wake_block + 1.0)
        self._listeners.clear()
        closing = FleetgateError("fleet closed")
        for gate in self._gates.values():
            gate.fail_waiters(closing)
            for lease in list(gate.leases.values()):
                self.spawn(lease.release())
        # Releases and cancels still in flight (possibly spawning more) finish before the
        # connections close; bounded, since Redis may be gone.
        deadline = asyncio.get_running_loop().time() + 2.0
        while self._tasks:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                break
            await asyncio.wait(list(self._tasks), timeout=left)
        if self._redis is not None:
            await self._redis.aclose()
        self._redis = None

    @property
    def scripts(self) -> GateScripts:
        if self._scripts is None:
            raise FleetgateError("the fleet is not started: use `async with Fleet(...)`")
        return self._scripts

    @property
    def redis(self) -> aredis.Redis:
        if self._redis is None:
            raise FleetgateError("the fleet is not started: use `async with Fleet(...)`")
        return self._redis

    # -- gates -------------------------------------------------------------------------------

    def gate(
        self,
        name: str,
        *,
        floor: int | None = None,
        ceiling: int | None = None,
        max_queued: int | None = None,
        lease_ms: int | None = None,
        waiter_ms: int | None = None,
    ) -> Gate:
        """The gate ``name``. The settings are defaults registered only if the gate has no
        configuration in Redis yet (the coordinator's config wins)."""
        validate_gate_name(name)
        found = self._gates.get(name)
        if found is not None:
            return found
        d = GateDefaults()
        fl = d.floor if floor is None else floor
        values = {
            "floor": fl,
            "ceiling": max(fl, d.ceiling) if ceiling is None else ceiling,
            "max_queued": d.max_queued if max_queued is None else max_queued,
            "lease_ms": d.lease_ms if lease_ms is None else lease_ms,
            "waiter_ms": d.waiter_ms if waiter_ms is None else waiter_ms,
        }
        defaults = GateDefaults(**validate_gate_settings(name, values))
        gate = Gate(self, name, defaults)
        self._gates[name] = gate
        self.poke_heartbeat()  # register as a live pod of the gate now, not a period later
        return gate

    async def utilization(self, name: str) -> GateUtilization:
        """Snapshot of gate ``name``: limit, fleet in-flight and queue, the coordinator's view."""
        gate = self._gates.get(name)
        defaults = gate.defaults if gate is not None else None
        snap = await self.scripts.inspect(GateKeys.of(self.prefix, name), defaults=defaults)
        util, target = snap.util, snap.target
        return GateUtilization(
            name=name,
            limit=snap.limit,
            current_target=snap.limit,
            target=_live_target(target, snap.now),
            in_flight=snap.holders,
            queued=snap.queued,
            floor=snap.floor,
            ceiling=snap.ceiling,
            max_queued=snap.max_queued,
            epoch=_int(target.get("epoch")),
            live_pods=snap.live_pods,
            running=_float(util.get("running")),
            waiting_capacity=_float(util.get("waiting_capacity")),
            metrics_ok=util.get("metrics_ok") == "1",
            saturated=util.get("saturated") == "1",
            last_poll=_float(util.get("last_poll")),
            metrics_url=util.get("metrics_url") or None,
        )

    # -- plumbing used by gates --------------------------------------------------------------

    def next_id(self) -> str:
        return f"{self.pod_key}:{next(self._ids)}"

    def poke_heartbeat(self) -> None:
        """Make the heartbeat loop re-plan now (a gate appeared, or its TTLs changed).

        Safe from any thread (``SyncFleet.gate`` runs in the caller's thread)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return  # not started: the loop plans every gate when it starts
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if here is loop:
            self._poke.set()
        else:
            loop.call_soon_threadsafe(self._poke.set)

    def work_started(self, gate: Gate) -> None:
        """``gate`` gets its first lease or waiter: renew it a renewal period from now (the
        grant is as fresh as a renewal), whatever the heartbeat was sleeping on before."""
        gate.last_beat = asyncio.get_running_loop().time()
        self._poke.set()

    def background_error(self, task: str, exc: BaseException, gate: str = "") -> None:
        """A background task met an unexpected error: logged and counted; the task goes on."""
        self.metrics.background_errors.labels(task).inc()
        where = f"gate {gate}: " if gate else ""
        log.warning("%s%s failed: %s: %s (retrying)", where, task, type(exc).__name__, exc)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` in the background, keeping a reference until it ends."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def forget_later(self, gate: Gate, lease_id: str) -> None:
        """An acquire whose outcome is unknown (connection lost mid-call), or a release or
        cancel that failed: cancel the id once Redis answers (retried at least every second, so
        a slot is freed within about a second of recovery); if that never happens, the entry
        expires by TTL."""

        async def forget() -> None:
            try:
                async for attempt in AsyncRetrying(
                    retry=retry_if_exception_type(REDIS_ERRORS),
                    wait=wait_exponential(multiplier=0.1, max=1.0),
                    stop=stop_after_delay(gate.defaults.lease_ms / 1000),
                    reraise=True,
                ):
                    with attempt:
                        await self.scripts.cancel(gate.keys, lease_id)
            except REDIS_ERRORS:
                pass  # never answered: the entry expires by TTL
            except Exception as exc:  # e.g. WRONGTYPE: logged, never an unretrieved task error
                log.warning("gate %s: could not cancel %s: %s", gate.name, lease_id, exc)

        self.spawn(forget())

    def redis_failed(self, exc: BaseException) -> None:
        """Redis could not be reached: raise (``fail``) or switch to the fair-share fallback."""
        if self.on_redis_error == "fail":
            raise RedisUnavailable(f"Redis at {redact(self.url)} is unreachable: {exc}") from exc
        self._enter_fallback(exc)

    def _enter_fallback(self, exc: BaseException) -> None:
        if self.fallback_active:
            return
        self.fallback_active = True
        for gate in self._gates.values():
            # Redis may come back empty (a restart): register the gate again on the next
            # heartbeat so `fleetgate status` lists it (tests/chaos/test_redis_restart.py).
            gate.registered = False
        log.warning(
            "Redis at %s unreachable (%s): serving with local fair-share bounds until it is back",
            redact(self.url),
            exc,
        )
        for gate in self._gates.values():
            self.metrics.fallback.labels(gate.name).set(1)
            log.warning("gate %s: local bound %d permits", gate.name, gate.fair_share())
            gate.fail_waiters(None)
        self._probe = asyncio.create_task(self._probe_loop(), name="fleetgate-probe")

    async def _probe_loop(self) -> None:
        # Survives every exception: a reply that means "cannot serve writes now" (READONLY
        # after a failover, OOM, ...) is an outage like a refused connection (the scripts
        # raise ServerUnavailable), and anything else is logged, counted and retried. Before,
        # a ResponseError during adoption ended this task and the pod stayed in fallback for
        # good (tests/test_fault_holes.py::test_pod_resumes_after_redis_refused_writes).
        while not self._closing:
            await asyncio.sleep(min(PROBE_PERIOD, self.heartbeat_interval))
            try:
                await self._resume()
            except Exception as exc:
                if not isinstance(exc, REDIS_ERRORS):
                    self.background_error("probe", exc)
                if self.recovering:  # Redis failed again: local permits may start again
                    self.recovering = False
                    for gate in list(self._gates.values()):
                        await gate.wake_local()
                continue
            break
        self.recovering = False
        if self._closing:
            return
        self.fallback_active = False
        log.warning("Redis at %s reachable again: back to fleet mode", redact(self.url))
        for gate in self._gates.values():
            self.metrics.fallback.labels(gate.name).set(0)
            await gate.wake_local()

    async def _resume(self) -> None:
        """Redis answers again: adopt running work, wait out the grace, adopt again."""
        await self.redis.ping()
        await _drop_idle_connections(self.redis)
        await prepare(self.redis)
        # Before fleet mode resumes, what still runs counts against the fleet cap. From here
        # no new local permit starts (``recovering``), and this pod waits RECOVERY_GRACE before
        # it is granted from Redis again: every other pod in fallback probes within
        # PROBE_PERIOD and adopts its running work meanwhile. Without this, the first pod back
        # was granted up to the whole limit while the other pods' local permits still ran
        # uncounted (up to 17 calls running under a limit of 12 in
        # tests/chaos/test_redis_restart.py::test_redis_restart_fair_share).
        self.recovering = True
        await self._adopt_all()
        await asyncio.sleep(RECOVERY_GRACE)
        await self._adopt_all()  # renews what the first pass adopted (no heartbeat yet)

    async def _adopt_all(self) -> None:
        for gate in list(self._gates.values()):
            try:
                await gate.adopt_running()
            except REDIS_ERRORS:
                raise
            except Exception as exc:  # one gate's broken keys never hold the others back
                self.background_error("adopt", exc, gate.name)

    def ensure_listener(self, gate: Gate) -> None:
        """Start the wake listener of ``gate`` (one dedicated connection per gate)."""
        task = self._listeners.get(gate.name)
        if task is None or task.done():
            self._listeners[gate.name] = asyncio.create_task(
                self._listen(gate), name=f"fleetgate-wake-{gate.name}"
            )

    async def _listen(self, gate: Gate) -> None:
        # A blocking pop must never be cancelled on a shared connection (redis-py would hand a
        # late reply to the next command), so each listener owns its connection and drops it
        # on exit. Lost wake-ups (connection killed, Redis restarted) are recovered by the
        # heartbeat, which reports granted waiters.
        conn = connect(
            self.url,
            dedicated=True,
            **{**self._redis_options, "socket_timeout": self.wake_block + 3.0},
        )
        key = gate.keys.wake(self.pod_key)
        await prepare(conn)
        try:
            while not self._closing:
                try:
                    item = await conn.blpop([key], timeout=self.wake_block)
                except Exception as exc:  # never ends: the heartbeat covers the gap
                    if self._closing:
                        break
                    if isinstance(exc, REDIS_ERRORS):
                        log.debug("gate %s: wake listener error %s; reconnecting", gate.name, exc)
                    else:
                        self.background_error("wake listener", exc, gate.name)
                    await asyncio.sleep(min(1.0, self.heartbeat_interval))
                    continue
                if item is not None:
                    gate.on_granted(str(item[1]))
        finally:
            await conn.aclose()

    async def _heartbeat_loop(self) -> None:
        # Each gate is renewed on its own schedule: a gate with leases or waiters every
        # min(heartbeat_interval, TTL / 3) -- the TTLs in force, learnt from every acquire and
        # heartbeat reply, so a short lease_ms set by the coordinator is honoured from the very
        # first grant -- and an idle gate every register_period (to stay a counted live pod).
        loop = asyncio.get_running_loop()
        while not self._closing:
            try:
                now = loop.time()
                gates = list(self._gates.values())
                due = [g for g in gates if now >= self._next_beat(g)]
                if self.fallback_active or not due:
                    nxt = min((self._next_beat(g) for g in gates), default=now + 3600)
                    wait = self.heartbeat_interval if self.fallback_active else nxt - now
                    await self._nap(max(0.001, wait))
                    continue
                for g in due:
                    g.last_beat = now
                await asyncio.gather(*(self._beat(g) for g in due))
            except Exception as exc:  # never ends: the next round retries
                self.background_error("heartbeat", exc)
                await asyncio.sleep(min(1.0, self.heartbeat_interval))

    def _next_beat(self, gate: Gate) -> float:
        if gate.leases or gate.waiters:
            return gate.last_beat + min(self.heartbeat_interval, gate.ttl_ms / 3000)
        return gate.last_beat + self.register_period

    async def _nap(self, seconds: float) -> None:
        """Sleep ``seconds`` or until poke_heartbeat() (no asyncio.wait_for: see _deadline)."""
        handle = asyncio.get_running_loop().call_later(seconds, self._poke.set)
        try:
            await self._poke.wait()
        finally:
            handle.cancel()
            self._poke.clear()

    async def _beat(self, gate: Gate) -> None:
        sent_at = asyncio.get_running_loop().time()
        held = list(gate.leases.values())
        leases = [(lease.id, lease.expires_at) for lease in held]
        waiters = [
            (w.id, w.remaining_ms())
            for w in gate.waiters.values()
            if w.parked and not w.future.done()
        ]
        pod_ttl_ms = int(max(10.0, 10 * self.heartbeat_interval) * 1000)
        if not gate.registered:
            # The registry lives outside the gate's slot: a separate command, once. A broken
            # registry (say a key of the wrong type) must never stop the lease renewal below.
            try:
                await self.redis.sadd(fleet_keys(self.prefix).gates, gate.name)
                gate.registered = True
            except REDIS_ERRORS:
                pass  # the heartbeat below meets the same outage and handles it
            except Exception as exc:
                self.background_error("registry", exc, gate.name)
                gate.registered = True  # do not retry every beat
        try:
            reply = await self.scripts.heartbeat(
                gate.keys,
                self.pod_key,
                pod_ttl_ms,
                leases,
                waiters,
                max_token=max((lease.token for lease in held), default=0),
                defaults=gate.defaults,
            )
        except REDIS_ERRORS as exc:
            if self.on_redis_error == "fail":
                err = RedisUnavailable(f"Redis at {redact(self.url)} is unreachable: {exc}")
                gate.fail_waiters(err)
                log.warning("gate %s: heartbeat failed: %s", gate.name, exc)
            else:
                self._enter_fallback(exc)
            return
        except Exception as exc:
            self.background_error("heartbeat", exc, gate.name)
            return
        gate.on_heartbeat(reply, sent_at, [lid for lid, _ in leases])


async def _drop_idle_connections(client: Any) -> None:
    """Close the idle pooled connections of ``client`` (of every node, for a cluster client).

    Connections that were mid-command when Redis went away go back to redis-py's pool (8.1) in a
    state its connection check misses: their next command fails with "Connection closed by
    server.", which read as a second outage right after recovery (every pod fell back again
    within 2 ms of resuming fleet mode in
    tests/chaos/test_redis_restart.py::test_redis_restart_fair_share). New connections are
    opened on demand.
    """
    pool = getattr(client, "connection_pool", None)
    if pool is not None:
        await pool.disconnect(inuse_connections=False)
        return
    for node in client.get_nodes():
        await node.disconnect_free_connections()


def validate_gate_settings(name: str, values: dict[str, int]) -> dict[str, int]:
    """Check gate settings; the error names the gate and the field."""
    rules = {
        "floor": (1, "a cap <= 0 would block every call"),
        "ceiling": (1, "a cap <= 0 would block every call"),
        "max_queued": (0, "a negative queue bound is meaningless"),
        "lease_ms": (100, "leases shorter than 100 ms cannot be renewed in time"),
        "waiter_ms": (100, "waiters shorter than 100 ms cannot be refreshed in time"),
    }
    for field, (low, why) in rules.items():
        v = values[field]
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ConfigError(f"gate {name!r}: {field}: expected int >= {low}, got {v!r} ({why})")
    floor, ceiling = values["floor"], values["ceiling"]
    if ceiling < floor:
        raise ConfigError(f"gate {name!r}: ceiling: expected >= floor ({floor}), got {ceiling}")
    return values


def _live_target(target: dict[str, str], now_ms: int) -> int | None:
    expires = _int(target.get("expires_at"))
    if expires is None or expires <= now_ms:
        return None
    return _int(target.get("value"))


def _int(v: str | None) -> int | None:
    try:
        return int(float(v)) if v is not None else None
    except ValueError:
        return None


def _float(v: str | None) -> float | None:
    try:
        return float(v) if v not in (None, "") else None
    except ValueError:
        return None
