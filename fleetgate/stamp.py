"""``fleetgate init``: stamp a new key prefix, so that its first permits skip the recovery fence.

Inside Redis a new prefix and a wiped one look the same: no state. So the first client script
that finds a gate without state fences it for one registration period (``lua/lib_fence.lua``
gate_birth: ~3 s by default), in case pods still run work the lost state counted. On a
standalone Redis (and Sentinel) the scripts read one node key, ``<prefix>:born``: the server
time this server first held state under the prefix, and a gate born a fence period after it is
new, not wiped. The stamp is that key set to ``0`` ("held state since the epoch"): every gate
first met under the prefix is then taken as new and granted at once. Any wipe that could have
lost running work (``FLUSHALL``/``FLUSHDB``, a restart without persistence, a failover to an
empty replica) removes the key with the state, so the next first script fences as before. The
decision stays inside the gate's script, atomic with the grant: a client that read the stamp
and sent ``fence_ms`` 0 would race a wipe between its read and its acquire.

On Cluster a gate's script reaches only its own slot, never the node key: there the stamp is
per gate, the gate's cfg field ``fence`` = ``0`` ("born, no fence"), in its slot and on its
node, lost with that node's keys. The gates must be named (``--gate``).

The stamp is a statement that no work runs under the prefix, so it is written only where the
prefix shows no use: a prefix already stamped is left as it is (a no-op), a prefix holding
fleetgate's keys (the registry, the leader's, a birth mark, a named gate's) is refused (a Redis
that lost its state and was written to again since -- by a coordinator, a pod -- looks like that
too, and stamping it would lift the fence that protects the work still running). See
docs/failure-modes.md ("The first permit").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from fleetgate._redis import RedisMode, connect, prepare
from fleetgate.keys import GateKeys, fleet_keys, validate_prefix

__all__ = ["InitOutcome", "init_prefix", "stamp_prefix"]

#: the stamp's value of ``<prefix>:born``: older than any fence (the scripts compare it with
#: the server time minus fence_ms)
STAMP = "0"
#: how many of the keys found under a prefix in use an outcome names
_SHOWN = 3

InitResult = Literal["stamped", "already", "in_use", "needs_gates"]


@dataclass(frozen=True)
class InitOutcome:
    """What :func:`init_prefix` did.

    ``result``: ``"stamped"`` (the prefix was new and is stamped now), ``"already"`` (it was
    stamped before: nothing written), ``"in_use"`` (it holds other keys, named in ``found``:
    refused, nothing written) or ``"needs_gates"`` (Redis Cluster without gate names: nothing
    written). ``gates``: the gates stamped (Cluster, or named anyway).
    """

    result: InitResult
    prefix: str
    cluster: bool
    gates: tuple[str, ...] = ()
    found: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """The prefix is stamped (now or before)."""
        return self.result in ("stamped", "already")

    def message(self) -> str:
        """One paragraph for an operator: what was done and why."""
        p = self.prefix
        if self.result == "stamped":
            if self.cluster:
                return (
                    f"prefix {p!r} is new: stamped gates {', '.join(self.gates)} (Cluster: "
                    f"one stamp per gate, in its slot); their first permits skip the recovery "
                    f"fence. Other gates pay it once each; a wipe of a node fences its gates again."
                )
            also = f" and gates {', '.join(self.gates)}" if self.gates else ""
            return (
                f"prefix {p!r} is new: stamped ({fleet_keys(p).born} = {STAMP}{also}); the "
                f"first permits of its gates skip the recovery fence. A wipe (FLUSHALL, a "
                f"restart without persistence) removes the stamp, and the fence holds again."
            )
        if self.result == "already":
            return f"prefix {p!r} is already stamped: nothing to do."
        if self.result == "needs_gates":
            return (
                f"prefix {p!r}: on Redis Cluster a gate's script reaches only its own slot, "
                f"so the stamp is per gate: name the gates (--gate NAME, repeated). Nothing "
                f"was written."
            )
        keys = ", ".join(self.found)
        return (
            f"prefix {p!r} is not new (it holds {keys}): not stamped. init is for a prefix "
            f"nothing has used yet; a Redis that lost its state and was written to since looks "
            f"like this too, and the recovery fence is what protects the work still running "
            f"then. Use a new prefix, or leave it: on a standalone Redis only the gates first "
            f"met within one fence period of the prefix's first use are fenced."
        )


async def init_prefix(
    url: str | None = None, prefix: str | None = None, *, gates: Sequence[str] = ()
) -> InitOutcome:
    """Stamp ``prefix`` on the Redis at ``url`` as deliberately new (see the module's text).

    url and prefix left out (None): ``$FLEETGATE_REDIS_URL`` and ``$FLEETGATE_PREFIX``, else
    ``redis://127.0.0.1:6379/0`` and ``fg``, as for ``Fleet()``. ``gates``: the gates to stamp
    one by one (required on Redis Cluster; on a standalone Redis the prefix stamp covers
    every gate). Run it once, before any pod or coordinator uses the prefix: it refuses a
    prefix in use (``result == "in_use"``) and leaves a stamped one as it is.
    """
    from fleetgate.configfile import redis_from_env

    url, prefix = redis_from_env(url, prefix)
    client = connect(url)
    try:
        await prepare(client)
        return await stamp_prefix(client, prefix, gates=gates)
    finally:
        await client.aclose()


async def stamp_prefix(client: Any, prefix: str, *, gates: Sequence[str] = ()) -> InitOutcome:
    """:func:`init_prefix` on a client already connected (any mode)."""
    prefix = validate_prefix(prefix)
    named = tuple(GateKeys.of(prefix, name) for name in gates)  # names checked before any I/O
    mode = RedisMode(client)
    born = fleet_keys(prefix).born
    if await client.get(born) in (STAMP, STAMP.encode()):
        return InitOutcome("already", prefix, mode.cluster)
    found = await _state_found(client, prefix, named)
    if found:
        return InitOutcome("in_use", prefix, mode.cluster, found=found)
    if mode.cluster and not named:
        return InitOutcome("needs_gates", prefix, True)
    stamped = []
    for keys in named:
        # HSETNX: a pod that found the gate first (a race with init) keeps its own fence
        if await client.hsetnx(keys.cfg, "fence", STAMP):
            stamped.append(keys.name)
    if not await client.set(born, STAMP, nx=True):
        # written since it was read: a pod's first script (its server time)
        if await client.get(born) not in (STAMP, STAMP.encode()):
            return InitOutcome("in_use", prefix, mode.cluster, found=(born,))
    return InitOutcome("stamped", prefix, mode.cluster, gates=tuple(stamped))


async def _state_found(client: Any, prefix: str, gates: Sequence[GateKeys]) -> tuple[str, ...]:
    """The keys that say the prefix is in use: the fleet's own (written by every process that
    uses the prefix: a pod registers its gates in the registry at its first heartbeat, a fenced
    first script marks ``born``, a coordinator takes ``leader``) and any key of a named gate.
    Read by key (one slot per call on Cluster), never by SCAN, which the coordinator's ACL
    rule does not grant (it would list every key of the server)."""
    fk = fleet_keys(prefix)
    found = [key for key in (fk.born, fk.gates, fk.leader, fk.epoch) if await client.exists(key)]
    for keys in gates:
        if await client.exists(*keys.data_keys()):
            found.append(f"{keys.base}:*")
    return tuple(found[:_SHOWN])
