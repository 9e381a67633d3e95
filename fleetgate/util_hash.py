"""The utilisation snapshot ``fg:{G}:util``: its fields and their text, written and read here only.

The coordinator's leader writes it every poll (``publish.lua`` copies the pairs of
:meth:`UtilHash.encode` into the hash); ``fleetgate status``/``inspect`` and
``fleet.utilization()`` read it back with :meth:`UtilHash.decode` from the gate's snapshot
(``inspect.lua`` returns the hash as it is). ``prune.lua`` keeps its idle clock in the same hash
(``idle_since``, ``idle_mark``): those fields are the scripts' own, not part of this codec.

The text of each kind of field:

* a gauge or a time: ``repr(float)`` (``"12.0"``), the latencies ``"%.6f"`` seconds; an int
  ``str(int)``; a flag ``"1"``/``"0"``; unknown ``""``;
* ``metrics_url``: the URLs the poll read, comma-joined; ``state``: the controller state as JSON
  (the warm-failover state a new leader resumes from); ``token_state`` likewise for a gate whose
  token budget is tuned (the ``token_*``, ``kv_tokens`` and ``tokens_held`` fields are written
  for those gates only).

A field that does not parse (garbled by hand, written by another version) reads as unknown:
None, or False for the flags. The client-observed fields (``obs_*``) are written only by a poll
that decided (a held poll leaves the last ones), the latency fields only with ``signal`` set.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import msgspec

__all__ = ["LATENCY_FIELDS", "OBSERVED_FIELDS", "STATE_FIELD", "TOKEN_STATE_FIELD", "UtilHash"]

#: the field holding the controller state (read alone at a leader's takeover)
STATE_FIELD: Final = "state"
#: the field holding the token budget controller's state (read with it)
TOKEN_STATE_FIELD: Final = "token_state"
#: what the callers reported in the last poll
OBSERVED_FIELDS: Final = ("obs_calls", "obs_overloaded", "obs_timeout")
#: a latency-driven gate's reading; written with ``signal`` (``"latency"``)
LATENCY_FIELDS: Final = ("signal", "latency_p50", "latency_no_load")


class UtilHash(msgspec.Struct, frozen=True, kw_only=True):
    """One gate's utilisation snapshot (``fg:{G}:util``) as values. None = unknown."""

    #: the model server's gauges at the last scrape (summed over replicas)
    running: float | None = None
    waiting_capacity: float | None = None
    kv_cache_usage: float | None = None
    preemptions: float | None = None
    admission_rejections: float | None = None
    #: the requests the server admits at once, as it states them (slots, max requests)
    max_requests: float | None = None
    #: the last scrape was usable; the URLs it read (comma-joined), the kind that read them,
    #: and what went wrong
    metrics_ok: bool = False
    metrics_url: str | None = None
    server: str | None = None
    error: str | None = None
    #: the decision: its target, the gate's bounds, why, whether the engine queued
    current_target: int | None = None
    floor: int | None = None
    ceiling: int | None = None
    reason: str | None = None
    saturated: bool = False
    #: units held fleet-wide at the poll, and when it ran (Redis server time, seconds)
    in_flight: int | None = None
    last_poll: float | None = None
    #: the controller state, JSON
    state: str | None = None
    #: calls the releases reported during the last poll, and the overloads / timeouts among them
    obs_calls: int | None = None
    obs_overloaded: int | None = None
    obs_timeout: int | None = None
    #: ``"latency"`` when the client-observed latency drives the target (else None: metrics or
    #: fixed), with that poll's median call latency and the no-load estimate (seconds)
    signal: str | None = None
    latency_p50: float | None = None
    latency_no_load: float | None = None
    #: a gate whose token budget the coordinator tunes: the KV cache the server states (tokens),
    #: the tokens the fleet held at the poll, the budget chosen, why, and the controller's state
    #: (JSON); all None for other gates
    kv_tokens: float | None = None
    tokens_held: int | None = None
    token_target: int | None = None
    token_reason: str | None = None
    token_state: str | None = None
    #: tokens the settled calls used per token they were charged (the ratio the budget is
    #: stretched by; None: not known yet)
    token_use_ratio: float | None = None

    def encode(self, *, observed: bool = True) -> dict[str, str]:
        """The hash's fields as text; ``observed`` False leaves out :data:`OBSERVED_FIELDS`,
        and :data:`LATENCY_FIELDS` are left out unless ``signal`` is set."""
        fields = {
            "running": _float_text(self.running),
            "waiting_capacity": _float_text(self.waiting_capacity),
            "kv_cache_usage": _float_text(self.kv_cache_usage),
            "preemptions": _float_text(self.preemptions),
            "admission_rejections": _float_text(self.admission_rejections),
            "max_requests": _float_text(self.max_requests),
            "current_target": _text(self.current_target),
            "floor": _text(self.floor),
            "ceiling": _text(self.ceiling),
            "metrics_ok": _flag(self.metrics_ok),
            "saturated": _flag(self.saturated),
            "last_poll": _float_text(self.last_poll),
            "metrics_url": _text(self.metrics_url),
            "server": _text(self.server),
            "reason": _text(self.reason),
            "in_flight": _text(self.in_flight),
            "error": _text(self.error),
            STATE_FIELD: _text(self.state),
        }
        if self.token_target is not None:
            fields["kv_tokens"] = _float_text(self.kv_tokens)
            fields["tokens_held"] = _text(self.tokens_held)
            fields["token_target"] = _text(self.token_target)
            fields["token_reason"] = _text(self.token_reason)
            fields["token_use_ratio"] = _float_text(self.token_use_ratio)
            fields[TOKEN_STATE_FIELD] = _text(self.token_state)
        if observed:
            fields["obs_calls"] = _text(self.obs_calls)
            fields["obs_overloaded"] = _text(self.obs_overloaded)
            fields["obs_timeout"] = _text(self.obs_timeout)
        if self.signal is not None:
            fields["signal"] = self.signal
            fields["latency_p50"] = _seconds_text(self.latency_p50)
            fields["latency_no_load"] = _seconds_text(self.latency_no_load)
        return fields

    @classmethod
    def decode(cls, raw: Mapping[str, str]) -> UtilHash:
        """The snapshot from the hash's fields (missing or garbled ones unknown)."""
        return cls(
            running=_float(raw.get("running")),
            waiting_capacity=_float(raw.get("waiting_capacity")),
            kv_cache_usage=_float(raw.get("kv_cache_usage")),
            preemptions=_float(raw.get("preemptions")),
            admission_rejections=_float(raw.get("admission_rejections")),
            max_requests=_float(raw.get("max_requests")),
            metrics_ok=raw.get("metrics_ok") == "1",
            metrics_url=raw.get("metrics_url") or None,
            server=raw.get("server") or None,
            error=raw.get("error") or None,
            current_target=_int(raw.get("current_target")),
            floor=_int(raw.get("floor")),
            ceiling=_int(raw.get("ceiling")),
            reason=raw.get("reason") or None,
            saturated=raw.get("saturated") == "1",
            in_flight=_int(raw.get("in_flight")),
            last_poll=_float(raw.get("last_poll")),
            state=raw.get(STATE_FIELD) or None,
            obs_calls=_int(raw.get("obs_calls")),
            obs_overloaded=_int(raw.get("obs_overloaded")),
            obs_timeout=_int(raw.get("obs_timeout")),
            signal=raw.get("signal") or None,
            latency_p50=_float(raw.get("latency_p50")),
            latency_no_load=_float(raw.get("latency_no_load")),
            kv_tokens=_float(raw.get("kv_tokens")),
            tokens_held=_int(raw.get("tokens_held")),
            token_target=_int(raw.get("token_target")),
            token_reason=raw.get("token_reason") or None,
            token_use_ratio=_float(raw.get("token_use_ratio")),
            token_state=raw.get(TOKEN_STATE_FIELD) or None,
        )


def _text(value: object) -> str:
    return "" if value is None else str(value)


def _float_text(value: float | None) -> str:
    return "" if value is None else repr(float(value))


def _seconds_text(value: float | None) -> str:
    return "" if value is None else f"{value:.6f}"


def _flag(value: bool) -> str:
    return "1" if value else "0"


def _float(text: str | None) -> float | None:
    if not text:
        return None
    try:
        return float(text)
    except ValueError:
        return None


def _int(text: str | None) -> int | None:
    value = _float(text)
    try:
        return None if value is None else int(value)
    except (ValueError, OverflowError):  # nan, inf
        return None
