"""A finding of the safety checks, and the Redis errors they read as "not allowed to look"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from redis.exceptions import NoPermissionError, ResponseError

__all__ = ["Finding", "Level", "denied", "is_wrongtype"]

#: error: fleetgate's guarantees do not hold as configured (``fleetgate check`` exits 1);
#: warning: a risk or something not checked; note: a difference that costs nothing (a refused
#: command fleetgate does without)
Level = Literal["error", "warning", "note"]


@dataclass(frozen=True)
class Finding:
    """One problem: ``error`` means fleetgate's guarantees do not hold as configured."""

    level: Level
    # version, eviction, unchecked, replica_role, replicas, wrong_type, bad_value, schema,
    # functions, evalsha, shard_pubsub, client, config, arguments (safety.capabilities)
    code: str
    message: str

    def __str__(self) -> str:
        return self.message


def is_wrongtype(exc: BaseException) -> bool:
    """True for Redis' ``WRONGTYPE`` error (a key of fleetgate's holds another type)."""
    return isinstance(exc, ResponseError) and "WRONGTYPE" in str(exc)  # also in pipelines


def denied(exc: ResponseError) -> bool:
    """ACL refusal, or a command renamed away / unknown (managed Redis)."""
    if isinstance(exc, NoPermissionError):  # redis-py strips the NOPERM prefix
        return True
    text = str(exc).upper()
    return "NOPERM" in text or "UNKNOWN COMMAND" in text or "UNKNOWN SUBCOMMAND" in text
