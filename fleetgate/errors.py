"""The fleetgate exception tree.

    FleetgateError
     ├── Overloaded          the wait list is full; the work was never started (never retried)
     │    └── DeadlineUnreachable  it would start after its deadline (refused at once)
     ├── DeadlineExceeded    the total deadline fired (also a TimeoutError)
     ├── LeaseLost           a held lease could not be renewed and expired in Redis
     ├── LeaseRevoked        the gate asked for a held lease back (a higher band waited)
     ├── ConfigError         bad configuration or gate name (also a ValueError)
     ├── GateStateError      a gate's keys in Redis hold data its scripts cannot use
     └── RedisUnavailable    Redis unreachable: on_redis_error="fail", or a read (snapshot)

Redis errors are translated where they enter fleetgate (``raise ... from exc``) so callers only
need to catch these.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "DeadlineExceeded",
    "DeadlineUnreachable",
    "FleetgateError",
    "GateStateError",
    "LeaseLost",
    "LeaseRevoked",
    "Overloaded",
    "RedisUnavailable",
]


class FleetgateError(Exception):
    """Base class of every error fleetgate raises on purpose."""


class Overloaded(FleetgateError):
    """The gate's fleet-wide wait list is full: rejected at once, the work was never invoked.

    Retrying an overload deepens it, so fleetgate never retries this error itself. ``reason``,
    when given, replaces "its fleet-wide wait list is full" in the message (say, a call heavier
    than the local fair-share bound while Redis is unreachable).
    """

    def __init__(
        self,
        gate: str,
        max_queued: int,
        *,
        reason: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        why = reason or f"its fleet-wide wait list is full (max_queued={max_queued})"
        super().__init__(f"gate {gate!r} is overloaded: {why}; the call was not started")
        self.gate = gate
        self.max_queued = max_queued
        #: what refused the call, when it was not the gate's full wait list
        self.reason = reason
        #: seconds after which a call like this one is expected to be served in time (from the
        #: gate's measured drain), None when unknown
        self.retry_after = retry_after


class DeadlineUnreachable(Overloaded):
    """By the measured drain of its band the call would start after its deadline (with the
    gate's ``deadline_admission="finish"``: would end after it, counting its band's expected
    hold): refused at once instead of waiting its deadline out (deadline-aware admission).
    Never retried, as every ``Overloaded``.

    ``expected_wait``: the wait the gate expected, ``deadline``: what the call could wait
    (seconds); ``expected_hold``: the band's mean hold counted against the deadline too
    (seconds; None unless the gate admits by "finish"); ``retry_after`` how much later a call
    would be expected to make its deadline.
    """

    def __init__(
        self,
        gate: str,
        expected_wait: float,
        deadline: float,
        *,
        retry_after: float,
        expected_hold: float | None = None,
    ) -> None:
        if expected_hold is None:
            what = f"the expected wait of {expected_wait:.3f} s is"
        else:
            what = (
                f"the expected wait of {expected_wait:.3f} s and its band's mean hold of "
                f"{expected_hold:.3f} s are"
            )
        super().__init__(
            gate,
            0,
            reason=(
                f"{what} past the call's deadline of {deadline:.3f} s (by the gate's measured "
                "drain)"
            ),
            retry_after=retry_after,
        )
        self.expected_wait = expected_wait
        self.expected_hold = expected_hold
        self.deadline = deadline


class DeadlineExceeded(FleetgateError, TimeoutError):
    """The total deadline of a request fired (queue wait, calls and retries included)."""

    def __init__(self, gate: str, deadline_ms: int, *, where: str = "") -> None:
        tail = f" ({where})" if where else ""
        super().__init__(
            f"gate {gate!r}: total deadline of {deadline_ms} ms exceeded{tail}; "
            "the deadline covers queue wait, calls and retries"
        )
        self.gate = gate
        self.deadline_ms = deadline_ms


class LeaseLost(FleetgateError):
    """A held lease could not be renewed and is no longer counted by the gate."""


class LeaseRevoked(FleetgateError):
    """The gate asked for this lease back while its block ran: a call of a higher band had
    waited longer than the gate's ``revoke_after`` (cooperative revocation). The lease held its
    units until it was released; raised on leaving a ``permit()`` block whose lease was revoked,
    unless the block raised an exception of its own."""


class ConfigError(FleetgateError, ValueError):
    """Invalid configuration: the message names the field and the problem."""


class RedisUnavailable(FleetgateError, ConnectionError):
    """Redis could not be reached and the fleet is configured with ``on_redis_error="fail"``,
    or a read that has no fallback (``fleet.utilization()``, ``gate.snapshot()``) could not be
    made."""


class GateStateError(FleetgateError):
    """Redis refused a gate script for the data it found, say WRONGTYPE: a key of the gate
    overwritten with a value of another type. The message names the gate and the key;
    ``gate``, ``keys`` (the offending keys, when they could be found) and ``reply`` (the Redis
    error text) carry the same. Not an outage: the fair-share fallback does not apply.
    """

    def __init__(self, gate: str, keys: list[str], reply: str) -> None:
        where = f"; wrong type: {', '.join(keys)}" if keys else ""
        super().__init__(
            f"gate {gate!r}: Redis refused a gate script: {reply}{where} "
            "(delete or repair the key; `fleetgate check` names bad keys)"
        )
        self.gate = gate
        self.keys = keys
        self.reply = reply
