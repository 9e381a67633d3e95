"""Shared plumbing of the benchmarks: options, the fleet, statistics, output, the command line.

Every benchmark module exposes ``run(opts: Options) -> list[Headline]`` and leaves the shared
parts to three helpers: this module (:class:`Options`/:class:`Flavor`, :func:`open_fleet`,
:func:`percentiles`, :func:`quantile`, :func:`save` writing JSON, PNG and a table,
:func:`main`), ``_workers.py`` (spawned worker processes started at one instant) and
``_server.py`` (private redis-server, gate setup, counters and the sampling
:func:`~benchmarks._server.watch`).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import sys
import time
from collections.abc import Coroutine, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar, cast

import numpy as np

from fleetgate.client import Fleet

from ._server import PREFIX, machine

RESULTS_DIR = Path(__file__).resolve().parent / "results"
BENCHMARKS = (
    "handoff",
    "throughput",
    "uncontended",
    "script_cost",
    "burst",
    "ramp",
    "latency",
    "coordinator_scale",
    "peers",
    "pod_cost",
    "fairness",
    "proxy",
    "proxy_workers",
    "redis_memory",
    "tokens",
    "flood",
    "first_permit",
)
# Modules of benchmarks/ that drive benchmarks rather than being one (no ``run(opts)``).
DRIVERS = ("versions",)
T = TypeVar("T")
ParserName = Literal["python", "hiredis"]
LoopName = Literal["asyncio", "uvloop"]
_T0 = time.monotonic()
_LOAD_AT_START: dict[str, float] = {}

# -- options ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Flavor:
    """How worker processes talk to Redis: RESP parser and event loop.

    The default is what ``pip install fleetgate`` gets (pure-Python parser, asyncio); ``--fast``
    is ``fleetgate[fast]`` (hiredis, uvloop). redis-py picks hiredis by itself when installed, so
    the pure-Python parser is forced with ``parser_class`` (redis-py 8 speaks RESP3 by default,
    hence ``_AsyncRESP3Parser``).
    """

    parser: ParserName = "python"
    loop: LoopName = "asyncio"

    @property
    def label(self) -> str:
        return f"{self.parser}+{self.loop}"

    def redis_options(self) -> dict[str, Any]:
        from redis._parsers import _AsyncHiredisParser, _AsyncRESP3Parser

        cls = _AsyncHiredisParser if self.parser == "hiredis" else _AsyncRESP3Parser
        return {"parser_class": cls}

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` to completion on this flavor's event loop."""
        if self.loop == "uvloop":
            import uvloop

            if sys.version_info >= (3, 11):
                with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                    return runner.run(coro)
            uvloop.install()  # pragma: no cover - Python 3.10
        return asyncio.run(coro)


@dataclass(frozen=True)
class Options:
    quick: bool = False
    flavor: Flavor = field(default_factory=Flavor)

    def pick(self, full: T, quick: T) -> T:
        return quick if self.quick else full

    @property
    def suffix(self) -> str:
        fast = "" if self.flavor == Flavor() else f"-{self.flavor.label.replace('+', '-')}"
        return fast + ("-quick" if self.quick else "")


@dataclass(frozen=True)
class Headline:
    """One figure of a benchmark against its target (for the final summary table)."""

    bench: str
    figure: str
    value: str
    target: str
    met: bool | None  # None: no target


def log(msg: str) -> None:
    """A progress line on stderr."""
    print(f"[{time.monotonic() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


# -- client side -------------------------------------------------------------------------------


def open_fleet(url: str, flavor: Flavor, **kwargs: Any) -> Fleet:
    """A fleet as an application would open it, with the flavor's RESP parser."""
    from prometheus_client import CollectorRegistry

    from fleetgate._redis import split_cluster_flag

    # redis-py's cluster client takes no parser_class: it picks hiredis when installed, the
    # pure-Python RESP3 parser otherwise (the default flavor's parser when hiredis is absent).
    cluster = split_cluster_flag(url)[1]
    return Fleet(
        url,
        prefix=PREFIX,
        registry=CollectorRegistry(),
        redis_options={} if cluster else flavor.redis_options(),
        **kwargs,
    )


# -- statistics -----------------------------------------------------------------------------


def percentiles(
    values: Sequence[float] | np.ndarray, ps: Sequence[float] = (50, 99, 99.9)
) -> dict[str, float]:
    arr = np.asarray(values, dtype=float)
    if arr.size == 0:
        return {f"p{p:g}": float("nan") for p in ps}
    return {f"p{p:g}": float(np.percentile(arr, p)) for p in ps}


def quantile(xs: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of ``xs`` (0 < q < 1): the value at rank ``int(q * n)``
    of the sorted values (the flood's figures); 0.0 for no values."""
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


# -- output ---------------------------------------------------------------------------------


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def save(
    name: str,
    opts: Options,
    url: str,
    data: dict[str, Any],
    text: str,
    fig: Any = None,
) -> Path:
    """Write ``<name><suffix>.json`` (+ ``.png``) to benchmarks/results/ and print ``text``."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    stem = f"{name}{opts.suffix}"
    payload = {
        "benchmark": name,
        "quick": opts.quick,
        "flavor": asdict(opts.flavor),
        "machine": {**machine(url), "loadavg_1m_at_start": _LOAD_AT_START.get(name)},
        **data,
    }
    path = RESULTS_DIR / f"{stem}.json"
    path.write_text(json.dumps(payload, indent=2, default=float) + "\n")
    if fig is not None:
        fig.savefig(RESULTS_DIR / f"{stem}.png", dpi=110, bbox_inches="tight")
    print(f"\n== {name} ({opts.flavor.label}{', quick' if opts.quick else ''}) ==\n{text}")
    print(f"-> {path.relative_to(RESULTS_DIR.parent.parent)}", flush=True)
    return path


def figure(ncols: int = 1) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, ncols, figsize=(6.5 * ncols, 4.2), squeeze=False)


# -- command line -----------------------------------------------------------------------------


def latency_cdf(ax: Any, curves: Sequence[tuple[str, Sequence[float]]], xlabel: str) -> None:
    """On ``ax``: each (label, latencies in seconds) as the fraction of calls under a latency
    (ms, log scale)."""
    for label, latencies in curves:
        xs = sorted(x * 1000 for x in latencies)
        ax.plot(xs, [i / max(1, len(xs) - 1) for i in range(len(xs))], label=label)
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of calls")
    ax.legend()


def main(argv: Sequence[str] | None = None, only: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="fleetgate client benchmarks (see benchmarks/README.md)",
    )
    ap.add_argument("--quick", action="store_true", help="short smoke run (~10-20 s each)")
    ap.add_argument("--fast", action="store_true", help="hiredis parser and uvloop in workers")
    ap.add_argument("--parser", choices=["python", "hiredis"], help="override the RESP parser")
    ap.add_argument("--loop", choices=["asyncio", "uvloop"], help="override the event loop")
    if only is None:
        ap.add_argument(
            "--only", nargs="+", choices=BENCHMARKS, metavar="NAME", help=", ".join(BENCHMARKS)
        )
    ns = ap.parse_args(argv)
    parser = ns.parser or ("hiredis" if ns.fast else "python")
    loop = ns.loop or ("uvloop" if ns.fast else "asyncio")
    opts = Options(quick=ns.quick, flavor=Flavor(cast(ParserName, parser), cast(LoopName, loop)))
    names = list(only or ns.only or BENCHMARKS)
    heads: list[Headline] = []
    for name in names:
        load = os.getloadavg()[0]
        _LOAD_AT_START[name] = round(load, 2)
        log(
            f"{name}: start ({opts.flavor.label}{', quick' if opts.quick else ''}), load {load:.2f}"
        )
        if load > 0.5 * (os.cpu_count() or 1):
            log(f"{name}: WARNING the machine is busy (1-min load {load:.2f}): noisy figures")
        module = importlib.import_module(f"benchmarks.{name}")
        heads += module.run(opts)
        log(f"{name}: done")
    rows = [
        (h.bench, h.figure, h.value, h.target, {True: "met", False: "MISSED", None: "-"}[h.met])
        for h in heads
    ]
    print("\n== summary ==\n" + table(("bench", "figure", "value", "target", ""), rows))
    return 0
