"""Writing a poll's outcome to Redis: one pipeline per poll, every gate write epoch-fenced.

Each poll the leader registers the gates in the registry and, per gate, one ``publish.lua`` call
writes the gate's configuration (the coordinator's config wins over client defaults), the
utilisation snapshot with the controller state (from which a new leader resumes: warm failover)
and, when the controller says so, the target -- all refused when a newer epoch is stored in the
gate's target, so a deposed leader that wakes up overwrites nothing of its successor -- and hands
new room to waiters at once.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import msgspec

from fleetgate._redis import AnyRedis, BatchCall
from fleetgate.keys import GateKeys, fleet_keys
from fleetgate.registry import read_registry, register, register_calls, unregister
from fleetgate.scripts import PRUNED, GateScripts
from fleetgate.units import EXTRA_FIELD, TOKENS_FIELD, tokens_held, units_held
from fleetgate.util_hash import STATE_FIELD, TOKEN_STATE_FIELD, UtilHash

from .config import GateConfig
from .control import Observed, Outcome
from .scrape.signal_struct import Signals
from .token_tuning import TokenDecision, dump_token_state

__all__ = ["Publication", "Publisher"]

log = logging.getLogger("fleetgate.coordinator")


class Publication(msgspec.Struct, frozen=True):
    """What one poll decided for one gate."""

    gate: GateConfig
    decision: Outcome
    signals: Signals | None
    in_flight: int | None
    polled_at: float  # Redis server time, seconds
    #: the client-observed figures (None: the poll decided nothing, e.g. a held gate: the
    #: snapshot keeps the last ones)
    observed: Observed | None = None
    #: the URLs the poll read (detection may find another path than the configured one);
    #: empty: the gate's configured ``metrics_urls``
    metrics_urls: tuple[str, ...] = ()
    #: the token budget's decision (None: the gate's budget is not tuned)
    tokens: TokenDecision | None = None
    #: the tokens the fleet held at the poll (None: unknown, or not read)
    tokens_held: int | None = None

    def snapshot(self) -> UtilHash:
        """The gate's util snapshot after this poll."""
        s, d, o, t = self.signals, self.decision, self.observed, self.tokens
        outcomes = o.outcomes if o is not None else None
        latency = o is not None and o.latency_driven
        return UtilHash(
            kv_tokens=s.kv_tokens if s and t else None,
            tokens_held=self.tokens_held if t else None,
            token_target=t.budget if t else None,
            token_reason=t.reason.value if t else None,
            token_state=dump_token_state(t.state) if t else None,
            token_use_ratio=t.state.use_ratio if t else None,
            running=s.running if s else None,
            waiting_capacity=s.waiting_capacity if s else None,
            kv_cache_usage=s.kv_cache_usage if s else None,
            preemptions=s.preemptions if s else None,
            admission_rejections=s.admission_rejections if s else None,
            max_requests=s.max_requests if s else None,
            metrics_ok=s is not None and s.ok,
            metrics_url=",".join(self.metrics_urls or self.gate.metrics_urls) or None,
            server=s.server if s else None,
            error=s.error if s else None,
            current_target=d.target,
            floor=self.gate.floor,
            ceiling=self.gate.ceiling,
            reason=d.reason.value,
            saturated=bool(d.saturated),
            in_flight=self.in_flight,
            last_poll=self.polled_at,
            state=msgspec.json.encode(d.state).decode(),
            obs_calls=outcomes.calls if outcomes else None,
            obs_overloaded=outcomes.overloaded if outcomes else None,
            obs_timeout=outcomes.timeout if outcomes else None,
            signal="latency" if latency else None,
            latency_p50=o.p50 if o is not None and latency else None,
            latency_no_load=o.no_load if o is not None and latency else None,
        )


class Publisher:
    """Reads and writes the coordinator's keys for one prefix."""

    def __init__(self, client: AnyRedis, prefix: str) -> None:
        self.client = client
        self.prefix = prefix
        self.fleet = fleet_keys(prefix)
        self.scripts = GateScripts(client)
        self._keys: dict[str, GateKeys] = {}
        self._invalid_logged: set[str] = set()

    def keys(self, name: str) -> GateKeys:
        found = self._keys.get(name)
        if found is None:
            found = self._keys[name] = GateKeys.of(self.prefix, name)
        return found

    async def server_time(self) -> float:
        sec, usec = await self.client.time()
        return float(sec) + float(usec) / 1e6

    async def held(self, gates: Sequence[GateConfig]) -> dict[str, tuple[int, int]]:
        """Units and tokens held fleet-wide per gate, in one pipeline (a ``ZCARD`` of the holders
        and one ``HMGET`` of their counters: :func:`fleetgate.units.units_held`,
        :func:`~fleetgate.units.tokens_held`). Expired-but-unreaped leases count, as they do for
        the next grant."""
        if not gates:
            return {}
        pipe = self.client.pipeline(transaction=False)
        for g in gates:
            keys = self.keys(g.name)
            pipe.zcard(keys.holders)
            pipe.hmget(keys.adm, [EXTRA_FIELD, TOKENS_FIELD])
        replies = await pipe.execute()
        out: dict[str, tuple[int, int]] = {}
        for i, g in enumerate(gates):
            holders, (extra, tok) = int(replies[2 * i]), replies[2 * i + 1]
            out[g.name] = (units_held(holders, extra), tokens_held(holders, tok))
        return out

    async def stored_states(
        self, names: Sequence[str]
    ) -> dict[str, tuple[str | None, bool, str | None]]:
        """Per gate, the controller state the previous leader stored (None: none), whether
        its last published target has run out (absent, or expired by Redis' clock), and the
        token budget controller's stored state (None: none)."""
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pipe.hmget(self.keys(name).util, [STATE_FIELD, TOKEN_STATE_FIELD])
            pipe.hget(self.keys(name).target, "expires_at")
        raw = await pipe.execute()
        # after the reads (a target read live stays live until then); not in the pipeline:
        # redis-py refuses TIME in a Cluster pipeline
        sec, usec = await self.client.time()
        now_ms = int(sec) * 1000 + int(usec) // 1000
        out: dict[str, tuple[str | None, bool, str | None]] = {}
        for i, name in enumerate(names):
            (state, token_state), expires_at = raw[2 * i], raw[2 * i + 1]
            try:
                lapsed = expires_at is None or float(expires_at) <= now_ms
            except ValueError:
                lapsed = True
            out[name] = (state, lapsed, token_state)
        return out

    async def publish(
        self, epoch: int, target_ttl_ms: int, pubs: Sequence[Publication]
    ) -> list[bool]:
        """Register the gates, then write each gate's cfg, snapshot and target (one fenced
        ``publish.lua`` call per gate; one batch, see :meth:`GateScripts.batch`).

        Returns, per publication, whether it was accepted (False: a newer epoch owns the gate,
        so this coordinator has been deposed, and nothing of it was written). Publications whose
        decision says not to publish a target (static, unknown signals) still write the config
        and the snapshot, and leave the target's value alone.
        """
        names = [p.gate.name for p in pubs]
        calls = [
            self.scripts.publish_call(
                self.keys(p.gate.name), epoch, target_ttl_ms, *self._payload(p)
            )
            for p in pubs
        ]
        replies = await self.scripts.batch(calls, also=register_calls(self.prefix, names))
        return [bool(r) for r in replies]

    @staticmethod
    def _payload(p: Publication) -> tuple[int | None, dict[str, int | str], dict[str, str]]:
        target = p.decision.target if p.decision.publish else None
        cfg: dict[str, int | str] = p.gate.as_cfg()
        if p.tokens is not None and p.tokens.publish:
            cfg = {**cfg, "token_target": p.tokens.budget}  # the second target (publish.lua)
        return target, cfg, p.snapshot().encode(observed=p.observed is not None)

    async def registered_gates(self) -> list[str]:
        """The registered gate names, sorted. An entry that is no valid gate name (anyone may
        SADD to the registry) is skipped, and logged once per entry, not once per sweep."""
        registry = await read_registry(self.client, self.prefix)
        for shown, why in registry.invalid:
            if shown not in self._invalid_logged and len(self._invalid_logged) < 10_000:
                self._invalid_logged.add(shown)
                log.warning(
                    "%s holds an invalid gate name %s (%s): skipped by the reaper and status; "
                    "remove it with redis-cli SREM",
                    self.fleet.gates,
                    shown,
                    why,
                )
        return registry.names

    async def prune(
        self, epoch: int, names: Sequence[str], idle_after_ms: int
    ) -> tuple[list[str], list[tuple[str, Exception]]]:
        """Delete the gates of ``names`` idle for ``idle_after_ms`` and drop them from the
        registry (``prune.lua`` decides in the gate's slot; the SREM follows it). Returns the
        gates pruned and the gates whose check failed (a key of the wrong type, say).

        An acquire or heartbeat racing the prune recreates the gate's keys, and its SADD may come
        before our SREM: so after the SREM every pruned gate with keys again is registered again.
        """
        if not names:
            return [], []
        replies = await self.scripts.batch(
            [self.scripts.prune_call(self.keys(n), epoch, idle_after_ms) for n in names],
            raise_on_error=False,
        )
        pruned: list[str] = []
        failed: list[tuple[str, Exception]] = []
        for name, reply in zip(names, replies, strict=True):
            if isinstance(reply, Exception):
                failed.append((name, reply))
            elif reply == PRUNED:
                pruned.append(name)
        if not pruned:
            return [], failed
        await unregister(self.client, self.prefix, pruned)
        used = await self._exist(pruned)
        back = [n for n, found in zip(pruned, used, strict=True) if found]
        await register(self.client, self.prefix, back)
        return [n for n in pruned if n not in back], failed

    async def _exist(self, names: Sequence[str]) -> list[bool]:
        """Per gate: does any of the keys a client's acquire or heartbeat creates exist?"""

        def exists(name: str) -> BatchCall:
            k = self.keys(name)
            return lambda client: client.exists(k.cfg, k.holders, k.queue, k.waiters, k.pods)

        counts = await self.scripts.redis.batch([exists(n) for n in names])
        return [int(c) > 0 for c in counts]

    async def sweep(self, names: Sequence[str]) -> None:
        """Reap expired leases and waiters of ``names`` and move their queues (one batch)."""
        if not names:
            return
        await self.scripts.batch([self.scripts.sweep_call(self.keys(n)) for n in names])
