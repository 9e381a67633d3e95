"""What a server states about itself beside its gauges, and the rate of its counters: pure
helpers of the scrape room.

* :func:`stated_slots` -- llama.cpp states its slots (``-np``) only in ``GET /props``
  (``total_slots``), not in ``/metrics``; :func:`props_url` is that URL beside the metrics URL.
* :func:`counter_increase` -- a counter's value is its total since the server started; the
  signal is its increase between two polls (unknown for the first reading and after a reset).
"""

from __future__ import annotations

import math
from urllib.parse import urlsplit

import msgspec

__all__ = ["counter_increase", "props_url", "stated_slots"]


def props_url(metrics_url: str, props_path: str) -> str:
    """The URL of ``props_path`` beside ``metrics_url``: its last path segment replaced
    (``http://h:8080/metrics`` -> ``http://h:8080/props``; a server behind a path prefix keeps
    it)."""
    parts = urlsplit(metrics_url)
    head = parts.path.rsplit("/", 1)[0]
    return f"{parts.scheme}://{parts.netloc}{head}{props_path}"


def stated_slots(text: str | None) -> float | None:
    """``total_slots`` of a llama.cpp ``/props`` answer (an integer >= 1), else None."""
    if not text:
        return None
    try:
        data = msgspec.json.decode(text)
    except msgspec.DecodeError:
        return None
    if not isinstance(data, dict):
        return None
    slots = data.get("total_slots")
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        return None
    value = float(slots)
    return value if math.isfinite(value) else None


def counter_increase(previous: float | None, current: float | None) -> float | None:
    """How much a counter grew since the last poll: None without two readings, and when it went
    down (the server restarted: what happened in between is unknown)."""
    if previous is None or current is None or current < previous:
        return None
    return current - previous
