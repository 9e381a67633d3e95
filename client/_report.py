"""Reports for the client-observed signal: ``lease.report`` and ``gate.map``'s classification.

A lease's report (outcome and latency) leaves with its release, in the same script call
(``_calls.py``: a ``ReleaseCall``'s report; :func:`fleetgate.observed.tally` sums a batch's
reports), and lands in the gate's ``obs`` counters, which the coordinator reads per poll for
gates driven by latency (``docs/aimd.md``, "The client-observed signal").

``gate.map`` reports for every call it makes (:class:`CallReport`): the outcome of the call's
last attempt -- ``overloaded`` if any attempt was (the server shed load, whatever a retry got
afterwards) -- and the latency of that last attempt when it was ``ok``. A cancelled call (a
sibling failed, the deadline fired) reports nothing: its latency says nothing of the server.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable
from typing import TypeVar

from fleetgate.admission import validate_tokens
from fleetgate.ask import Ask
from fleetgate.errors import ConfigError
from fleetgate.observed import classify_status, encode_report, validate_outcome

__all__ = ["CallReport", "Reporting", "classify_exception", "classify_result", "classify_status"]

T = TypeVar("T")


def _status_of(obj: object) -> int | None:
    """The HTTP status an object carries: an httpx.Response (``status_code``), an
    ``HTTPStatusError`` (its response's), an SDK error with ``status_code`` or ``status``."""
    try:  # a foreign object's properties may raise anything
        response = getattr(obj, "response", None)
        for holder in (obj, response):
            for attr in ("status_code", "status"):
                value = getattr(holder, attr, None)
                if isinstance(value, int) and not isinstance(value, bool) and 100 <= value <= 599:
                    return value
    except Exception:
        return None
    return None


def classify_exception(exc: BaseException) -> str:
    """The outcome of a call that raised ``exc`` (not a cancellation)."""
    if isinstance(exc, TimeoutError):
        return "timeout"
    try:
        import httpx
    except ImportError:  # pragma: no cover - httpx is a dependency
        pass
    else:
        if isinstance(exc, httpx.TimeoutException):
            return "timeout"
    status = _status_of(exc)
    if status is not None:
        outcome = classify_status(status)
        return "error" if outcome == "ok" else outcome
    return "error"


def classify_result(result: object) -> str:
    """The outcome of a call that returned ``result``: by its HTTP status when it has one
    (a returned 429 is an overload even if nobody raised), else ok."""
    status = _status_of(result)
    return "ok" if status is None else classify_status(status)


class Reporting:
    """``lease.report(outcome, latency=None)``: mixed into :class:`~._lease.Lease`."""

    #: monotonic time of the grant (set by the lease)
    _granted_at: float = 0.0
    #: the report to send with the release (fleetgate.observed.encode_report), "" for none
    _report: str = ""
    #: what the lease was asked with (set by the lease): its tokens are the estimate a token
    #: report is counted against
    ask: Ask

    def report(
        self, outcome: str, latency: float | None = None, *, tokens: int | None = None
    ) -> None:
        """Report the call's outcome -- ``"ok"``, ``"overloaded"`` (429, 503, 529),
        ``"timeout"`` or ``"error"`` -- and, for ``"ok"``, its latency in seconds (default: the
        time since the permit was granted) for the client-observed signal. The report leaves
        with the release (no extra round trip); a second report replaces the first; a report
        after the release, or on a permit granted locally while Redis was unreachable, is not
        counted. Anything but those four outcomes, or a latency that is negative or not finite,
        is a :class:`ConfigError`.

        ``tokens``: what the call really used (prompt + output, an int >= 0). It never changes
        what the lease holds; it is counted per tenant against the tokens the call asked for
        (its estimate, whatever it was resized to since), fleet-wide
        (``gate.snapshot().token_usage``), so a later call can be charged what its tenant's
        calls use (:meth:`fleetgate.observed.TokenUsage.estimate`).
        """
        validate_outcome(outcome)
        usage = None
        if tokens is not None:
            validate_tokens(tokens)
            usage = (self.ask.tokens, tokens, self.ask.lane)
        if latency is None:
            latency = time.monotonic() - self._granted_at
        elif (
            isinstance(latency, bool)
            or not isinstance(latency, (int, float))
            or not math.isfinite(latency)
            or latency < 0
        ):
            raise ConfigError(f"latency: expected seconds >= 0 or None, got {latency!r}")
        self._report = encode_report(outcome, float(latency), usage)


class CallReport:
    """What ``gate.map`` reports for one call: fed by each attempt, read at the release."""

    __slots__ = ("latency", "outcome", "overloaded")

    def __init__(self) -> None:
        self.outcome: str | None = None
        self.latency: float | None = None
        self.overloaded = False

    def note(self, outcome: str, latency: float | None) -> None:
        """One attempt ended with ``outcome`` after ``latency`` seconds."""
        self.outcome, self.latency = outcome, latency
        self.overloaded = self.overloaded or outcome == "overloaded"

    def send(self, lease: object) -> None:
        """Put the report on ``lease`` (anything with a ``report`` method)."""
        if self.outcome is None:
            return
        report = getattr(lease, "report", None)
        if report is None:
            return
        if self.overloaded:
            report("overloaded")
        else:
            report(self.outcome, self.latency if self.outcome == "ok" else None)


async def timed(call: Awaitable[T], report: CallReport) -> T:
    """Await ``call``, noting its outcome and latency in ``report``; a cancellation notes
    nothing."""
    t0 = time.monotonic()
    try:
        result = await call
    except asyncio.CancelledError:
        raise
    except BaseException as exc:
        report.note(classify_exception(exc), None)
        raise
    report.note(classify_result(result), time.monotonic() - t0)
    return result
