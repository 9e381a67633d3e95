"""The operator commands ``fleetgate status``, ``inspect`` and ``check``: core, read-only.

Each takes the Redis URL and key prefix already resolved (by :mod:`fleetgate.cli`, which may
read them from a coordinator config file) and returns the exit code. They use the core modules
only (:mod:`fleetgate.status`, :mod:`fleetgate.scripts`, :mod:`fleetgate.safety`), so an
operator's view of Redis never depends on the client or the coordinator.
"""

from __future__ import annotations

import asyncio
import sys
import time

import msgspec
from redis.exceptions import AuthenticationError, RedisError

from fleetgate._redis import REDIS_ERRORS, connect, error_text, prepare, redact, scrub
from fleetgate.errors import FleetgateError, RedisUnavailable
from fleetgate.keys import GateKeys
from fleetgate.registry import read_registry
from fleetgate.safety import capability_findings, find_bad_keys, server_findings, server_label
from fleetgate.scripts import GateScripts, Snapshot, Waiter
from fleetgate.status import TENANTS_SHOWN, format_status, gather_status, tenant_shown

__all__ = [
    "EXIT_ERROR",
    "EXIT_OK",
    "EXIT_USAGE",
    "check",
    "format_inspect",
    "inspect",
    "redis_failed",
    "status",
]

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2


def redis_failed(url: str, prefix: str, exc: BaseException) -> FleetgateError:
    """What an operator command says when Redis at ``url`` fails it: the URL (without its
    password) and the prefix, then the error -- :class:`RedisUnavailable` for an outage."""
    where = f"Redis at {redact(url)} (prefix {prefix!r})"
    why = scrub(error_text(exc), url)
    if isinstance(exc, REDIS_ERRORS) and not isinstance(exc, AuthenticationError):
        return RedisUnavailable(f"{where} is unreachable: {why}")
    return FleetgateError(f"{where} refused the command: {why}")


async def status(
    url: str, prefix: str, *, as_json: bool, watch: float | None, tenants: int = TENANTS_SHOWN
) -> int:
    """Print the leader, the epoch and one line per gate (or JSON); every ``watch`` seconds.
    ``tenants``: how many tenants to list per gate (the rest are summed as ``other``). Redis
    failing the read raises :func:`redis_failed`'s error, naming the URL."""
    client = connect(url)
    try:
        await prepare(client)
        while True:
            fleet = await gather_status(client, prefix, tenants=tenants)
            if as_json:
                sys.stdout.write(msgspec.json.encode(fleet).decode() + "\n")
            else:
                if watch:
                    sys.stdout.write("\x1b[2J\x1b[H")
                sys.stdout.write(format_status(fleet, time.time()) + "\n")
            sys.stdout.flush()
            if not watch:
                return EXIT_OK
            await asyncio.sleep(watch)
    except (RedisError, OSError) as exc:
        raise redis_failed(url, prefix, exc) from exc
    finally:
        await client.aclose()


async def inspect(url: str, prefix: str, gate: str, n: int, *, as_json: bool) -> int:
    """Print one gate: limit, units, counts, config, target, counters, its lanes in service
    order with their head waiters, and ``n`` holders. Exit 1, naming the registered gates,
    when Redis holds nothing of ``gate`` and the registry does not list it."""
    client = connect(url)
    try:
        snap = await GateScripts(client).snapshot(GateKeys.of(prefix, gate), n)
        known = None if _has_state(snap) else await read_registry(client, prefix)
    except (RedisError, OSError) as exc:
        raise redis_failed(url, prefix, exc) from exc
    finally:
        await client.aclose()
    if known is not None and gate not in known.names:
        # Nothing stored and not registered: a typo, or another prefix. Showing the defaults
        # would read as a gate of limit 1 that exists.
        names = ", ".join(known.names[:20]) + (" ..." if len(known.names) > 20 else "")
        print(
            f"fleetgate inspect: no gate {gate!r} under prefix {prefix!r} at {redact(url)} "
            f"(registered: {names or 'none'}; `fleetgate status` lists them)",
            file=sys.stderr,
        )
        return EXIT_ERROR
    if as_json:
        print(msgspec.json.encode(snap).decode())
        return EXIT_OK
    print(format_inspect(gate, snap))
    return EXIT_OK


def _has_state(snap: Snapshot) -> bool:
    """Whether Redis holds anything of the gate (a gate first used leaves its cfg)."""
    stored = snap.cfg or snap.target or snap.stats or snap.util
    return bool(stored or snap.holders or snap.queued)


def format_inspect(gate: str, snap: Snapshot) -> str:
    """``fleetgate inspect``'s text: the gate, then its lanes in the order they are served."""
    schema = snap.cfg.get("schema") or "-"
    out = [
        f"gate {gate}: limit {snap.limit} (floor {snap.floor}, ceiling {snap.ceiling}), "
        f"schema {schema}",
        f"  units held {snap.units}/{snap.limit} by {snap.holders} leases, "
        f"queued {snap.queued}/{snap.max_queued} (per tenant at most "
        f"{snap.max_queued_per_tenant}), live pods {snap.live_pods}",
        f"  shed_below {snap.shed_below}: a call of a lower priority never waits",
    ]
    if snap.tenant_weights:
        weights = " ".join(f"{t}={w}" for t, w in sorted(snap.tenant_weights.items()))
        out.append(f"  tenant weights {weights}")
    out += [
        f"  cfg    {snap.cfg}",
        f"  target {snap.target or '-'}",
        f"  stats  {snap.stats}",
    ]
    if snap.lanes:
        out.append("  lanes in service order (priority, tenant):")
    heads: dict[tuple[int, str], list[Waiter]] = {}
    for w in snap.head:
        heads.setdefault((w.priority, w.tenant), []).append(w)
    for lane in snap.lanes:
        if lane.oversize:
            order = "head heavier than the limit: waits for it to grow"
        else:
            order = f"tag {lane.tag}"
        reserved = f", units kept for {lane.reserved}" if lane.reserved else ""
        out.append(
            f"    p{lane.priority:<4} {tenant_shown(lane.tenant):<20} queued {lane.queued:<6} "
            f"{order}{reserved}"
        )
        for w in heads.get((lane.priority, lane.tenant), []):
            expires = f"{w.expires_at - snap.now} ms" if w.expires_at is not None else "-"
            out.append(
                f"      waiter {w.id}  weight {w.weight}  seq {w.token}  expires in {expires}"
            )
    listed = sum(lane.queued for lane in snap.lanes)
    if snap.queued > listed:
        out.append(f"    ... {snap.queued - listed} more waiting in lanes not listed (-n)")
    for h in snap.leases:
        out.append(f"  holder {h.id}  weight {h.weight}  expires in {h.expires_at - snap.now} ms")
    if snap.holders > len(snap.leases):
        out.append(f"  ... {snap.holders - len(snap.leases)} more holders (-n)")
    return "\n".join(out)


async def check(url: str, prefix: str) -> int:
    """Redis reachable, version >= 7.0, noeviction, a primary, the commands fleetgate sends
    allowed (:mod:`fleetgate.safety.capabilities`), fleetgate's keys intact.

    Exit 1 on any error-level finding (see :mod:`fleetgate.safety`); warnings (replicas
    attached, a setting that could not be read) and notes (a refused command fleetgate does
    without) are printed but keep exit code 0.
    """
    shown = redact(url)
    client = connect(url)
    try:
        await prepare(client)
        await client.ping()
        label = await server_label(client)
        findings = await server_findings(client)
        if not any(f.code == "replica_role" for f in findings):  # a replica refuses writes
            findings += await capability_findings(client, prefix)
        findings += await find_bad_keys(client, prefix)
    except Exception as exc:
        # Anything redis-py raises; its text never holds the password, and scrub() makes sure.
        print(
            f"fleetgate check: Redis at {shown} unusable: {scrub(str(exc), url)}", file=sys.stderr
        )
        return EXIT_ERROR
    finally:
        await client.aclose()
    for finding in findings:
        print(f"fleetgate check: {finding.level.upper()}: {finding.message}", file=sys.stderr)
    ok = not any(f.level == "error" for f in findings)
    print(f"{label} at {shown} (prefix {prefix!r}): {'ok' if ok else 'NOT OK'}")
    return EXIT_OK if ok else EXIT_ERROR
