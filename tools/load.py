"""The load generator: request loops against model servers (or simulators), each through a gate.

    fleetgate worker --redis redis://redis:6379/0 --gate bge-m3 \\
        --target-url http://vllm-embed:8000/v1 --kind vllm --rate 20 --concurrency 16

One job: run *users* (request loops) per gate, every call inside a fleet-wide permit, and count
what came back. A :class:`LoadSpec` says what to drive; it comes from the command line
(``fleetgate worker``, ``python -m fleetgate.tools.load``: docker-compose, the Prometheus test)
or, for the demo's worker pods, as JSON in ``$FLEETGATE_LOAD_SPEC`` with ``--spec-from-env``
(the environment, not argv, so ``ps`` shows no Redis URL). A request of kind

* ``completions`` (``--kind vllm``): one ``POST /v1/completions`` inside ``gate.permit()``;
* ``chat``: one ``POST /v1/chat/completions`` inside ``gate.permit()``;
* ``embed``: ``gate.map()`` over ``calls`` ``POST /v1/embeddings`` calls, ``fan`` at a time;
* ``rerank``: ``gate.map()`` over ``calls`` ``POST /v1/ranking`` batches of ``passages``.

A gate's users share one schedule of ``rate`` starts per second (0: back to back, with a pause of
0.2 s after a failure so a server that is down is not spun on). Outcomes (``ok``, ``overloaded``,
``deadline``, ``http_<code>``, ``transport``, else the exception's name) are counted in
``fleetgate_worker_requests_total{gate,outcome}`` next to the client metrics (served on
``--metrics-listen``), logged every ``--log-interval`` and, for the demo, written to a JSON stats
file every second. Stops on SIGTERM/SIGINT, after ``duration`` or when ``parent_pid`` is gone;
what is in flight is cancelled and its permits released.

This module is the command line; the spec types are in ``_load_spec.py``, the request loops in
``_load_run.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import sys
from collections.abc import Sequence

import msgspec

from fleetgate.tools._load_run import Load, log, outcome_of, run
from fleetgate.tools._load_spec import SPEC_ENV, GateLoad, Kind, LoadSpec, WorkerStats

__all__ = [
    "SPEC_ENV",
    "GateLoad",
    "Kind",
    "Load",
    "LoadSpec",
    "WorkerStats",
    "build_parser",
    "main",
    "outcome_of",
    "run",
]

CLI_KINDS: dict[str, Kind] = {"vllm": "completions", "chat": "chat", "rerank": "rerank"}


def _listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {value!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def build_parser() -> argparse.ArgumentParser:
    """The ``fleetgate worker`` argument parser."""
    p = argparse.ArgumentParser(
        prog="fleetgate worker",
        description="Requests to model servers (or simulators) through fleet gates: --concurrency "
        "loops per gate share one schedule of --rate starts per second. A 'vllm' request is one "
        "POST /v1/completions inside gate.permit(), a 'chat' request one POST "
        "/v1/chat/completions (both streamed with --stream); a 'rerank' request is --passages "
        "passages cut into --batch-size batches, sent as POST /v1/ranking calls through "
        "gate.map(). Give "
        "--gate, --target-url and --kind once per gate (one --kind applies to all). Stops on "
        "SIGTERM/SIGINT or after --duration, releasing its permits.",
    )
    p.add_argument("--gate", action="append", required=True, metavar="NAME", help="gate name")
    p.add_argument(
        "--target-url",
        action="append",
        required=True,
        metavar="URL",
        help="the server's base URL, e.g. http://vllm-embed:8000/v1 (/v1 is added when missing)",
    )
    p.add_argument(
        "--kind", action="append", choices=list(CLI_KINDS), help="server kind (default: vllm)"
    )
    env = os.environ.get
    redis_url, prefix = (
        env("FLEETGATE_REDIS_URL") or "redis://127.0.0.1:6379/0",
        env("FLEETGATE_PREFIX") or "fg",
    )
    for flag, kind, default, meta, text in (
        ("--redis", str, redis_url, "URL", "Redis URL; env FLEETGATE_REDIS_URL"),
        ("--prefix", str, prefix, "P", "key prefix; env FLEETGATE_PREFIX"),
        ("--floor", int, 1, "N", "gate floor registered if Redis has no config for it yet"),
        ("--rate", float, 10.0, "R", "requests started per second per gate, 0 = no pacing"),
        ("--concurrency", int, 8, "C", "request loops = most requests in flight per gate"),
        ("--duration", float, 0.0, "S", "stop after S seconds, 0 = at SIGTERM/SIGINT"),
        ("--deadline", float, 30.0, "S", "total deadline of one request, queue wait included"),
        ("--passages", int, 64, "N", "rerank: passages per request"),
        ("--batch-size", int, 16, "N", "rerank: passages per call"),
        ("--metrics-listen", _listen, "127.0.0.1:9100", "HOST:PORT", "where to serve /metrics"),
        ("--log-interval", float, 5.0, "S", "seconds between progress lines"),
    ):
        p.add_argument(
            flag, type=kind, default=default, metavar=meta, help=f"{text} (default: {default})"
        )
    p.add_argument(
        "--spec-from-env",
        metavar="LABEL",
        help=f"as the first option, alone: take the whole load as JSON from ${SPEC_ENV} (LABEL "
        "only names the process in ps); the demo's worker pods run so",
    )
    p.add_argument(
        "--stream",
        action="store_true",
        help="vllm, chat: ask for streamed replies (SSE) and read each to its [DONE] inside the "
        "permit, as a chat UI would",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logs")
    return p


def spec_from_args(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> LoadSpec:
    """The :class:`LoadSpec` of ``fleetgate worker``'s options (``parser.error`` when bad)."""
    if ns.spec_from_env is not None:
        parser.error("--spec-from-env comes first and alone")
    kinds = ns.kind or ["vllm"]
    kinds = kinds * len(ns.gate) if len(kinds) == 1 else kinds
    if not len(ns.gate) == len(ns.target_url) == len(kinds):
        parser.error("give --target-url (and --kind, unless one applies to all) once per --gate")
    if len(set(ns.gate)) != len(ns.gate):
        parser.error("a --gate is given twice")
    if min(ns.concurrency, ns.passages, ns.batch_size) < 1 or ns.rate < 0:
        parser.error("--concurrency, --passages and --batch-size must be >= 1, --rate >= 0")
    gates = [
        GateLoad(
            name=name,
            kind=CLI_KINDS[kind],
            url=url.rstrip("/").removesuffix("/v1"),
            floor=ns.floor,
            users=ns.concurrency,
            rate=ns.rate,
            calls=math.ceil(ns.passages / ns.batch_size),
            fan=4,
            passages=min(ns.batch_size, ns.passages),
            stream=ns.stream,
        )
        for name, url, kind in zip(ns.gate, ns.target_url, kinds, strict=True)
    ]
    return LoadSpec(
        redis_url=ns.redis,
        prefix=ns.prefix,
        gates=gates,
        deadline=ns.deadline,
        retry=True,
        duration=ns.duration,
        metrics_listen=ns.metrics_listen,
        log_interval=ns.log_interval,
    )


def _spec_from_env() -> LoadSpec | None:
    raw = os.environ.get(SPEC_ENV)
    if not raw:
        print(f"fleetgate worker: ${SPEC_ENV} is not set", file=sys.stderr)
        return None
    return msgspec.json.decode(raw, type=LoadSpec)


def main(argv: Sequence[str] | None = None) -> int:
    """``fleetgate worker``: parse ``argv`` (None = ``sys.argv[1:]``), run, return the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--spec-from-env"]:
        from_env = _spec_from_env()
        if from_env is None:
            return 2
        spec, verbose = from_env, False
    else:
        parser = build_parser()
        ns = parser.parse_args(argv)
        spec, verbose = spec_from_args(parser, ns), ns.verbose
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.DEBUG if verbose else logging.WARNING)
    try:
        asyncio.run(run(spec))
    except OSError as exc:  # e.g. the metrics port is taken
        log.error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
