"""versions: one benchmark run that measures several commits side by side, interleaved.

``python -m benchmarks.versions --refs 67c3e9a 18bddce . --pairs 3 --only peers script_cost``

A performance claim is a ratio against a baseline measured in the same run, before and after
interleaved (the machine is shared and noisy). This driver makes that the default way to compare
commits: each ref gets a git worktree and a venv of its own (under
``~/.cache/fleetgate/bench-versions/<sha>``, made once; ``.`` is this checkout as it is, with
the interpreter running the driver), and each named benchmark runs there with that ref's own
benchmark code, ``python -m benchmarks --only NAME``, in the order A B C, C B A, A B C ... (one
pair = one run of each ref in each direction, so drift in the machine's load weighs on every
ref alike). After each run the driver keeps that ref's result JSON (a full run at ``.`` writes
this checkout's ``benchmarks/results/<name>.json`` as any run does: the last run's figures).

The summary lists, per benchmark, its headline figures (:data:`HEADLINES`; every numeric figure
is kept in the JSON) as the median over runs per ref, each ref's ratio to the first ref (the
baseline), and the spread (max/min over the runs of one ref). Output:
``benchmarks/results/versions[-quick].json`` and ``.png`` (the headline ratios).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._common import RESULTS_DIR, figure, log, table

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fleetgate"
TREES = CACHE / "bench-versions"
# The figures shown per benchmark (regular expressions over the flattened JSON paths); the JSON
# keeps every numeric figure of every run.
HEADLINES: dict[str, tuple[str, ...]] = {
    "peers": (
        r"^implementations\.fleetgate\.(utilisation|lua_us_per_grant|cmds_per_grant"
        r"|client_cpu_us_per_grant|redis_cpu_us_per_grant|grants_per_s|wait_p99_vs_ideal)$",
    ),
    "throughput": (
        r"^(utilisation_client|lua_us_per_grant|all_cmds_per_grant|client_cpu_us_per_grant"
        r"|redis_cpu_us_per_grant|grants_per_s)$",
    ),
    "uncontended": (r"^ratio$", r"^ratio_p50$", r"^variants\.permit\(\)\.lua_us_per_op$"),
    "script_cost": (r"^sizes\[\d\]\.(acquire|release)[^.]*$", r"^growth\.", r"^status_growth$"),
    "handoff": (r"p50|p99",),
}


@dataclass
class Version:
    """One ref measured: where its tree and interpreter are, and its runs' figures."""

    ref: str
    label: str  # the short sha ("here" for this checkout)
    tree: Path
    python: Path
    runs: dict[str, list[dict[str, float]]] = field(default_factory=dict)


def _git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout.strip()


def prepare(ref: str) -> Version:
    """The worktree and venv of ``ref``, made on first use (``.``: this checkout as it is)."""
    if ref == ".":
        return Version(ref, "here", ROOT, Path(sys.executable))
    sha = _git("rev-parse", "--verify", f"{ref}^{{commit}}")
    tree = TREES / sha[:12]
    python = tree / ".venv" / "bin" / "python"
    if not (tree / ".git").exists():
        log(f"versions: worktree of {ref} ({sha[:12]}) at {tree}")
        TREES.mkdir(parents=True, exist_ok=True)
        _git("worktree", "add", "--detach", str(tree), sha)
    if not python.exists() or not (tree / ".venv" / ".installed").exists():
        log(f"versions: venv of {ref} (pip install -e '.[bench]', a minute or two)")
        subprocess.run([sys.executable, "-m", "venv", str(tree / ".venv")], check=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "-e", f"{tree}[bench]"], check=True
        )
        (tree / ".venv" / ".installed").touch()
    return Version(ref, sha[:7], tree, python)


def flatten(x: Any, path: str = "") -> Iterator[tuple[str, float]]:
    """Every numeric leaf of a result JSON as (dotted path, value); lists by index."""
    if isinstance(x, dict):
        for k, v in x.items():
            yield from flatten(v, f"{path}.{k}" if path else str(k))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from flatten(v, f"{path}[{i}]")
    elif isinstance(x, (int, float)) and not isinstance(x, bool):
        yield path, float(x)


def run_once(v: Version, name: str, flags: Sequence[str], suffix: str, logs: Path) -> None:
    """One run of benchmark ``name`` in ``v``'s tree; its figures appended to ``v.runs``."""
    out = logs / f"{name}-{v.label}-{len(v.runs.get(name, []))}.log"
    log(f"versions: {name} at {v.label} (log {out})")
    with out.open("w") as f:
        p = subprocess.run(
            [str(v.python), "-m", "benchmarks", "--only", name, *flags],
            cwd=v.tree,
            stdout=f,
            stderr=subprocess.STDOUT,
            env={k: val for k, val in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")},
        )
    if p.returncode != 0:
        raise SystemExit(f"versions: {name} at {v.ref} exited {p.returncode}: see {out}")
    data = json.loads((v.tree / "benchmarks" / "results" / f"{name}{suffix}.json").read_text())
    figures = {k: val for k, val in flatten(data) if not k.startswith("machine")}
    figures["machine.loadavg_1m_at_end"] = float(data["machine"].get("loadavg_1m_at_end") or 0)
    v.runs.setdefault(name, []).append(figures)


def summary(name: str, versions: Sequence[Version]) -> tuple[list[list[Any]], dict[str, Any]]:
    """Rows (figure, median per ref, ratio to the first ref, spread) of ``name``'s headlines."""
    patterns = [re.compile(p) for p in HEADLINES.get(name, (r".",))]
    base = versions[0].runs[name]
    keys = [k for k in base[0] if any(p.search(k) for p in patterns)]
    rows: list[list[Any]] = []
    out: dict[str, Any] = {}
    for k in keys:
        meds, spreads = [], []
        for v in versions:
            vals = [r[k] for r in v.runs[name] if k in r]
            meds.append(statistics.median(vals) if vals else float("nan"))
            lo = min(vals, default=0.0)
            spreads.append(max(vals) / lo if vals and lo > 0 else float("nan"))
        ratios = [m / meds[0] if meds[0] else float("nan") for m in meds]
        rows.append([k, *meds, *ratios[1:], max(spreads)])
        out[k] = {"median": dict(zip([v.label for v in versions], meds, strict=True))}
        out[k]["ratio_to_first"] = dict(zip([v.label for v in versions], ratios, strict=True))
        out[k]["spread_max_over_min"] = max(spreads)
    return rows, out


def plot(results: dict[str, dict[str, Any]], labels: Sequence[str], path: Path) -> None:
    """The headline ratios to the first ref, one bar per other ref, per figure."""
    items = [
        (f"{b}: {k}", v["ratio_to_first"]) for b, figs in results.items() for k, v in figs.items()
    ]
    fig, axes = figure()
    ax = axes[0][0]
    fig.set_size_inches(9, 0.32 * max(4, len(items)) + 1.5)
    width = 0.8 / max(1, len(labels) - 1)
    for j, label in enumerate(labels[1:]):
        ax.barh(
            [i + j * width for i in range(len(items))],
            [r[label] for _, r in items],
            height=width,
            label=f"{label} ÷ {labels[0]}",
        )
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks(
        [i + 0.4 - width / 2 for i in range(len(items))], [n for n, _ in items], fontsize=7
    )
    ax.set_xlabel("median ratio to the first ref (1 = same)")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110, bbox_inches="tight")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.versions",
        description="Run benchmarks at several commits side by side, interleaved (A B C, C B A, "
        "...); print each headline figure's median per commit and its ratio to the first.",
    )
    ap.add_argument(
        "--refs",
        nargs="+",
        required=True,
        metavar="REF",
        help="commits to compare (the first is the baseline; '.' = this checkout)",
    )
    ap.add_argument("--only", nargs="+", required=True, metavar="NAME", help="benchmarks to run")
    ap.add_argument("--pairs", type=int, default=3, help="runs of each ref in each direction")
    ap.add_argument("--quick", action="store_true", help="each benchmark's smoke mode")
    ap.add_argument("--fast", action="store_true", help="hiredis parser and uvloop in workers")
    ns = ap.parse_args(argv)
    flags = [f for f, on in (("--quick", ns.quick), ("--fast", ns.fast)) if on]
    suffix = ("-hiredis-uvloop" if ns.fast else "") + ("-quick" if ns.quick else "")
    versions = [prepare(r) for r in ns.refs]
    logs = RESULTS_DIR / "versions-logs"
    logs.mkdir(parents=True, exist_ok=True)
    for p in range(ns.pairs * 2):
        order = versions if p % 2 == 0 else versions[::-1]
        for name in ns.only:
            for v in order:
                run_once(v, name, flags, suffix, logs)
    labels = [v.label for v in versions]
    results: dict[str, dict[str, Any]] = {}
    for name in ns.only:
        rows, results[name] = summary(name, versions)
        heads = ["figure", *labels, *[f"{x}/{labels[0]}" for x in labels[1:]], "spread"]
        print(f"\n== {name}: median of {ns.pairs * 2} runs per ref ==\n" + table(heads, rows))
    stem = "versions" + suffix
    payload = {
        "refs": {v.label: v.ref for v in versions},
        "pairs": ns.pairs,
        "order": "A B C, C B A, ... per benchmark",
        "headlines": results,
        "runs": {v.label: v.runs for v in versions},
    }
    (RESULTS_DIR / f"{stem}.json").write_text(json.dumps(payload, indent=2) + "\n")
    plot(results, labels, RESULTS_DIR / f"{stem}.png")
    print(f"-> benchmarks/results/{stem}.json, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
