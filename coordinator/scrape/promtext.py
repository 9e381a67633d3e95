"""Reading a few named samples out of a Prometheus text exposition, quickly.

A model server's ``/metrics`` body is hundreds of lines (histograms, counters per label set);
an adapter needs three or four gauges of it. :func:`select_samples` keeps only the lines whose
**sample name** is one of the wanted names -- one regular-expression pass in C. A selected line in
the plain shape every server writes (``name{k="v",...} value``: no escapes, no blanks inside the
braces, no timestamp or exemplar) is read by one more regular expression; any other selected line
goes to ``prometheus_client``'s parser, which decides what it means or refuses it.
``tests/coordinator/scrape/test_promtext.py`` checks that both readings agree on every line the
fast one accepts; the fast one is ~10x cheaper per line, which a poll of a thousand endpoints
needs.
:func:`sample_names_present` answers "which of these names has a sample here" for server
detection, with the same scan and no parsing; :func:`first_foreign_line` "is this the text
format at all" for an answer without them.

Pure functions; they raise on unparseable selected lines (the caller turns that into a failure).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import lru_cache
from typing import NamedTuple

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["Sample", "first_foreign_line", "sample_names_present", "select_samples"]


class Sample(NamedTuple):
    """One sample: its exact name (``vllm:num_requests_running``), labels and value."""

    name: str
    labels: dict[str, str]
    value: float


@lru_cache(maxsize=256)
def _line_pattern(names: frozenset[str]) -> re.Pattern[str]:
    # A sample line starts with its name, then "{" (labels) or blanks (value). Longer names go
    # first so that "x_by_reason" is not read as "x"; the lookahead refuses mere prefixes.
    alternatives = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
    return re.compile(rf"^[ \t]*(?:{alternatives})(?=[{{ \t]).*$", re.MULTILINE)


_LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="[^"\\\n]*"'
_PLAIN = re.compile(
    rf"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{{((?:{_LABEL}(?:,{_LABEL})*,?)?)\}})?[ \t]+([^ \t#]+)[ \t]*"
)
_PAIR = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="([^"]*)"')
# A line that is neither blank nor a comment.
_DATA_LINE = re.compile(r"^[ \t]*[^# \t\r\n].*$", re.MULTILINE)


def _plain(line: str) -> Sample | None:
    """``line`` read by the fast path, or None when it is not in the plain shape."""
    m = _PLAIN.fullmatch(line.strip())
    if m is None:
        return None
    name, labels_text, value_text = m.groups()
    if "_" in value_text:
        return None  # prometheus_client refuses it; let it say why
    try:
        value = float(value_text)
    except ValueError:
        return None
    labels = dict(_PAIR.findall(labels_text)) if labels_text else {}
    if labels_text and len(labels) != labels_text.count('="'):
        return None  # a repeated label name
    return Sample(name, labels, value)


@lru_cache(maxsize=256)
def _name_pattern(names: frozenset[str]) -> re.Pattern[str]:
    alternatives = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
    return re.compile(rf"^[ \t]*({alternatives})(?=[{{ \t])", re.MULTILINE)


def select_samples(text: str, names: frozenset[str]) -> list[Sample]:
    """The samples of ``text`` whose name is in ``names``, in text order.

    Lines of other metrics, comments and HELP/TYPE lines are skipped before parsing, so their
    content (or garbage) costs a scan, not a parse. Raises what the parser raises for a selected
    line it cannot read.
    """
    if not names:
        return []
    out: list[Sample] = []
    slow: list[str] = []
    for line in _line_pattern(names).findall(text):
        sample = _plain(line)
        if sample is None:
            slow.append(line)
        elif sample.name in names:
            out.append(sample)
    if slow:
        for family in text_string_to_metric_families("\n".join(slow) + "\n"):
            for s in family.samples:
                if s.name in names:
                    out.append(Sample(s.name, s.labels, float(s.value)))
    return out


def first_foreign_line(text: str, lines: int = 20) -> str | None:
    """The first of ``text``'s first ``lines`` data lines (not blank, not a comment) that is no
    sample line of the text format, or None when they all are (an empty text too). A cheap
    "is this Prometheus text at all?" for an answer that had none of the samples wanted."""
    for n, line in enumerate(_DATA_LINE.finditer(text)):
        if n >= lines:
            break
        data = line.group(0)
        if _plain(data) is not None:
            continue
        try:
            list(text_string_to_metric_families(data + "\n"))
        except Exception:  # third-party parser, untrusted text: any refusal means "not a sample"
            return data.strip()
    return None


def sample_names_present(text: str, names: Iterable[str]) -> set[str]:
    """Which of ``names`` start at least one sample line of ``text`` (no parsing)."""
    wanted = frozenset(names)
    if not wanted:
        return set()
    return set(_name_pattern(wanted).findall(text))
