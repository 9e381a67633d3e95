"""The side-by-side driver's arithmetic (``benchmarks/versions.py``): which figures it reads
from a result JSON and how it turns runs into medians and ratios to the first ref."""

from __future__ import annotations

import math
from pathlib import Path

from benchmarks.versions import Version, flatten, summary


def test_flatten_reads_every_numeric_leaf_and_skips_the_rest() -> None:
    data = {"a": {"b": 2, "c": "text", "d": True}, "l": [1.5, {"x": 3}], "n": None}
    assert dict(flatten(data)) == {"a.b": 2.0, "l[0]": 1.5, "l[1].x": 3.0}


def _version(label: str, values: list[float]) -> Version:
    v = Version(label, label, Path("."), Path("python"))
    v.runs["uncontended"] = [{"ratio": x, "other": 1.0} for x in values]
    return v


def test_summary_takes_medians_ratios_to_the_first_ref_and_the_spread() -> None:
    base, new = _version("old", [0.8, 0.9, 1.0]), _version("new", [0.45, 0.4, 0.6])
    rows, out = summary("uncontended", [base, new])
    # only the headline figures of the benchmark ("ratio", "ratio_p50", ...), not "other"
    assert [r[0] for r in rows] == ["ratio"]
    assert out["ratio"]["median"] == {"old": 0.9, "new": 0.45}
    assert math.isclose(out["ratio"]["ratio_to_first"]["new"], 0.5)
    assert math.isclose(out["ratio"]["spread_max_over_min"], 1.5)  # new: 0.6 / 0.4
