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

from fleetgate._redis import connect, prepare, redact, scrub
from fleetgate.keys import GateKeys
from fleetgate.safety import find_bad_keys, redis_version, server_findings
from fleetgate.scripts import GateScripts
from fleetgate.status import format_status, gather_status

__all__ = ["EXIT_ERROR", "EXIT_OK", "EXIT_USAGE", "check", "inspect", "status"]

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2


async def status(url: str, prefix: str, *, as_json: bool, watch: float | None) -> int:
    """Print the leader, the epoch and one line per gate (or JSON); every ``watch`` seconds."""
    client = connect(url)
    await prepare(client)
    try:
        while True:
            fleet = await gather_status(client, prefix)
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
    finally:
        await client.aclose()


async def inspect(url: str, prefix: str, gate: str, n: int, *, as_json: bool) -> int:
    """Print one gate: limit, counts, config, target, counters, ``n`` holders and waiters."""
    client = connect(url)
    try:
        snap = await GateScripts(client).snapshot(GateKeys.of(prefix, gate), n)
    finally:
        await client.aclose()
    if as_json:
        print(msgspec.json.encode(snap).decode())
        return EXIT_OK
    print(f"gate {gate}: limit {snap.limit} (floor {snap.floor}, ceiling {snap.ceiling})")
    print(
        f"  in-flight {snap.holders}, queued {snap.queued}/{snap.max_queued}, "
        f"live pods {snap.live_pods}"
    )
    print(f"  cfg    {snap.cfg}")
    print(f"  target {snap.target or '-'}")
    print(f"  stats  {snap.stats}")
    for h in snap.leases:
        print(f"  holder {h.id}  expires in {h.expires_at - snap.now} ms")
    for w in snap.head:
        print(f"  waiter {w.id}  seq {w.token}")
    return EXIT_OK


async def check(url: str, prefix: str) -> int:
    """Redis reachable, version >= 6.2, noeviction, a primary, fleetgate's keys intact.

    Exit 1 on any error-level finding (see :mod:`fleetgate.safety`); warnings (replicas
    attached, a setting that could not be read) are printed but keep exit code 0.
    """
    shown = redact(url)
    client = connect(url)
    try:
        await prepare(client)
        await client.ping()
        version = await redis_version(client)
        findings = await server_findings(client)
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
    print(f"redis {version or '?'} at {shown} (prefix {prefix!r}): {'ok' if ok else 'NOT OK'}")
    return EXIT_OK if ok else EXIT_ERROR
