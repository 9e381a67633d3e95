"""The PromQL of deploy/grafana/ and deploy/prometheus/alerts.yml, and the rule by which the
end-to-end test asks a real Prometheus for each: what "returns series" means for an expression
that only matches when something is wrong.

The rule:

* A **dashboard** query is evaluated as written, Grafana's variables replaced by what "All"
  and a short range stand for (:data:`GRAFANA_VARIABLES`: ``$gate`` -> ``.*``,
  ``$__rate_interval`` -> ``10s``, enough for two samples at the test's 1 s scrape).
* An **alert** expression is split at its top-level ``and`` / ``or`` / ``unless``; each part
  loses its top-level comparison (``A > 0`` -> ``A``, ``A <= on (gate) B`` -> ``A``); each part
  must return series. What a part compares against (``B``) is covered by the next point.
* Every **metric** any expression names must have series of its own, so a misspelt name fails
  even inside an ``or vector(0)``. The test's fleet therefore runs one of each failure that
  the alerts watch (fleetgate's failure counters and gauges appear only when they first count).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "fleetgate.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
ALERT_TESTS = ROOT / "deploy" / "prometheus" / "alerts_test.yml"

GRAFANA_VARIABLES = {"$__rate_interval": "10s", "$gate": ".*"}
_SET_OPS = ("and", "or", "unless")
_COMPARISONS = ("==", "!=", "<=", ">=", "<", ">")
_METRIC = re.compile(r"\b(fleetgate_[a-z_]+|up)\b(?!\s*\()")  # a name, not a function
_OPEN, _CLOSE = "([{", ")]}"
_MATCHING = re.compile(r"^\s*(?:(?:on|ignoring|group_left|group_right)\s*\([^)]*\)\s*)+")


def dashboard() -> dict[str, object]:
    data: dict[str, object] = json.loads(DASHBOARD.read_text())
    return data


def dashboard_queries() -> list[tuple[str, str]]:
    """``(panel title / refId, expression with the variables replaced)`` of every query."""
    out = []
    for panel in dashboard()["panels"]:  # type: ignore[attr-defined]
        for target in panel.get("targets", []):
            expr = target["expr"]
            for var, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(var, value)
            out.append((f"{panel['title']} / {target['refId']}", expr))
    return out


def variable_metrics() -> set[str]:
    """The metrics the dashboard's query variables read (``label_values(<metric>, <label>)``)."""
    variables = dashboard()["templating"]["list"]  # type: ignore[index]
    return set().union(*(metric_names(v.get("definition", "")) for v in variables))


def alert_rules() -> list[dict[str, object]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def _top_level(expr: str) -> list[tuple[int, str]]:
    """``(offset, token)`` of each set operator and comparison outside brackets and strings."""
    found: list[tuple[int, str]] = []
    depth, i, quote = 0, 0, ""
    while i < len(expr):
        ch = expr[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in "\"'`":
            quote = ch
        elif ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            depth -= 1
        elif depth == 0:
            word = (
                re.match(r"[a-z]+\b", expr[i:]) if (i == 0 or not expr[i - 1].isalnum()) else None
            )
            if word and word.group() in _SET_OPS:
                found.append((i, word.group()))
                i += len(word.group())
                continue
            op = next((c for c in _COMPARISONS if expr.startswith(c, i)), None)
            if op and not expr.startswith("=~", i):
                found.append((i, op))
                i += len(op)
                continue
        i += 1
    return found


def without_threshold(expr: str) -> list[str]:
    """The parts of an alert expression to evaluate, as the module docstring says."""
    tokens = _top_level(expr)
    cuts = [(i, t) for i, t in tokens if t in _SET_OPS]
    parts, start = [], 0
    for i, token in cuts:
        parts.append(expr[start:i])
        start = i + len(token)
    parts.append(expr[start:])
    out = []
    for part in parts:
        part = _MATCHING.sub("", part)  # `and on (gate) X`: the modifier is the operator's
        comparisons = [i for i, t in _top_level(part) if t in _COMPARISONS]
        out.append((part[: comparisons[0]] if comparisons else part).strip())
    return out


def metric_names(expr: str) -> set[str]:
    """The metric names ``expr`` selects (fleetgate's and ``up``)."""
    return set(_METRIC.findall(expr))
