"""The gate scripts' ARGV, encoded in one place: one function (or request type) per script,
in the order its header in ``lua/`` lists the values, and the bounds of a batch."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fleetgate.keys import GateKeys
from fleetgate.settings import GateSettings

# Requests per acquire_many / release_many call: the script's variadic commands take 2 values per
# id, well inside Lua's unpack limit (~8,000), and one call stays short for other clients. It
# also keeps a call within MAX_ARGS (3,999 arguments, fleetgate._redis.limits): at most 3 per
# request, 1 per release and 8 per released report (fleetgate.observed.tally: 4 fields per
# tenant and class at most, 2 arguments each), ~2,400 for a full batch (tests/core/
# test_argument_bound.py sends the worst).
MAX_BATCH = 256
# Leases and waiters of one gate per heartbeat.lua or adopt.lua call (2 arguments each in a
# heartbeat, 1 in an adoption): a pod holding more is renewed (adopted) in several calls, in
# order, so that no call exceeds MAX_ARGS (~3,060 arguments with the rest of a heartbeat's and
# its 17 keys on Cluster) nor Lua's unpack limit.
IDS_PER_CALL = 1500
# What one heartbeat_many call may carry, in units of about 30 µs of server time: an idle gate
# (nothing to renew: reap, register the pod, count) is 1, a gate with leases or waiters 2 plus
# one per 4 ids (measured: ~30 µs per idle gate, ~70 µs per gate holding one lease;
# benchmarks/pod_cost.py). 40 units keep a call near a millisecond, so another client's call
# (a release, a hand-off) never waits long behind a pod's heartbeat.
HEARTBEAT_UNITS_PER_CALL = 40

#: One acquire request: ``(lease id, wait_ms)`` or ``(lease id, wait_ms, class)``.
AcquireRequest = tuple[str, int] | tuple[str, int, str]


def check_batch(n: int, least: int = 1) -> None:
    """Raise ValueError unless a batch of ``n`` ids is within ``least`` .. :data:`MAX_BATCH`."""
    if not least <= n <= MAX_BATCH:
        raise ValueError(f"a batch holds {least} to {MAX_BATCH} ids, not {n}")


@functools.lru_cache(maxsize=4096)
def _encoded_settings(defaults: GateSettings) -> tuple[bytes, ...]:
    """A gate's default settings as script ARGV, encoded once (they go with every acquire)."""
    return tuple(str(v).encode() for v in defaults.argv())


def acquire_argv(
    defaults: GateSettings,
    requests: Sequence[AcquireRequest],
    releases: Sequence[str],
    observed: Sequence[str | int],
    fence_ms: int,
) -> list[Any]:
    """acquire.lua's ARGV (see :meth:`GateScripts.acquire_many`); checks the batch bounds."""
    check_batch(len(requests))
    check_batch(len(releases), least=0)
    args: list[Any] = [*_encoded_settings(defaults), fence_ms, len(releases), *releases]
    args += (len(observed), *observed)
    for req in requests:
        args += (req[0], max(1, req[1]), req[2] if len(req) > 2 else "")
    return args


def release_argv(lease_ids: Sequence[str], observed: Sequence[str | int]) -> list[Any]:
    """release.lua's ARGV; checks the batch bound."""
    check_batch(len(lease_ids))
    return [len(observed), *observed, *lease_ids]


def cancel_argv(lease_id: str, member: str) -> list[Any]:
    """cancel.lua's ARGV (member '': the caller never parked)."""
    return [lease_id, member]


def set_target_argv(value: int, epoch: int, ttl_ms: int) -> list[Any]:
    """set_target.lua's ARGV."""
    return [value, epoch, ttl_ms]


def publish_argv(
    epoch: int,
    ttl_ms: int,
    target: int | None,
    cfg: Mapping[str, Any],
    util: Mapping[str, Any],
) -> list[Any]:
    """publish.lua's ARGV: target None is sent as '' (the target's value left alone)."""
    args: list[Any] = [epoch, ttl_ms, "" if target is None else target, len(cfg)]
    for pairs in (cfg, util):
        for k, v in pairs.items():
            args += [k, v]
    return args


def prune_argv(epoch: int, idle_after_ms: int) -> list[Any]:
    """prune.lua's ARGV."""
    return [epoch, idle_after_ms]


def adopt_argv(
    local_ids: Sequence[str],
    leases: Sequence[tuple[str, int]],
    max_token: int,
    fence_ms: int,
) -> list[Any]:
    """adopt.lua's ARGV: the local ids, then the fleet leases as (id, server-ms expiry last
    seen) pairs."""
    return [fence_ms, max_token, len(local_ids), *local_ids, *(x for pair in leases for x in pair)]


def inspect_argv(listed: int, defaults: GateSettings | None) -> list[Any]:
    """inspect.lua's ARGV."""
    return [listed, *(defaults.argv() if defaults else [])]


def sweep_argv() -> list[Any]:
    """heartbeat.lua's ARGV without a pod: renews nothing, only reaps and hands off."""
    return ["", 0, 0, 0, 0]


@dataclass(frozen=True)
class HeartbeatRequest:
    """One gate's heartbeat, as :meth:`GateScripts.heartbeat` takes it (for
    :meth:`GateScripts.heartbeats`)."""

    keys: GateKeys
    pod_id: str
    pod_ttl_ms: int
    leases: list[tuple[str, int]]
    waiters: list[tuple[str, int]]
    max_token: int = 0
    defaults: GateSettings | None = None
    #: the recovery fence this pod sets on a gate it finds without state (see
    #: :meth:`GateScripts.acquire_many`); 0 sets none
    fence_ms: int = 0

    def argv(self) -> list[Any]:
        """heartbeat.lua's ARGV."""
        args: list[Any] = [self.pod_id, self.pod_ttl_ms, len(self.leases)]
        for lid, expires_at in self.leases:
            args += [lid, expires_at]
        args.append(len(self.waiters))
        for wid, remaining_ms in self.waiters:
            args += [wid, max(1, remaining_ms)]
        args += [self.max_token, self.fence_ms]
        if self.defaults is not None:
            args += self.defaults.argv()
        return args

    def parts(self, ids: int = IDS_PER_CALL) -> list[HeartbeatRequest]:
        """This heartbeat as calls of at most ``ids`` leases and waiters each, in order (the
        leases first, newest first as sent: revocation marks a pod's newest leases first)."""
        if len(self.leases) + len(self.waiters) <= ids:
            return [self]
        items = [(True, x) for x in self.leases] + [(False, x) for x in self.waiters]
        return [
            dataclasses.replace(
                self,
                leases=[x for lease, x in items[i : i + ids] if lease],
                waiters=[x for lease, x in items[i : i + ids] if not lease],
            )
            for i in range(0, len(items), ids)
        ]

    def units(self) -> int:
        """This gate's share of one heartbeat_many call (see HEARTBEAT_UNITS_PER_CALL)."""
        ids = len(self.leases) + len(self.waiters)
        return 1 if ids == 0 else 2 + ids // 4


def heartbeat_many_argv(requests: Sequence[HeartbeatRequest]) -> list[Any]:
    """heartbeat_many.lua's ARGV: the number of gates, then each gate's heartbeat.lua ARGV
    after its length."""
    args: list[Any] = [len(requests)]
    for req in requests:
        argv = req.argv()
        args += [len(argv), *argv]
    return args
