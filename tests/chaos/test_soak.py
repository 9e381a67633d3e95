"""The soak's quick mode (60 s) in the suite; ``python -m tests.chaos.soak --minutes 10`` is the
long mode. See ``tests/chaos/soak.py`` for the faults and the invariant."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from ._harness import figure
from .soak import SoakConfig, run_soak

pytestmark = [pytest.mark.chaos, pytest.mark.slow]


@pytest.mark.timeout(180)
def test_soak_quick(tmp_path: Path, record_property: Callable[[str, object], None]) -> None:
    summary = run_soak(SoakConfig(seconds=60.0, seed=20251129, logdir=str(tmp_path)))
    for key in (
        "seconds", "actions", "calls_at_sim", "admissions_checked", "max_running",
        "max_over_limit", "over_limit_instants", "over_limit_within_allowance",
        "violations", "caller_errors", "expired_leases", "max_exit_s",
    ):  # fmt: skip
        figure(record_property, f"soak.{key}", summary[key])
    assert sum(summary["actions"].values()) >= 12
    assert summary["violations"] == 0, summary.get("first_violations")
    assert summary["unexplained"] == [], summary["unexplained"]
    assert summary["caller_errors"] == {}
    assert summary["calls_at_sim"] > 500


@pytest.mark.timeout(200)
def test_soak_mixed_quick(tmp_path: Path, record_property: Callable[[str, object], None]) -> None:
    """The same faults (and Redis restarts) with weights 1-3, two bands, three tenants and
    tokens with resizes under a token budget: the units and the tokens running at the simulator
    stay within the limit and the budget plus the documented allowances."""
    summary = run_soak(
        SoakConfig(
            seconds=60.0, seed=20261201, logdir=str(tmp_path), mixed=True, redis_restarts=True
        )
    )
    for key in (
        "actions", "calls_at_sim", "admissions_checked", "max_running", "max_over_limit",
        "over_limit_instants", "over_limit_within_allowance", "violations", "expected_refusals",
        "max_tokens_running", "over_budget_instants", "over_budget_within_allowance",
        "token_violations", "resizes", "resizes_kept",
    ):  # fmt: skip
        figure(record_property, f"soak_mixed.{key}", summary[key])
    assert sum(summary["actions"].values()) >= 12
    assert summary["violations"] == 0, summary.get("first_violations")
    assert summary["unexplained"] == [], summary["unexplained"]
    assert summary["token_violations"] == 0, summary.get("first_token_violations")
    assert summary["tokens_unexplained"] == [], summary["tokens_unexplained"]
    assert summary["caller_errors"] == {}
    assert summary["calls_at_sim"] > 500
    # the budget bound (calls waited for tokens, not only units) and resizes ran
    assert summary["max_tokens_running"] >= summary["token_limit"] // 2
    assert summary["resizes"] > 20 and summary["resizes_kept"] > 0
