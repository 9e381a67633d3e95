"""Reading the gate registry ``{prefix}:gates`` so that one bad entry stops nothing.

The registry is a plain set anyone with the client ACL can ``SADD`` to. An entry that is no valid
gate name (braces, control characters, > 200 bytes, bytes that are not UTF-8) has no keys of its
own: it is skipped, and reported so that the caller can log it once. Reading the members
undecoded matters: with ``decode_responses`` one non-UTF-8 member would fail the whole reply.

Names are listed and dropped by :func:`register_calls` / :func:`register` and :func:`unregister`:
one SADD or SREM per :data:`~fleetgate._redis.MAX_ARGS` arguments, however many gates.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.client import NEVER_DECODE

from fleetgate._redis import MAX_ARGS, in_chunks
from fleetgate.errors import ConfigError
from fleetgate.keys import fleet_keys, validate_gate_name

__all__ = ["Registry", "read_registry", "register", "register_calls", "unregister"]

# gate names per SADD / SREM: the command and the key take two of MAX_ARGS
_NAMES_PER_COMMAND = MAX_ARGS - 2

_SHOWN_MAX = 80


@dataclass(frozen=True)
class Registry:
    """The valid gate names (sorted) and the skipped entries: ``(shown, why)`` each."""

    names: list[str] = field(default_factory=list)
    invalid: list[tuple[str, str]] = field(default_factory=list)


def _shown(entry: object) -> str:
    text = repr(entry)
    return text if len(text) <= _SHOWN_MAX else text[: _SHOWN_MAX - 3] + "..."


async def read_registry(client: Any, prefix: str) -> Registry:
    """Members of the registry of ``prefix``, valid names apart from invalid entries."""
    raw = await client.execute_command("SMEMBERS", fleet_keys(prefix).gates, **{NEVER_DECODE: True})
    names: list[str] = []
    invalid: list[tuple[str, str]] = []
    for entry in raw or ():
        try:
            name = entry.decode("utf-8") if isinstance(entry, bytes) else str(entry)
        except UnicodeDecodeError:
            invalid.append((_shown(entry), "not UTF-8 text"))
            continue
        try:
            names.append(validate_gate_name(name))
        except ConfigError as exc:
            invalid.append((_shown(name), str(exc)))
    return Registry(sorted(names), sorted(invalid))


def _sadd(key: str, names: Sequence[str], client: Any) -> Any:
    return client.sadd(key, *names)


def register_calls(prefix: str, names: Sequence[str]) -> list[Callable[[Any], Any]]:
    """The SADDs that list ``names`` in the registry of ``prefix``, as calls on a client or a
    pipeline (:data:`fleetgate._redis.BatchCall`), each within ``MAX_ARGS``."""
    key = fleet_keys(prefix).gates
    return [functools.partial(_sadd, key, chunk) for chunk in in_chunks(names, _NAMES_PER_COMMAND)]


async def register(client: Any, prefix: str, names: Sequence[str]) -> None:
    """List ``names`` in the registry of ``prefix`` (one SADD per ``MAX_ARGS``)."""
    for call in register_calls(prefix, names):
        await call(client)


async def unregister(client: Any, prefix: str, names: Sequence[str]) -> None:
    """Drop ``names`` from the registry of ``prefix`` (one SREM per ``MAX_ARGS``)."""
    key = fleet_keys(prefix).gates
    for chunk in in_chunks(names, _NAMES_PER_COMMAND):
        await client.srem(key, *chunk)
