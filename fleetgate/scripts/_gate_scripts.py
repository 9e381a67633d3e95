"""The gate scripts' call surface: :class:`GateScripts`, one method per script.

A method encodes its script's ARGV (:mod:`fleetgate.scripts._argv`), runs the call (or returns it
as a :class:`ScriptCall` for :meth:`GateScripts.batch`), decodes the reply
(:mod:`fleetgate.scripts._replies`) and translates a Redis error reply into fleetgate's errors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from redis.exceptions import NoPermissionError, NoScriptError, ResponseError

from fleetgate._redis import BatchCall, RedisMode, ServerUnavailable, in_chunks, unavailable_reply
from fleetgate.errors import ConfigError, GateStateError
from fleetgate.keys import GateKeys
from fleetgate.settings import GateSettings

from ._argv import (
    HEARTBEAT_UNITS_PER_CALL,
    IDS_PER_CALL,
    AcquireRequest,
    HeartbeatRequest,
    acquire_argv,
    adopt_argv,
    cancel_argv,
    inspect_argv,
    prune_argv,
    publish_argv,
    release_argv,
    set_target_argv,
    sweep_argv,
)
from ._calls import ManyHeartbeats, ScriptCall, heartbeat_chunks, heartbeat_rounds
from ._library import GateFunction, Loader, function_missing
from ._replies import (
    AcquireReply,
    AdoptReply,
    HeartbeatReply,
    ResizeReply,
    Snapshot,
    accepted,
    as_is,
    decode_snapshot,
    first_int,
)

_R = TypeVar("_R")


@dataclass
class GateScripts:
    """The scripts registered on one redis-py client (standalone or cluster, asyncio).

    Every script call goes through here, its ARGV encoded by :mod:`fleetgate.scripts._argv` and
    its reply decoded by :mod:`fleetgate.scripts._replies`: one call at a time (:meth:`acquire`,
    ...) or several gates' calls batched (the ``*_call`` methods with :meth:`batch`).
    """

    client: Any
    _scripts: dict[str, Any] = field(default_factory=dict)
    redis: RedisMode = field(init=False)

    _loader: Loader = field(init=False)

    def __post_init__(self) -> None:
        self.redis = RedisMode(self.client)
        self._loader = Loader(self.redis)
        for name, function in self._loader.library.functions.items():
            self._scripts[name] = GateFunction(self._loader, function)

    async def _run(self, call: ScriptCall[_R]) -> _R:
        try:
            raw = await call(self.client)
        except ResponseError as exc:
            raise await self.translate(exc, call.keys) from exc
        return call.decode(raw)

    async def batch(
        self,
        calls: Sequence[ScriptCall[_R]],
        *,
        also: Sequence[BatchCall] = (),
        raise_on_error: bool = True,
    ) -> list[_R | Exception]:
        """Run ``calls`` together (one pipeline on a standalone Redis, concurrent calls on a
        Cluster) after the plain commands ``also`` (whose replies are dropped); the replies
        decoded, in order. ``raise_on_error=False``: a failed call's exception is its reply."""
        try:
            raw = await self._redis_batch([*also, *calls], raise_on_error=raise_on_error)
        except ResponseError as exc:
            if unavailable_reply(exc):  # an outage, as for a single call
                raise ServerUnavailable(str(exc)) from exc
            raise
        return [
            r if isinstance(r, Exception) else c.decode(r)
            for c, r in zip(calls, raw[len(also) :], strict=True)
        ]

    async def _redis_batch(
        self, calls: Sequence[BatchCall], *, raise_on_error: bool, pipelined: bool = False
    ) -> list[Any]:
        """:meth:`RedisMode.batch`, with the calls that found their function missing (Redis
        restarted empty mid-pipeline, say: they ran nothing) sent again once after the library
        is loaded. ``raise_on_error``: the first failed call's exception raises."""
        raw = await self.redis.batch(calls, raise_on_error=False, pipelined=pipelined)
        missing = [i for i, r in enumerate(raw) if function_missing(r)]
        if missing:
            await self._loader.load()
            again = await self.redis.batch(
                [calls[i] for i in missing], raise_on_error=False, pipelined=pipelined
            )
            for i, r in zip(missing, again, strict=True):
                raw[i] = r
        if raise_on_error:
            for r in raw:
                if isinstance(r, BaseException):
                    raise r
        return raw

    async def translate(self, exc: ResponseError, keys: GateKeys) -> Exception:
        """The error to raise for a Redis error reply to a script of gate ``keys``.

        A reply that means the server cannot serve writes now (OOM, READONLY, ...) becomes
        :class:`ServerUnavailable`, an outage; a command the Redis user may not run becomes a
        :class:`ConfigError`; anything else (WRONGTYPE, say) a :class:`GateStateError` naming
        the gate and the keys of the wrong type, found by one TYPE per key (only on this path).
        """
        if unavailable_reply(exc):
            return ServerUnavailable(str(exc))
        if isinstance(exc, NoScriptError):
            return exc
        text = str(exc)
        if "fleetgate schema:" in text:
            return ConfigError(f"gate {keys.name!r}: {text[text.index('fleetgate schema:') :]}")
        if isinstance(exc, NoPermissionError) or "can't run this command" in text:
            return ConfigError(
                f"gate {keys.name!r}: the Redis user may not run a command the gate scripts "
                f"need ({text}); see deploy/acl.conf"
            )
        wrong: list[str] = []
        try:
            for key, expected in keys.expected_types():
                kind = await self.client.type(key)
                if kind not in ("none", expected):
                    wrong.append(f"{key} ({kind}, expected {expected})")
        except Exception:  # the diagnosis is best effort; the error below stands
            wrong = []
        return GateStateError(keys.name, wrong, text)

    # -- one call per script: ARGV encoded, reply decoded ----------------------------------

    def _call(
        self, name: str, keys: GateKeys, args: list[Any], decode: Callable[[Any], _R]
    ) -> ScriptCall[_R]:
        return ScriptCall(self._scripts[name], keys, args, decode, self.redis.script_keys(keys))

    async def acquire(
        self, keys: GateKeys, lease_id: str, wait_ms: int, defaults: GateSettings
    ) -> AcquireReply:
        """One caller's acquire: :meth:`acquire_many` of one request."""
        return (await self.acquire_many(keys, [(lease_id, wait_ms)], defaults))[0]

    async def acquire_many(
        self,
        keys: GateKeys,
        requests: Sequence[AcquireRequest],
        defaults: GateSettings,
        *,
        releases: Sequence[str] = (),
        observed: Sequence[str | int] = (),
        fence_ms: int = 0,
    ) -> list[AcquireReply]:
        """One acquire call for several callers of one gate, each ``(lease id, wait_ms)`` or
        ``(lease id, wait_ms, class)`` (:func:`fleetgate.admission.lane_class`; the weight is in
        the id, :func:`fleetgate.admission.weighted_id`): granted, parked or refused in order,
        as if they had asked one after the other, after ``releases`` (lease ids) were released
        and ``observed`` (their reports, :func:`fleetgate.observed.tally`) counted.
        At most :data:`MAX_BATCH` of each.

        ``fence_ms``: if the gate has no state (a new gate, or Redis lost it), no grant is made
        for that long, so pods whose work the lost state counted can count it again first
        (``lua/lib_fence.lua`` gate_birth; 0: no fence)."""
        args = acquire_argv(defaults, requests, releases, observed, fence_ms)
        return await self._run(self._call("acquire", keys, args, AcquireReply.decode_many))

    async def release(self, keys: GateKeys, lease_id: str) -> bool:
        """Whether ``lease_id`` held a lease (it is released, its slot handed on)."""
        return await self.release_many(keys, [lease_id]) == 1

    async def release_many(
        self, keys: GateKeys, lease_ids: Sequence[str], observed: Sequence[str | int] = ()
    ) -> int:
        """Release several leases of one gate in one call (at most :data:`MAX_BATCH`) and count
        their reports (``observed``: :func:`fleetgate.observed.tally`); returns how many of
        them held a lease."""
        args = release_argv(lease_ids, observed)
        return await self._run(self._call("release", keys, args, int))

    async def resize(self, keys: GateKeys, lease_id: str, tokens: int) -> ResizeReply:
        """``resize.lua``: make lease ``lease_id`` hold ``tokens`` (its id changes with them)."""
        return await self._run(self._call("resize", keys, [lease_id, tokens], ResizeReply.decode))

    async def cancel(self, keys: GateKeys, lease_id: str, member: str = "") -> int:
        """Leave the wait list (``member``: the waiter member it parked as, if it parked) or
        release ``lease_id``: 1 = left the wait list, 2 = the grant raced in and was released,
        0 = unknown id."""
        return await self._run(self._call("cancel", keys, cancel_argv(lease_id, member), first_int))

    async def heartbeat(
        self,
        keys: GateKeys,
        pod_id: str,
        pod_ttl_ms: int,
        leases: list[tuple[str, int]],
        waiters: list[tuple[str, int]],
        *,
        max_token: int = 0,
        defaults: GateSettings | None = None,
        fence_ms: int = 0,
    ) -> HeartbeatReply:
        """Renew ``leases`` ((id, server-ms expiry last seen)) and ``waiters`` ((waiter member,
        remaining deadline ms)) of pod ``pod_id``; an empty pod id only sweeps the gate.
        ``fence_ms`` as for :meth:`acquire_many`; ``defaults`` are registered on a gate without
        configuration, as an acquire registers them."""
        req = HeartbeatRequest(
            keys, pod_id, pod_ttl_ms, leases, waiters, max_token, defaults, fence_ms
        )
        return await self._run(self._heartbeat_call(req, HeartbeatReply.decode))

    def _heartbeat_call(self, req: HeartbeatRequest, decode: Callable[[Any], _R]) -> ScriptCall[_R]:
        """heartbeat.lua for one gate's request."""
        return self._call("heartbeat", req.keys, req.argv(), decode)

    async def heartbeats(
        self, requests: Sequence[HeartbeatRequest], *, units: int = HEARTBEAT_UNITS_PER_CALL
    ) -> list[HeartbeatReply | Exception]:
        """The heartbeats of several gates, in few script calls and round trips: the gates are
        grouped by slot (:meth:`RedisMode.slot_group`: all of them on a standalone Redis), each
        group sent as ``heartbeat_many.lua`` calls of at most ``units``
        (:data:`HEARTBEAT_UNITS_PER_CALL`; a group of one as a plain ``heartbeat.lua``). The
        calls go in rounds, one after the other (:func:`heartbeat_rounds`): each round one
        pipeline per node (:meth:`RedisMode.node_group`) of at most ``units``, so Redis serves
        other clients between them (a pipeline's scripts run back to back). Standalone: one
        call per round. Cluster: one round trip per node per round, the node's gates' calls
        pipelined (before, one concurrent call per gate: a round trip and a connection each).

        A gate with more than :data:`IDS_PER_CALL` leases and waiters is renewed in several
        calls, in order (:meth:`HeartbeatRequest.parts`), their replies merged
        (:meth:`HeartbeatReply.merge`): no call exceeds :data:`~fleetgate._redis.MAX_ARGS`.

        Returns one reply per request, in order: the decoded reply, or the exception of that
        gate's call (a gate error such as WRONGTYPE as :meth:`translate` gives it; a failed
        multi-gate call is sent again gate by gate, so one broken gate never stops the others'
        renewals). An outage (connection error, an OOM/READONLY/... reply) raises.
        """
        split = [req.parts() for req in requests]
        if all(len(p) == 1 for p in split):  # the usual case: no gate holds that many ids
            return await self._heartbeat_parts(requests, units)
        replies = iter(await self._heartbeat_parts([p for ps in split for p in ps], units))
        out: list[HeartbeatReply | Exception] = []
        for ps in split:
            mine = [next(replies) for _ in ps]
            failed = [r for r in mine if isinstance(r, Exception)]
            ok = [r for r in mine if isinstance(r, HeartbeatReply)]
            out.append(failed[0] if failed else HeartbeatReply.merge(ok))
        return out

    async def _heartbeat_parts(
        self, requests: Sequence[HeartbeatRequest], units: int = HEARTBEAT_UNITS_PER_CALL
    ) -> list[HeartbeatReply | Exception]:
        """:meth:`heartbeats` of requests within :data:`IDS_PER_CALL` each."""
        slots = [self.redis.slot_group(req.keys.base) for req in requests]
        singles, many = heartbeat_chunks(slots, [r.units() for r in requests], units)
        chunks = singles + many
        calls: list[BatchCall] = [
            self._heartbeat_call(requests[c[0]], as_is)
            if len(c) == 1
            else ManyHeartbeats(
                self._scripts["heartbeat_many"], [requests[i] for i in c], self.redis
            )
            for c in chunks
        ]
        nodes = [self.redis.node_group(requests[c[0]].keys.base) for c in chunks]
        costs = [sum(requests[i].units() for i in c) for c in chunks]
        raw: list[Any] = [None] * len(chunks)
        for round_ in heartbeat_rounds(nodes, costs, units):
            replies = await self._batch_raw([calls[k] for k in round_], pipelined=True)
            for k, reply in zip(round_, replies, strict=True):
                raw[k] = reply
        out: list[HeartbeatReply | Exception | None] = [None] * len(requests)
        retry: list[int] = []
        for chunk, reply in zip(chunks, raw, strict=True):
            if isinstance(reply, Exception) and len(chunk) > 1:
                retry += chunk
            elif len(chunk) == 1:
                out[chunk[0]] = await self._heartbeat_result(reply, requests[chunk[0]].keys)
            else:
                for i, r in zip(chunk, reply, strict=True):
                    out[i] = HeartbeatReply.decode(r)
        if retry:
            one_by_one: list[BatchCall] = [self._heartbeat_call(requests[i], as_is) for i in retry]
            for i, reply in zip(retry, await self._batch_raw(one_by_one), strict=True):
                out[i] = await self._heartbeat_result(reply, requests[i].keys)
        return [r if r is not None else RuntimeError("no reply") for r in out]

    async def _heartbeat_result(self, reply: Any, keys: GateKeys) -> HeartbeatReply | Exception:
        """One gate's heartbeat.lua reply decoded, or its failure as :meth:`translate` gives it."""
        if isinstance(reply, Exception):
            return await self._gate_error(reply, keys)
        return HeartbeatReply.decode(reply)

    async def _batch_raw(self, calls: Sequence[BatchCall], *, pipelined: bool = False) -> list[Any]:
        """``calls`` as one batch (``pipelined``: see :meth:`RedisMode.batch`); a failed call's
        exception is its reply; an outage raises."""
        try:
            raw = await self._redis_batch(calls, raise_on_error=False, pipelined=pipelined)
        except ResponseError as exc:  # the library could not be loaded
            if unavailable_reply(exc):
                raise ServerUnavailable(str(exc)) from exc
            raise
        for r in raw:
            if isinstance(r, ResponseError) and unavailable_reply(r):
                raise ServerUnavailable(str(r)) from r
            if isinstance(r, BaseException) and not isinstance(r, ResponseError):
                raise r  # Cluster: a connection error of one concurrent call
        return raw

    async def _gate_error(self, exc: Exception, keys: GateKeys) -> Exception:
        return await self.translate(exc, keys) if isinstance(exc, ResponseError) else exc

    def sweep_call(self, keys: GateKeys) -> ScriptCall[Any]:
        """A heartbeat without a pod: renews nothing, only reaps and hands off (the reaper)."""
        return self._call("heartbeat", keys, sweep_argv(), HeartbeatReply.decode)

    async def set_target(self, keys: GateKeys, value: int, epoch: int, ttl_ms: int) -> bool:
        """The epoch-fenced write of a gate's target (``set_target.lua``), new room handed to the
        head waiters; False = refused (a newer epoch owns the gate)."""
        args = set_target_argv(value, epoch, ttl_ms)
        return await self._run(self._call("set_target", keys, args, accepted))

    def publish_call(
        self,
        keys: GateKeys,
        epoch: int,
        ttl_ms: int,
        target: int | None,
        cfg: Mapping[str, Any],
        util: Mapping[str, Any],
    ) -> ScriptCall[bool]:
        """The coordinator's epoch-fenced write of one gate (``publish.lua``): target None leaves
        the target's value alone; the reply False = refused (a newer epoch owns the gate)."""
        args = publish_argv(epoch, ttl_ms, target, cfg, util)
        return self._call("publish", keys, args, accepted)

    async def publish(
        self,
        keys: GateKeys,
        epoch: int,
        ttl_ms: int,
        target: int | None,
        cfg: Mapping[str, Any],
        util: Mapping[str, Any],
    ) -> bool:
        """:meth:`publish_call`, alone."""
        return await self._run(self.publish_call(keys, epoch, ttl_ms, target, cfg, util))

    def prune_call(self, keys: GateKeys, epoch: int, idle_after_ms: int) -> ScriptCall[int]:
        """``prune.lua``: the reply is PRUNED, IDLE, IN_USE or PRUNE_REFUSED."""
        return self._call("prune", keys, prune_argv(epoch, idle_after_ms), first_int)

    async def adopt(
        self,
        keys: GateKeys,
        local_ids: Sequence[str],
        leases: Sequence[tuple[str, int]],
        max_token: int = 0,
        fence_ms: int = 0,
    ) -> AdoptReply:
        """After an outage, count ``local_ids`` (permits granted under the fallback) as leases
        and keep counting ``leases`` ((id, server-ms expiry last seen): running fleet work),
        except those that lapsed (``adopt.lua``); raise the gate's token counter above
        ``max_token``; ``fence_ms`` as for :meth:`acquire_many`. More than
        :data:`IDS_PER_CALL` of either go in several calls, in order: the reply sums them (its
        expiry is the first call's)."""
        parts: list[tuple[Sequence[str], Sequence[tuple[str, int]]]] = [
            *((ids, ()) for ids in in_chunks(local_ids, IDS_PER_CALL)),
            *(((), pairs) for pairs in in_chunks(leases, IDS_PER_CALL)),
        ] or [((), ())]
        replies = [
            await self._run(
                self._call(
                    "adopt", keys, adopt_argv(ids, pairs, max_token, fence_ms), AdoptReply.decode
                )
            )
            for ids, pairs in parts
        ]
        return AdoptReply(
            sum(r.added for r in replies),
            replies[0].expires_at,
            [i for r in replies for i in r.lapsed],
        )

    async def snapshot(
        self, keys: GateKeys, listed: int = 10, defaults: GateSettings | None = None
    ) -> Snapshot:
        """A consistent snapshot of a gate (``inspect.lua``) listing its first ``listed``
        waiters and holders (``<= 0``: none; at most 1000): the counts are exact, and the cost
        never grows with the queue. ``defaults``: what an acquire would register for a gate
        without configuration."""
        args = inspect_argv(listed, defaults)
        return await self._run(self._call("inspect", keys, args, decode_snapshot))
