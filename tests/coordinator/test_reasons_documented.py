"""Every reason a step can give (the ``reason`` label of the decisions metric) is in the README."""

from __future__ import annotations

from fleetgate.coordinator.control import Reason

from .._tree import ROOT


def test_every_reason_is_documented() -> None:
    readme = (ROOT / "README.md").read_text()
    missing = [r.value for r in Reason if f"`{r.value}`" not in readme]
    assert not missing, f"README.md does not name the reasons {missing}"


def test_every_token_budget_reason_is_documented() -> None:
    """The token budget's reasons (``_token_decisions_total``) are in docs/aimd.md's table."""
    from fleetgate.coordinator.token_tuning import TokenReason

    doc = (ROOT / "docs" / "aimd.md").read_text()
    missing = [r.value for r in TokenReason if f"`{r.value}`" not in doc]
    assert not missing, f"docs/aimd.md does not name the token budget reasons {missing}"
