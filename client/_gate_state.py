"""What one process knows of one gate, and how often the heartbeat must renew it.

:class:`GateState` is the bottom layer of a gate: its keys and settings, the leases, waiters and
local permits this process holds, the limit, live-pod count and TTLs last seen in Redis, and the
pacing the heartbeat reads (:attr:`~GateState.renewal_period`, :attr:`~GateState.beat_by`,
:meth:`~GateState.renewal`). The acquire machinery (``_acquire.py``) and the :class:`~._gate.Gate`
facade build on it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field

from fleetgate.admission import resized_id
from fleetgate.ask import DEFAULT_ASK, Ask
from fleetgate.keys import GateKeys
from fleetgate.scripts import HeartbeatReply
from fleetgate.settings import GateSettings, settings_differing

from ._deadline import Deadline
from ._lease import Lease
from ._local import LocalPermits
from ._metrics import GateMetrics
from ._runtime import OUTAGE_ERRORS, Runtime
from ._wakes import WakeListeners

__all__ = ["NO_DEADLINE_WAIT_MS", "GateState", "Renewal", "Waiter"]

log = logging.getLogger("fleetgate.client")

# Park "forever" when the caller gives no deadline; the waiter heartbeat still bounds how long a
# dead process' entry survives.
NO_DEADLINE_WAIT_MS = 24 * 3600 * 1000


@dataclass
class Waiter:
    """One acquire of this process between its request and its grant (or refusal)."""

    id: str
    #: set to the fencing token of the grant (or an exception)
    future: asyncio.Future[int]
    deadline: Deadline
    ask: Ask = DEFAULT_ASK
    #: its entry in Redis once parked ('<tenant>}<R>}<seq20>}<id>')
    member: str = ""
    parked_at: float = field(default_factory=time.monotonic)
    # Set once the acquire reply said "parked": only then does the heartbeat refresh it (before,
    # Redis may not have it yet and would report it lost).
    parked: bool = False
    # Server time (ms) the lease handed to this waiter expires at, when a heartbeat saw the grant.
    expires_at: int = 0
    # The wait (s) the gate expected when it parked (None: no estimate): the lease's expected_wait.
    expected_wait: float | None = None

    def remaining_ms(self) -> int:
        """The ms it may still wait (what the scripts keep its entry for)."""
        left = self.deadline.remaining()
        return NO_DEADLINE_WAIT_MS if left is None else max(1, int(left * 1000))


@dataclass(frozen=True)
class Renewal:
    """What one heartbeat of a gate renews: its leases (id, expiry last seen) and its parked
    waiters (waiter member, ms left of the caller's deadline), and the highest token it
    holds."""

    leases: list[tuple[str, int]]
    waiters: list[tuple[str, int]]
    max_token: int


class GateState:
    """One gate as this process knows it: what it holds and what it last saw in Redis."""

    def __init__(
        self,
        name: str,
        defaults: GateSettings,
        runtime: Runtime,
        wakes: WakeListeners,
        given: frozenset[str] = frozenset(),
    ) -> None:
        self.name = name
        self.defaults = defaults
        #: the settings the caller of Fleet.gate named (the rest are defaults): compared once
        #: with what Redis holds (check_settings)
        self.given = given
        self.settings_unchecked = bool(given)
        #: Redis has replied to an acquire of this gate (it is stored there)
        self.used = False
        self.runtime = runtime
        self.wakes = wakes
        self.keys = GateKeys.of(runtime.prefix, name)
        self.leases: dict[str, Lease] = {}
        self.waiters: dict[str, Waiter] = {}
        #: this gate's series of the client metrics
        self.series = GateMetrics(runtime.metrics, name, tenants=defaults.tenant_weights)
        self.last_limit = defaults.floor
        # The token budget in force as last seen (None: none), from every heartbeat reply.
        self.last_token_limit = defaults.token_limit
        # Live pods of this gate as last counted by a heartbeat this pod trusts (0: none yet,
        # the fair share is then 1): see _count_live_pods.
        self.last_live_pods = 0
        # When (loop time) the heartbeat that created this pod's live entry was sent.
        self.registered_at: float | None = None
        # TTLs in force in Redis (the coordinator's config may differ from our defaults), from
        # every acquire and heartbeat reply; the heartbeat is paced by them.
        self.ttl_ms = min(defaults.lease_ms, defaults.waiter_ms)
        # When (loop time) this gate's leases and waiters were last renewed (or, for a gate
        # that just got its first work, granted): the heartbeat paces the next renewal by it.
        self.renewed_at = 0.0
        # Loop time by which the heartbeat should beat this gate whatever its schedule (inf:
        # none): the end of a recovery fence its waiters park behind (see beat_after).
        self.beat_by = math.inf
        # Permits granted locally while Redis was unreachable (the fair-share fallback).
        self.local_leases: dict[str, Lease] = {}
        # Listed in the fleet's gate registry (`fg:gates`, for `fleetgate status`).
        self.in_registry = False
        # The local bound while Redis is unreachable: units (and tokens) by priority (see
        # _local.py).
        self._local = LocalPermits(
            self.fair_share,
            in_use=self._fleet_units,
            token_budget=self.token_share,
            tokens_in_use=self._fleet_tokens,
            allowed=lambda: not runtime.recovering,
            active=lambda: runtime.fallback_active,
            gate=name,
        )

    @property
    def busy(self) -> bool:
        """Whether this process holds leases or waiters of the gate (they need renewing)."""
        return bool(self.leases or self.waiters)

    @property
    def renewal_period(self) -> float:
        """Seconds between two heartbeats of the gate: with leases or waiters, at most a third
        of the TTLs in force; idle, the live-pod registration period."""
        if self.busy:
            return min(self.runtime.heartbeat_interval, self.ttl_ms / 3000)
        return self.runtime.register_period

    def renewal(self) -> Renewal:
        """What the next heartbeat of this gate renews."""
        # newest first (fencing tokens rise in grant order): a revocation takes those first
        held = sorted(self.leases.values(), key=lambda lease: lease.fencing_token, reverse=True)
        return Renewal(
            leases=[(lease.id, lease.expires_at) for lease in held],
            waiters=[
                (w.member, w.remaining_ms())
                for w in self.waiters.values()
                if w.parked and not w.future.done()
            ],
            max_token=max((lease.fencing_token for lease in held), default=0),
        )

    def beat_after(self, seconds: float) -> None:
        """Beat this gate ``seconds`` from now, even if it is not due: the gate's recovery
        fence ends then, and the heartbeat's script hands the free units to the waiters that
        parked behind it (else they would wait up to a renewal period longer)."""
        # a few ms after the fence's end in server time: a beat that came early hands nothing
        when = asyncio.get_running_loop().time() + seconds + 0.005
        if when < self.beat_by:
            if self.beat_by == math.inf:  # once per fence, not per caller
                log.info(
                    "gate %s: found without state in Redis (new, or Redis restarted or flushed);"
                    " no grant for %.2f s while pods count their running work again",
                    self.name,
                    seconds,
                )
            self.beat_by = when
            self.runtime.renew_by(when)

    def note_ttls(self, lease_ms: int, waiter_ms: int) -> None:
        """The TTLs in force in Redis; a shorter one re-paces the heartbeat at once."""
        ttl = min(lease_ms, waiter_ms)
        if ttl != self.ttl_ms:
            self.ttl_ms = ttl
            self.runtime.poke_heartbeat()

    def _count_live_pods(self, reply: HeartbeatReply, sent_at: float) -> None:
        # The live-pod count is trusted only from a heartbeat sent a full registration period
        # after this pod's entry was created: by then every live pod of the gate that started
        # about when this one did has registered too. Until then the fair share is 1, never
        # the whole limit (else 4 pods with limit 4 could run 16 at once:
        # tests/client/test_fallback.py::test_pods_starting_during_an_outage_take_one_permit_each).
        if reply.pod_new:
            if self.registered_at is not None:
                self.in_registry = False  # created anew: a wiped Redis? register the gate again
            self.registered_at = sent_at
            self.last_live_pods = 0
        elif (
            self.registered_at is not None
            and sent_at - self.registered_at >= self.runtime.register_period
        ):
            self.last_live_pods = reply.live_pods

    def fair_share(self) -> int:
        """Local bound in units while Redis is unreachable: ceil(last limit / live pods), with
        the live pods as last counted by a heartbeat this pod trusts; 1 while it has no such
        count (a pod that started, or fell back, before it could count its peers). Local
        permits and the fleet leases still running share it, each by its weight."""
        if self.last_live_pods <= 0:
            return 1
        return max(1, math.ceil(self.last_limit / self.last_live_pods))

    def token_share(self) -> int | None:
        """Local bound in tokens while Redis is unreachable (None: the gate has no token
        budget): ceil(last token budget / live pods), counted as :meth:`fair_share` counts
        units (1 while the live pods are not counted yet)."""
        if self.last_token_limit is None:
            return None
        if self.last_live_pods <= 0:
            return 1
        return max(1, math.ceil(self.last_token_limit / self.last_live_pods))

    def _fleet_units(self) -> int:
        """Units of the fleet leases this pod still holds (they count against the local bound)."""
        return sum(lease.weight for lease in self.leases.values())

    def _fleet_tokens(self) -> int:
        """Tokens of the fleet leases this pod still holds (likewise)."""
        return sum(lease.tokens for lease in self.leases.values())

    def _resize_local(self, lease: Lease, tokens: int) -> int:
        """A local permit's new tokens, under the local bound (see LocalPermits.resize): its
        id says them, as a fleet lease's does, so the adoption when Redis is back counts what
        it holds now."""
        if lease.id in self.local_leases and self._local.resize(lease.tokens, tokens):
            del self.local_leases[lease.id]
            lease._resized(resized_id(lease.id, tokens), tokens)
            self.local_leases[lease.id] = lease
        return lease.tokens

    def _release_local(self, lease: Lease) -> None:
        if self.local_leases.pop(lease.id, None) is not None:
            lease.series().drop(lease.weight)
            self._local.release(lease.weight, lease.tokens)

    async def wake_local(self) -> None:
        """Let callers waiting for a local permit look again (the mode or the bound changed)."""
        self._local.notify()

    async def check_settings(self) -> None:
        """Warn once when Redis holds other settings than the ones this process gave (the
        stored ones apply: the coordinator's config, or the first process to use the gate's).
        Run in the background after the gate's first acquire reply, when the gate is stored."""
        try:
            snap = await self.runtime.scripts.snapshot(self.keys, 0)
        except OUTAGE_ERRORS:
            self.settings_unchecked = True  # again after the next reply
            return
        except Exception as exc:
            self.runtime.background_error("settings check", exc, self.name)
            return
        differing = settings_differing(self.defaults, self.given, snap.cfg, snap.tenant_weights)
        if differing:
            shown = ", ".join(
                f"{k} {stored} (asked {asked})" for k, (stored, asked) in differing.items()
            )
            log.warning(
                "gate %r: Redis holds other settings than this process gave, and they apply: %s "
                "(set by the coordinator's config or the first process to use the gate; "
                "gate.snapshot().differing, `fleetgate inspect %s`)",
                self.name,
                shown,
                self.name,
            )
