"""Every reason a step can give (the ``reason`` label of the decisions metric) is in the README."""

from __future__ import annotations

from fleetgate.coordinator.control import Reason

from .._tree import ROOT


def test_every_reason_is_documented() -> None:
    readme = (ROOT / "README.md").read_text()
    missing = [r.value for r in Reason if f"`{r.value}`" not in readme]
    assert not missing, f"README.md does not name the reasons {missing}"
