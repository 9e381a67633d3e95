"""``fleetgate demo``'s command line and its run: set up, live phase, stop, write the record."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import msgspec

from fleetgate.demo.children import Children, DemoError
from fleetgate.demo.live import LiveRun
from fleetgate.demo.picture import plot
from fleetgate.demo.plan import Setup
from fleetgate.demo.pods import read_gateway_totals, read_worker_totals
from fleetgate.demo.processes import prepare
from fleetgate.demo.report import DemoRecord, Event, GateInfo, format_summary, summarize

__all__ = ["build_parser", "main", "run"]


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The demo's argument parser."""
    p = argparse.ArgumentParser(
        prog="fleetgate demo",
        description="Run a local fleet (Redis, vLLM and reranker simulators, a leader and a "
        "standby coordinator, worker pods) for about a minute: watch the targets ramp, the "
        "leader fail over and the limits follow the servers. Writes demo.png and demo.json.",
    )
    p.add_argument(
        "--duration",
        type=_positive,
        default=60.0,
        metavar="SECONDS",
        help="seconds of load; the leader is killed halfway (default: %(default)s)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("demo-out"),
        metavar="DIR",
        help="where demo.png, demo.json, the config and the logs go (default: %(default)s)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=3,
        choices=range(1, 9),
        metavar="N",
        help="worker processes (1-8, default: %(default)s)",
    )
    p.add_argument("--quiet", action="store_true", help="print only the summary")
    return p


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _ignore_signals() -> None:
    """From here on a second Ctrl-C must not cut the cleanup short (it would leave orphans)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


def _say(quiet: bool, text: str) -> None:
    if not quiet:
        print(text, flush=True)


def _finish(rec: DemoRecord, out: Path, quiet: bool) -> None:
    """Write demo.json and demo.png and print the summary (whatever was recorded)."""
    rec.summary = summarize(rec)
    (out / "demo.json").write_bytes(msgspec.json.format(msgspec.json.encode(rec), indent=2))
    if rec.samples:
        try:
            plot(rec, out / "demo.png")
        except ImportError:
            print("demo.png skipped: matplotlib is missing (pip install 'fleetgate[bench]')")
    print(format_summary(rec, out), flush=True)


def _start_record(args: argparse.Namespace, setup: Setup, children: Children) -> DemoRecord:
    return DemoRecord(
        started_at=time.time(),
        duration=args.duration,
        redis=setup.redis_label,
        prefix=setup.prefix,
        gates=[GateInfo(**g) for g in setup.gates],
        pids=children.pids(),
        stamp=setup.stamp,
    )


def _stop(args: argparse.Namespace, children: Children, rec: DemoRecord | None) -> None:
    """Stop every child (workers first, so they release their permits), signals ignored."""
    _ignore_signals()
    if rec is not None:
        t = rec.samples[-1].t if rec.samples else 0.0
        text = "stopping workers, coordinators, simulators"
        rec.events.append(Event(t=t, kind="stop", text=text))
    _say(args.quiet, "\nstopping: workers, coordinators, simulators, redis ...")
    children.stop_all()


def run(args: argparse.Namespace) -> int:
    """Set up the fleet, run the live phase, tear everything down; return the exit code."""
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    external = os.environ.get("FLEETGATE_REDIS_URL") or None
    prefix = f"demo-{uuid.uuid4().hex[:8]}" if external else "fg"
    children = Children(out / "logs")
    rec: DemoRecord | None = None
    setup: Setup | None = None
    code = 0
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        setup = prepare(args, out, children, external, prefix, lambda s: _say(args.quiet, s))
        rec = _start_record(args, setup, children)
        live = LiveRun(args, rec, children, setup, tty=sys.stdout.isatty())
        asyncio.run(live.run())
        rec.interrupted = live.interrupted
        code = 130 if live.interrupted else 0
    except KeyboardInterrupt:
        code = 130
        if rec is not None:
            rec.interrupted = True
        print("\ninterrupted: stopping everything", file=sys.stderr, flush=True)
    except DemoError as exc:
        code = 1
        print(f"fleetgate demo: {exc}", file=sys.stderr, flush=True)
    finally:
        _stop(args, children, rec)
        if rec is not None and setup is not None:
            rec.workers = read_worker_totals(setup.stats_paths)
            gateway = read_gateway_totals(setup.gateway_path)
            if gateway:
                rec.workers["gateway"] = gateway
    if rec is not None:
        _finish(rec, out, args.quiet)
    bad = children.survivors()
    if bad:
        print(f"fleetgate demo: processes still alive: {bad}", file=sys.stderr)
        code = code or 1
    return code


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m fleetgate.demo`` and ``fleetgate demo``; returns the exit code."""
    args = build_parser().parse_args(argv)
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return run(args)
    except Exception:
        # Children are already stopped (run's finally); report the bug and fail.
        import traceback

        traceback.print_exc()
        return 1
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        with contextlib.suppress(Exception):
            sys.stdout.flush()


if __name__ == "__main__":
    raise SystemExit(main())
