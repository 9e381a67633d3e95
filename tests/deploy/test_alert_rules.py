"""deploy/prometheus/alerts.yml passes ``promtool check rules`` and its unit tests
(``promtool test rules`` over alerts_test.yml: each alert fires when it should and not before);
deploy/grafana/fleetgate.json is a well-formed dashboard; and the rule by which the end-to-end
test evaluates alert expressions (``_promql.without_threshold``) splits what it should.

promtool comes with Debian's ``prometheus`` package (installed by .ci/run); the promtool checks
skip where it is absent.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from ._promql import (
    ALERT_TESTS,
    ALERTS,
    alert_rules,
    dashboard,
    dashboard_queries,
    metric_names,
    variable_metrics,
    without_threshold,
)

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (Debian: apt-get install prometheus)"
)
#: what the rules must watch, by alert name
WATCHED = {
    "FleetgateNoLeader",
    "FleetgateGateStuckAtFloor",
    "FleetgateFallback",
    "FleetgateLeaseLost",
    "FleetgateScrapeFailing",
}


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)


@needs_promtool
def test_promtool_check_rules() -> None:
    done = promtool("check", "rules", str(ALERTS))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in done.stdout


@needs_promtool
def test_promtool_unit_tests_of_the_rules() -> None:
    done = promtool("test", "rules", str(ALERT_TESTS))
    assert done.returncode == 0, done.stdout + done.stderr


@needs_promtool
def test_promtool_refuses_a_broken_rule(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yml"
    bad.write_text(ALERTS.read_text().replace("sum(fleetgate_coordinator_leader)", "sum(", 1))
    assert promtool("check", "rules", str(bad)).returncode != 0


def test_the_rules_watch_what_they_must_and_say_how_bad() -> None:
    rules = alert_rules()
    assert WATCHED <= {r["alert"] for r in rules}
    for rule in rules:
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, rule["alert"]  # type: ignore[index]
        assert {"summary", "description"} <= set(rule["annotations"]), rule["alert"]  # type: ignore[arg-type]


def test_the_dashboard_is_well_formed() -> None:
    dash = dashboard()
    panels = dash["panels"]
    assert isinstance(panels, list)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    variables = {v["name"]: v for v in dash["templating"]["list"]}  # type: ignore[index]
    assert {"datasource", "gate"} <= set(variables)
    assert variable_metrics() == {"fleetgate_coordinator_target"}
    for p in panels:
        assert {"x", "y", "w", "h"} <= set(p["gridPos"]), p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}" and t["expr"], p["title"]
    # the panels the dashboard must have, by the metrics they show
    shown = set().union(*(metric_names(e) for _, e in dashboard_queries()))
    for metric in (
        "fleetgate_coordinator_target",
        "fleetgate_coordinator_fleet_in_flight",
        "fleetgate_coordinator_running",
        "fleetgate_client_queue_depth",
        "fleetgate_client_wait_seconds_bucket",
        "fleetgate_client_rejected_total",
        "fleetgate_client_deadline_exceeded_total",
        "fleetgate_client_fallback",
        "fleetgate_coordinator_leader",
        "fleetgate_coordinator_epoch",
        "fleetgate_coordinator_scrape_errors_total",
    ):
        assert metric in shown, f"no panel shows {metric}"
    assert all("$" not in e for _, e in dashboard_queries()), "a Grafana variable left unreplaced"


@pytest.mark.parametrize(
    ("expr", "parts"),
    [
        ("a > 0", ["a"]),
        ("(sum(a) or vector(0)) < 1", ["(sum(a) or vector(0))"]),
        (
            "max by (g) (a and on (i) (b == 1)) <= on (g) c and on (g) d > 0",
            ["max by (g) (a and on (i) (b == 1))", "d"],
        ),
        ('up{job=~".*x.*"} == 0', ['up{job=~".*x.*"}']),
        ('a{l="x > y and z"} != 2 unless ignoring (i) b', ['a{l="x > y and z"}', "b"]),
        ("rate(a[5m]) / rate(b[5m]) > 0.5", ["rate(a[5m]) / rate(b[5m])"]),
    ],
)  # fmt: skip
def test_the_threshold_rule_splits_alert_expressions(expr: str, parts: list[str]) -> None:
    assert without_threshold(expr) == parts


def test_metric_names_are_found() -> None:
    expr = 'sum by (gate) (rate(fleetgate_client_granted_total{gate=~"$gate"}[5m])) + up'
    assert metric_names(expr) == {"fleetgate_client_granted_total", "up"}
