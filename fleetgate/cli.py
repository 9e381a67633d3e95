"""The ``fleetgate`` command line.

    fleetgate coordinator --config FILE     run the coordinator daemon (leader or standby)
    fleetgate status [--json] [--watch]     leader, epoch and one line per gate
    fleetgate inspect GATE                  holders, head waiters, config and counters of a gate
    fleetgate check                         health check: exit 0 if Redis is usable
    fleetgate sim vllm|rerank ...           model-server simulators for tests, demo, compose

The library only names its loggers; logging is configured here (``-v``, ``--log-config``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import logging.config
import os
import sys
import time
from collections.abc import Sequence

import msgspec
from redis.exceptions import RedisError

from fleetgate import __version__
from fleetgate._redis import connect, prepare, redact, scrub
from fleetgate.errors import ConfigError, FleetgateError

__all__ = ["main"]

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2


def _redis_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("redis")
    g.add_argument(
        "--redis",
        metavar="URL",
        help="Redis URL (default: $FLEETGATE_REDIS_URL, else the --config file's [redis] url, "
        "else redis://127.0.0.1:6379/0)",
    )
    g.add_argument(
        "--prefix",
        metavar="P",
        help="key prefix (default: $FLEETGATE_PREFIX, else the config file's, else 'fg')",
    )
    g.add_argument("--config", metavar="FILE", help="coordinator TOML config to take them from")


def _logging_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logs (-vv: debug)")
    p.add_argument(
        "--log-config", metavar="FILE", help="logging configuration file (logging.config format)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fleetgate",
        description="Fleet-wide concurrency gates for model servers, coordinated through Redis.",
    )
    parser.add_argument("--version", action="version", version=f"fleetgate {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "coordinator",
        help="run the coordinator daemon",
        description="Run the coordinator: elect one leader through Redis, scrape each adaptive "
        "gate's /metrics, run AIMD and publish targets; standbys wait and take over when the "
        "leader's lease lapses. Stops cleanly on SIGTERM/SIGINT, releasing leadership at once.",
    )
    p.add_argument("--config", required=True, metavar="FILE", help="TOML config file")
    p.add_argument("--id", metavar="ID", help="coordinator id (default: host-pid-random)")
    _logging_options(p)

    p = sub.add_parser(
        "status",
        help="leader, epoch and one line per gate",
        description="Show the leader, the epoch and per gate: limit, target, epoch, fleet "
        "in-flight, queued, saturated, last poll.",
    )
    _redis_options(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--watch",
        nargs="?",
        const=1.0,
        type=float,
        metavar="SECONDS",
        help="refresh every SECONDS (default 1) until Ctrl-C",
    )
    _logging_options(p)

    p = sub.add_parser(
        "inspect",
        help="one gate in detail",
        description="Show one gate: config, target, holders, head waiters and counters.",
    )
    p.add_argument("gate", help="gate name")
    _redis_options(p)
    p.add_argument(
        "-n",
        type=int,
        default=10,
        help="holders and waiters to list (default 10, at most 1000; 0 = only the counts)",
    )
    p.add_argument("--json", action="store_true", help="print the raw snapshot as JSON")
    _logging_options(p)

    p = sub.add_parser(
        "check",
        help="health check (exit code 0 if Redis is usable)",
        description="Connect to Redis and check: version >= 6.2, maxmemory-policy noeviction "
        "(evicted semaphore keys would reset the cap), connected to a primary, and fleetgate's "
        "keys under the prefix hold the right types and numbers. Replicas are reported (a "
        "failover can lose recent grants). Exit 0 when healthy, 1 on any error.",
    )
    _redis_options(p)
    _logging_options(p)

    p = sub.add_parser(
        "sim",
        help="run a model-server simulator",
        description="Simulators standing in for GPUs: 'vllm' (OpenAI API + vLLM /metrics) and "
        "'rerank' (NIM-like /v1/ranking). Run 'fleetgate sim vllm --help' for options.",
    )
    p.add_argument("kind", choices=["vllm", "rerank"], help="which simulator")
    p.add_argument("args", nargs=argparse.REMAINDER, help="options of that simulator")

    p = sub.add_parser(
        "worker",
        help="run a load-generating worker through the fleet gates",
        description="A worker process driving requests to model servers through fleet gates "
        "(used by docker-compose and the Prometheus test). Run 'fleetgate worker --help'.",
        add_help=False,
    )
    p.add_argument("args", nargs=argparse.REMAINDER, help="worker options")

    p = sub.add_parser(
        "demo",
        help="run the local demo (private redis, simulators, coordinators, workers)",
        description="The README's demo. Run 'fleetgate demo --help' for options.",
        add_help=False,
    )
    p.add_argument("args", nargs=argparse.REMAINDER, help="demo options")
    return parser


def _setup_logging(args: argparse.Namespace) -> None:
    if getattr(args, "log_config", None):
        logging.config.fileConfig(args.log_config, disable_existing_loggers=False)
        return
    level = {0: logging.WARNING, 1: logging.INFO}.get(getattr(args, "verbose", 0), logging.DEBUG)
    if args.command == "coordinator":
        level = min(level, logging.INFO)
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )


def resolve_redis(args: argparse.Namespace) -> tuple[str, str]:
    """Redis URL and prefix from flags, environment, config file, defaults — in that order."""
    url, prefix = args.redis, args.prefix
    if args.config and (url is None or prefix is None):
        from fleetgate.coordinator.config import load_config

        cfg = load_config(args.config)
        url = url or cfg.redis.url
        prefix = prefix or cfg.redis.prefix
    url = url or os.environ.get("FLEETGATE_REDIS_URL") or "redis://127.0.0.1:6379/0"
    prefix = prefix or os.environ.get("FLEETGATE_PREFIX") or "fg"
    return url, prefix


async def _status(args: argparse.Namespace) -> int:
    from fleetgate.status import format_status, gather_status

    url, prefix = resolve_redis(args)
    client = connect(url)
    await prepare(client)
    try:
        while True:
            status = await gather_status(client, prefix)
            if args.json:
                sys.stdout.write(msgspec.json.encode(status).decode() + "\n")
            else:
                if args.watch:
                    sys.stdout.write("\x1b[2J\x1b[H")
                sys.stdout.write(format_status(status, time.time()) + "\n")
            sys.stdout.flush()
            if not args.watch:
                return EXIT_OK
            await asyncio.sleep(args.watch)
    finally:
        await client.aclose()


async def _inspect(args: argparse.Namespace) -> int:
    from fleetgate.keys import GateKeys
    from fleetgate.scripts import GateScripts

    url, prefix = resolve_redis(args)
    client = connect(url)
    try:
        snap = await GateScripts(client).inspect(GateKeys.of(prefix, args.gate), args.n)
    finally:
        await client.aclose()
    if args.json:
        print(msgspec.json.encode(snap).decode())
        return EXIT_OK
    print(f"gate {args.gate}: limit {snap.limit} (floor {snap.floor}, ceiling {snap.ceiling})")
    print(
        f"  in-flight {snap.holders}, queued {snap.queued}/{snap.max_queued}, "
        f"live pods {snap.live_pods}"
    )
    print(f"  cfg    {snap.cfg}")
    print(f"  target {snap.target or '-'}")
    print(f"  stats  {snap.stats}")
    for h in snap.leases:
        print(f"  holder {h.id}  expires in {h.expires_at - snap.now} ms")
    for w in snap.head:
        print(f"  waiter {w.id}  seq {w.token}")
    return EXIT_OK


async def _check(args: argparse.Namespace) -> int:
    """Redis reachable, version >= 6.2, noeviction, a primary, fleetgate's keys intact.

    Exit 1 on any error-level finding (see :mod:`fleetgate.safety`); warnings (replicas
    attached, a setting that could not be read) are printed but keep exit code 0.
    """
    from fleetgate.safety import find_bad_keys, inspect_redis, redis_version

    url, prefix = resolve_redis(args)
    shown = redact(url)
    client = connect(url)
    try:
        await prepare(client)
        await client.ping()
        version = await redis_version(client)
        findings = await inspect_redis(client)
        findings += await find_bad_keys(client, prefix)
    except Exception as exc:
        # Anything redis-py raises; its text never holds the password, and scrub() makes sure.
        print(
            f"fleetgate check: Redis at {shown} unusable: {scrub(str(exc), url)}", file=sys.stderr
        )
        return EXIT_ERROR
    finally:
        await client.aclose()
    for finding in findings:
        print(f"fleetgate check: {finding.level.upper()}: {finding.message}", file=sys.stderr)
    ok = not any(f.level == "error" for f in findings)
    print(f"redis {version or '?'} at {shown} (prefix {prefix!r}): {'ok' if ok else 'NOT OK'}")
    return EXIT_OK if ok else EXIT_ERROR


def _passthrough(argv: list[str]) -> int | None:
    """Commands whose options belong to another module's parser (so their --help is theirs)."""
    if argv[:1] == ["worker"]:
        from fleetgate import worker

        return worker.main(argv[1:])
    if argv[:1] == ["demo"]:
        from fleetgate import demo

        return demo.main(argv[1:])
    if argv[:1] == ["sim"] and argv[1:2] in (["vllm"], ["rerank"]):
        if argv[1] == "vllm":
            from fleetgate.sim import vllm as sim
        else:
            from fleetgate.sim import rerank as sim  # type: ignore[no-redef]
        return sim.main(argv[2:])
    return None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    code = _passthrough(argv)
    if code is not None:
        return code
    args = build_parser().parse_args(argv)
    _setup_logging(args)
    try:
        if args.command == "coordinator":
            from fleetgate.coordinator.daemon import run_coordinator

            return int(run_coordinator(args.config, coordinator_id=args.id))
        handler = {"status": _status, "inspect": _inspect, "check": _check}[args.command]
        return asyncio.run(handler(args))
    except ConfigError as exc:
        print(f"fleetgate {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except FleetgateError as exc:
        print(f"fleetgate {args.command}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return EXIT_OK
    except (OSError, RedisError) as exc:
        # One line, never a traceback; redis-py messages carry host and port, never passwords.
        print(f"fleetgate {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
