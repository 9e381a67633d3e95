"""What the server lacks or refuses of the commands fleetgate sends: ``fleetgate check``'s
probes, each the command fleetgate itself sends, on a probe gate's keys (no gate's state is read
or written; the probe names sit in the gate key pattern, so a client ACL scoped to the prefix
allows them).

* Functions: the gate scripts are one Functions library (FUNCTION LOAD once, then FCALL). There
  is no EVAL fallback: without Functions (Redis < 7.0, a Valkey built without Lua, an ACL
  without ``+function|load`` or ``+fcall``) no permit can be taken. An error.
* EVALSHA: the coordinator's leadership scripts (SCRIPT LOAD, EVALSHA). Pods do not need it:
  a warning, since the same user may serve pods only.
* Sharded pub/sub (probed on Cluster only): there a pod hears its hand-offs by SSUBSCRIBE, the
  scripts send them by SPUBLISH (pcall). Refused, a hand-off waits in a list until the pod's
  next heartbeat (slower, never lost): a warning. A standalone Redis is not asked (its pods pop
  their wake lists; a refused SPUBLISH in a script falls back to the list).
* CLIENT: redis-py sends CLIENT SETINFO on connect and ignores a refusal (a note; Redis < 7.2
  lacks it: nothing); CLIENT SETNAME only for a URL's ``client_name``. fleetgate sends no other
  CLIENT command (it never reads CLIENT ID).
* CONFIG is not probed: it is read only where INFO lacks ``maxmemory_policy``, and
  :mod:`fleetgate.safety.server` names a refusal there.
* Arguments per command: fleetgate keeps every command within :data:`MAX_ARGS` (3,999;
  ElastiCache Serverless refuses more). A server that refuses a command of MAX_ARGS arguments
  is an error; one that refuses only beyond it (ElastiCache Serverless) a note.

No probe sends what fleetgate would not send as configured, so a least-privilege ACL
(deploy/acl.conf) logs no denial. Any error reply is a refusal (NOPERM, an unknown command, a
limit named) but an outage's (OOM, READONLY, LOADING, ...: they raise, as connection errors do).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from redis.exceptions import ResponseError

from fleetgate._redis import MAX_ARGS, RedisMode, unavailable_reply
from fleetgate.keys import GateKeys
from fleetgate.safety.findings import Finding, Level
from fleetgate.scripts import LeaderScripts, Loader

__all__ = ["PROBE_GATE", "capability_findings"]

#: The gate whose keys the probes name (never created: every probe only reads them).
PROBE_GATE = "fleetgate-check"


def _refusal(command: str, exc: ResponseError) -> str:
    text = str(exc)
    if "UNKNOWN" in text.upper() or "NOT FOUND" in text.upper():
        return f"the server lacks {command} ({text})"
    return f"the server refuses {command} ({text})"


async def _probe(
    run: Callable[[], Awaitable[Any]], level: Level, code: str, command: str, effect: str
) -> list[Finding]:
    """Run one probe of ``command``; a refusal (any error reply but an outage's) becomes a
    finding: how the server answered, then ``effect``."""
    try:
        await run()
    except ResponseError as exc:
        if unavailable_reply(exc):
            raise
        return [Finding(level, code, f"{_refusal(command, exc)}: {effect}")]
    return []


async def capability_findings(client: Any, prefix: str) -> list[Finding]:
    """Findings about the commands fleetgate sends that the server lacks or refuses (empty:
    it runs every one). A cluster client must be prepared (:func:`fleetgate._redis.prepare`)."""
    mode = RedisMode(client)
    keys = GateKeys.of(prefix, PROBE_GATE)
    loader = Loader(mode)
    inspect = loader.library.functions["inspect"]
    script_keys = mode.script_keys(keys)
    findings = await _probe(
        loader.load,
        "error",
        "functions",
        "FUNCTION LOAD",
        "fleetgate's gate scripts are a Functions library, loaded by every client: no permit "
        "can be taken (there is no EVAL fallback)",
    )
    if not findings:
        findings += await _probe(
            lambda: client.fcall(inspect, len(script_keys), *script_keys, 0),
            "error",
            "functions",
            "FCALL",
            "every gate script is called by FCALL: no permit can be taken",
        )
    findings += await _probe(
        lambda: LeaderScripts(client).renew(keys.base, PROBE_GATE, 1),
        "warning",
        "evalsha",
        "EVALSHA (or SCRIPT LOAD)",
        "the coordinator's leadership scripts need both: no coordinator can run as this user "
        "(pods need neither)",
    )
    if mode.cluster:
        findings += await _shard_findings(client, mode, keys)
    findings += await _client_findings(client)
    findings += await _argument_findings(client, keys)
    return findings


async def _shard_findings(client: Any, mode: RedisMode, keys: GateKeys) -> list[Finding]:
    """SPUBLISH (the scripts, pcall) and SSUBSCRIBE (a pod) on a probe channel (Cluster)."""
    channel = keys.wake(PROBE_GATE)
    level: Level = "warning"
    effect = "pods hear their hand-offs only at their next heartbeat (slower, never lost)"
    findings = await _probe(
        lambda: client.execute_command("SPUBLISH", channel, ""),
        level,
        "shard_pubsub",
        "SPUBLISH",
        f"sharded pub/sub sends the hand-offs on Cluster; {effect}",
    )
    findings += await _probe(
        lambda: _ssubscribe(client, mode, channel),
        level,
        "shard_pubsub",
        "SSUBSCRIBE",
        f"sharded pub/sub hears the hand-offs on Cluster; {effect}",
    )
    return findings


async def _client_findings(client: Any) -> list[Finding]:
    """CLIENT SETINFO, which redis-py sends on connect (Redis < 7.2 lacks it, as redis-py
    expects: no finding)."""
    try:
        await client.execute_command("CLIENT SETINFO", "LIB-NAME", "redis-py")
    except ResponseError as exc:
        if unavailable_reply(exc):
            raise
        if "UNKNOWN SUBCOMMAND" not in str(exc).upper():
            return [
                Finding(
                    "note",
                    "client",
                    f"{_refusal('CLIENT SETINFO', exc)}: redis-py sends it on connect and "
                    "ignores a refusal (harmless; +client|setinfo keeps ACL LOG clean)",
                )
            ]
    return []


async def _ssubscribe(client: Any, mode: RedisMode, channel: str) -> None:
    """SSUBSCRIBE and SUNSUBSCRIBE ``channel`` on a connection of their own, with the client's
    settings (on Cluster to the node serving the channel's slot), closed after."""
    if mode.cluster:
        node = client.get_node_from_key(channel)
        conn = node.connection_class(**node.connection_kwargs)
    else:
        pool = client.connection_pool
        conn = pool.connection_class(**pool.connection_kwargs)
    try:
        await conn.connect()
        await conn.send_command("SSUBSCRIBE", channel)
        # RESP2 or RESP3 (a URL's protocol=3): the confirmation may come as a push
        reply = await conn.read_response(timeout=5, push_request=True)
        if isinstance(reply, ResponseError):
            raise reply
        await conn.send_command("SUNSUBSCRIBE", channel)
        await conn.read_response(timeout=5, push_request=True)
    finally:
        await conn.disconnect()


async def _argument_findings(client: Any, keys: GateKeys) -> list[Finding]:
    """EXISTS of the probe gate's base key repeated: MAX_ARGS arguments, then one more."""

    async def exists(args: int) -> Any:
        return await client.exists(*[keys.base] * (args - 1))

    try:
        await exists(2)
    except ResponseError as exc:
        if unavailable_reply(exc):
            raise
        why = f"EXISTS, its probe, was refused: {exc}"
        return [Finding("warning", "unchecked", f"arguments per command not checked ({why})")]

    at_most = await _probe(
        lambda: exists(MAX_ARGS),
        "error",
        "arguments",
        f"a command of {MAX_ARGS:,} arguments",
        "fleetgate's largest commands (an acquire batch, a heartbeat, an adoption, a registry "
        "update) carry up to that many",
    )
    if at_most:
        return at_most
    return await _probe(
        lambda: exists(MAX_ARGS + 1),
        "note",
        "arguments",
        f"a command of {MAX_ARGS + 1:,} arguments",
        f"fleetgate sends none of more than {MAX_ARGS:,} (ElastiCache Serverless' bound)",
    )
