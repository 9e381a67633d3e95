"""The client-observed signal: call outcomes and latencies counted fleet-wide in Redis.

Servers without usable metrics (hosted APIs, TEI, a NIM reranker) are adapted from what the
callers see. Every release may carry its call's report (``lease.report(outcome, latency)``;
``gate.map`` reports for you); the client sums the reports of one script call into
``(field, increment)`` pairs (:func:`tally`) and the release path adds them to the gate's
``{prefix}:{G}:obs`` hash in the same script call (``lua/lib_units.lua``, ``observe``)::

    ok, overloaded, timeout, error   calls reported with that outcome
    lat_n, lat_us                    count and sum (microseconds) of ``ok`` latencies
    b<i>                             ``ok`` calls whose latency fell in bucket i (BOUNDS)
    tn:<tenant> ta:<tenant> tu:<tenant>  reports that said the tokens a call used, the tokens
                                     those calls asked for and used, per tenant ('' the
                                     default one): what a call uses (TokenUsage)

and, not stored, ``vc:<lane class>`` = tokens used - tokens asked, summed: the settlement that
moves the lane's virtual time in the fair order by what its calls really used
(``lua/lib_lanes.lua``, ``settle_tags``).

Every field is a monotonic counter. The coordinator reads the hash once per poll
(:meth:`Reading.parse`) and works on the difference of two readings (:func:`delta`); a counter
that went down (the key was deleted, Redis restarted or lost it) gives no difference that poll.
The quantiles come from the fixed buckets (:func:`quantile`), so the fleet's latency
distribution is summed exactly across processes without sending samples.

This is a core module: both the client (encoding) and the coordinator (decoding) use it.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping

import msgspec

from fleetgate.admission import parse_lane_class
from fleetgate.errors import ConfigError

__all__ = [
    "BOUNDS",
    "LEAST_REPORTS",
    "OUTCOMES",
    "OVERLOADED_STATUSES",
    "TIMEOUT_STATUSES",
    "Reading",
    "TokenUsage",
    "bucket_of",
    "classify_status",
    "delta",
    "encode_report",
    "median_error",
    "quantile",
    "tally",
    "typical_latency",
    "validate_outcome",
]

#: Reports of a tenant before what its calls use is learnt (:meth:`TokenUsage.use_per_call`).
LEAST_REPORTS = 20

#: What a call's report says: "ok", or why it failed. "overloaded" is the server shedding load
#: (HTTP 429, 503, 529); "timeout" a call that timed out; "error" anything else.
OUTCOMES = ("ok", "overloaded", "timeout", "error")

#: HTTP statuses of a server that sheds load: Too Many Requests, Service Unavailable, and 529
#: (an overloaded API, e.g. Anthropic's). Timeouts: Request Timeout, Gateway Timeout. One place
#: for the client's classification (``gate.map``) and the proxy's.
OVERLOADED_STATUSES = frozenset({429, 503, 529})
TIMEOUT_STATUSES = frozenset({408, 504})


def classify_status(status: int) -> str:
    """The outcome of an HTTP status: overloaded, timeout, error (other 4xx/5xx) or ok."""
    if status in OVERLOADED_STATUSES:
        return "overloaded"
    if status in TIMEOUT_STATUSES:
        return "timeout"
    return "error" if status >= 400 else "ok"


#: Upper bounds (seconds) of the latency buckets: bucket 0 is (0, 1 ms], bucket i is
#: (BOUNDS[i-1], BOUNDS[i]], and bucket len(BOUNDS) the overflow above ~65.5 s. Geometric with
#: factor 2^(1/4) (+19 % per bucket): a quantile is known within ±9 % from 66 counters, whatever
#: the scale of the latencies (an embedding call of 5 ms, a generation of 30 s).
BOUNDS: tuple[float, ...] = tuple(0.001 * 2 ** (i / 4) for i in range(65))
OVERFLOW = len(BOUNDS)

# The field names, named once (lua/lib_units.lua writes whatever pairs it is given).
_LAT_N, _LAT_US = "lat_n", "lat_us"
_COUNT_FIELDS = (*OUTCOMES, _LAT_N, _LAT_US)
_BUCKET_FIELDS = tuple(f"b{i}" for i in range(OVERFLOW + 1))
_BUCKET_OF_FIELD = {name: i for i, name in enumerate(_BUCKET_FIELDS)}
#: the per-tenant settlement counters (``tn:<tenant>`` ...) a reading sums over its tenants
_TOKEN_SUMS = {"tn": "tok_reports", "ta": "tok_asked", "tu": "tok_used"}


def bucket_of(latency_s: float) -> int:
    """The bucket of a latency in seconds (0 for <= 1 ms, ``OVERFLOW`` above the last bound)."""
    return bisect.bisect_left(BOUNDS, latency_s) if latency_s > 0 else 0


def validate_outcome(outcome: object) -> str:
    """``outcome`` if it is one of :data:`OUTCOMES`, else :class:`ConfigError`."""
    if not isinstance(outcome, str) or outcome not in OUTCOMES:
        raise ConfigError(f"outcome: expected one of {', '.join(OUTCOMES)}, got {outcome!r}")
    return outcome


def encode_report(
    outcome: str,
    latency_s: float | None,
    tokens: tuple[int, int, str] | None = None,
) -> str:
    """One call's report as it travels with its release: ``"<outcome>:<latency µs>"`` (the
    latency only for ``ok``; empty when unknown), then, when the call said what it used,
    ``";<tokens asked>;<tokens used>;<lane class>"`` (``tokens`` = (asked, used, the lane
    class of :func:`fleetgate.admission.lane_class`: its band and tenant)). ``outcome`` is
    validated by the caller."""
    text = (
        f"{outcome}:"
        if outcome != "ok" or latency_s is None
        else (f"ok:{max(0, round(latency_s * 1e6))}")
    )
    if tokens is not None:
        asked, used, cls = tokens
        text += f";{asked};{used};{cls}"
    return text


def tally(reports: Iterable[str]) -> list[str | int]:
    """The ``(field, increment)`` pairs, flattened, that add ``reports`` (:func:`encode_report`
    strings; empty ones are skipped) to the obs hash, with the settlements of the calls that
    asked tokens. Empty when there is nothing to add."""
    counts: dict[str, int] = {}
    for report in reports:
        if not report:
            continue
        report, _, usage = report.partition(";")
        if usage:
            asked, used, cls = usage.split(";", 2)
            tenant = parse_lane_class(cls)[1] or ""
            for kind, n in (("tn", 1), ("ta", int(asked)), ("tu", int(used))):
                field = f"{kind}:{tenant}"
                counts[field] = counts.get(field, 0) + n
            if int(asked) > 0:  # charged by its tokens at the grant: settled by what it used
                field = f"vc:{cls}"
                counts[field] = counts.get(field, 0) + int(used) - int(asked)
        outcome, _, micros = report.partition(":")
        counts[outcome] = counts.get(outcome, 0) + 1
        if micros:
            us = int(micros)
            counts[_LAT_N] = counts.get(_LAT_N, 0) + 1
            counts[_LAT_US] = counts.get(_LAT_US, 0) + us
            field = _BUCKET_FIELDS[bucket_of(us / 1e6)]
            counts[field] = counts.get(field, 0) + 1
    out: list[str | int] = []
    for field, n in counts.items():
        out += (field, n)
    return out


class Reading(msgspec.Struct, frozen=True):
    """The obs counters of one gate at one instant, or the difference of two (a window).

    ``at`` is the time of the reading (seconds, the coordinator's shared clock); in a window,
    ``seconds`` is its length. ``buckets`` is sparse: bucket index -> count. ``tok_*`` are the
    settlements of every tenant together: calls that reported their tokens, the tokens they
    were charged, the tokens they used.
    """

    ok: int = 0
    overloaded: int = 0
    timeout: int = 0
    error: int = 0
    lat_n: int = 0
    lat_us: int = 0
    buckets: dict[int, int] = msgspec.field(default_factory=dict)
    at: float = 0.0
    seconds: float = 0.0
    tok_reports: int = 0
    tok_asked: int = 0
    tok_used: int = 0

    @classmethod
    def parse(cls, raw: Mapping[bytes, bytes] | Mapping[str, str], at: float = 0.0) -> Reading:
        """A reading from ``HGETALL {prefix}:{G}:obs``. Unknown fields are ignored; a value that
        is no non-negative integer counts as 0 (so the next sane reading starts a new window)."""
        counts: dict[str, int] = {}
        buckets: dict[int, int] = {}
        for key, value in raw.items():
            name = key.decode("utf-8", "replace") if isinstance(key, bytes) else key
            try:
                n = int(value)
            except ValueError:
                continue
            if n <= 0:
                continue
            if name in _COUNT_FIELDS:
                counts[name] = n
            elif name in _BUCKET_OF_FIELD:
                buckets[_BUCKET_OF_FIELD[name]] = n
            elif name[2:3] == ":" and name[:2] in _TOKEN_SUMS:
                total = _TOKEN_SUMS[name[:2]]
                counts[total] = counts.get(total, 0) + n
        return cls(**counts, buckets=buckets, at=at)

    @property
    def calls(self) -> int:
        """Calls reported, whatever their outcome."""
        return self.ok + self.overloaded + self.timeout + self.error

    @property
    def mean_latency(self) -> float | None:
        """Mean latency (seconds) of the ``ok`` calls with a latency; None without any."""
        return self.lat_us / self.lat_n / 1e6 if self.lat_n > 0 else None

    @property
    def busy(self) -> float | None:
        """Average ``ok`` calls in flight over a window (Little's law: latency summed over the
        window's length); None for a reading or a window of no length."""
        return self.lat_us / 1e6 / self.seconds if self.seconds > 0 else None


def delta(prev: Reading | None, cur: Reading) -> Reading | None:
    """The window from ``prev`` to ``cur``: what was reported in between. None when there is no
    ``prev`` or any counter went down (the key was deleted or Redis lost it: counters restart
    from 0, and that poll's difference is unknown)."""
    if prev is None or cur.at < prev.at:
        return None
    fields = {}
    for name in (*_COUNT_FIELDS, *_TOKEN_SUMS.values()):
        d = getattr(cur, name) - getattr(prev, name)
        if d < 0:
            return None
        fields[name] = d
    buckets: dict[int, int] = {}
    for i in prev.buckets.keys() | cur.buckets.keys():
        d = cur.buckets.get(i, 0) - prev.buckets.get(i, 0)
        if d < 0:
            return None
        if d:
            buckets[i] = d
    return Reading(**fields, buckets=buckets, at=cur.at, seconds=cur.at - prev.at)


def quantile(buckets: Mapping[int, int], q: float) -> float | None:
    """The ``q``-quantile (0 < q <= 1), seconds, of the latencies counted in ``buckets``:
    interpolated linearly inside the bucket it falls in (as Prometheus' histogram_quantile);
    the overflow bucket answers its lower bound. None without any count."""
    total = sum(n for n in buckets.values() if n > 0)
    if total <= 0:
        return None
    rank = q * total
    seen = 0
    for i in sorted(buckets):
        n = buckets[i]
        if n <= 0:
            continue
        if seen + n >= rank:
            if i >= OVERFLOW:
                return BOUNDS[-1]
            lo = BOUNDS[i - 1] if i > 0 else 0.0
            return lo + (BOUNDS[i] - lo) * (rank - seen) / n
        seen += n
    return BOUNDS[-1]


def typical_latency(window: Reading, q: float = 0.5) -> float | None:
    """The window's ``q``-quantile latency, sharpened for a tight distribution: when every
    latency lies in two adjacent buckets (a spread of at most ~40 %), the exact mean, which a
    point interpolated inside a 19 %-wide bucket describes worse. A wider spread keeps the
    quantile (a mean would follow the tail)."""
    estimate = quantile(window.buckets, q)
    mean = window.mean_latency
    used = [i for i, n in window.buckets.items() if n > 0]
    if estimate is None or mean is None or not math.isfinite(mean):
        return estimate
    if max(used) - min(used) <= 1 and OVERFLOW not in used:
        return mean
    return estimate


def median_error(window: Reading) -> float:
    """The relative standard error of the window's median latency: 1.2533 sigma / sqrt(n), with
    sigma (of the log latency) from the interquartile range (ln(p75 / p25) / 1.349). A median
    of 10 calls is a guess; of 1,000 a measurement. 0 without a spread or samples."""
    n = sum(window.buckets.values())
    p25, p75 = quantile(window.buckets, 0.25), quantile(window.buckets, 0.75)
    if n <= 0 or not p25 or not p75 or p75 <= p25:
        return 0.0
    return 1.2533 * math.log(p75 / p25) / 1.349 / math.sqrt(n)


class TokenUsage(msgspec.Struct, frozen=True):
    """What the calls of one tenant that reported their tokens asked for and used, fleet-wide
    (the obs hash's ``tn``/``ta``/``tu`` counters): what a call of the tenant uses
    (:meth:`use_per_call`), so a caller that knows only its upper bound (``max_tokens``) can be
    charged that (:meth:`estimate`), and how far the tokens asked miss it (:attr:`ratio`)."""

    reports: int = 0
    asked: int = 0
    used: int = 0

    @property
    def ratio(self) -> float | None:
        """Tokens used per token asked (None before any report). The asks are what the calls
        held, so a caller that scaled its asks by this ratio moved it: scaling by it again
        settles at the square root of the true ratio. Charge by :meth:`estimate` instead."""
        return self.used / self.asked if self.asked > 0 else None

    def use_per_call(self, least_reports: int = LEAST_REPORTS) -> float | None:
        """The tokens a call of this tenant used, on average, once ``least_reports`` calls have
        reported (None before). It does not depend on what the calls asked, so a charge learnt
        from it does not feed back on itself (:meth:`estimate`; the proxy's output estimate,
        ``proxy/_tokens.py``)."""
        if self.reports < max(1, least_reports):
            return None
        return self.used / self.reports

    def estimate(self, asked: int, *, least_reports: int = LEAST_REPORTS) -> int:
        """The tokens to charge a call that asks ``asked`` at most: what this tenant's calls use
        (:meth:`use_per_call`), never above ``asked``; ``asked`` itself until ``least_reports``
        calls have reported. A caller charged by it and reporting against that charge settles
        at what it uses. It is the tenant's mean: a call that needs more than its charge grows
        with ``lease.resize``."""
        mean = self.use_per_call(least_reports)
        if mean is None:
            return asked
        return max(1, min(asked, math.ceil(mean))) if asked > 0 else 0

    @classmethod
    def parse(cls, raw: Mapping[bytes, bytes] | Mapping[str, str]) -> dict[str, TokenUsage]:
        """Per tenant ('' = the default tenant), from ``HGETALL {prefix}:{G}:obs``; garbage
        values count as 0."""
        acc: dict[str, dict[str, int]] = {}
        for key, value in raw.items():
            name = key.decode("utf-8", "replace") if isinstance(key, bytes) else key
            kind, sep, tenant = name.partition(":")
            if not sep or kind not in _USAGE_FIELDS:
                continue
            try:
                n = max(0, int(value))
            except ValueError:
                n = 0
            acc.setdefault(tenant, {})[_USAGE_FIELDS[kind]] = n
        return {tenant: cls(**fields) for tenant, fields in acc.items()}


_USAGE_FIELDS = {"tn": "reports", "ta": "asked", "tu": "used"}
