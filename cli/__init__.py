"""The ``fleetgate`` command line: one parser, one function per subcommand, the exit codes.

    fleetgate coordinator --config FILE     run the coordinator daemon (leader or standby)
    fleetgate status [--json] [--watch]     leader, epoch and one line per gate (+ its queue)
    fleetgate inspect GATE                  units, lanes and their heads, holders, config
    fleetgate check                         health check: exit 0 if Redis is usable
    fleetgate init --prefix P               stamp a new prefix: its first permits skip the fence
    fleetgate proxy --config FILE           gateway mode: an HTTP proxy taking a permit per request
    fleetgate sim vllm|rerank ...           model-server simulators for tests, demo, compose
    fleetgate worker ...                    the load generator (docker-compose's workers)
    fleetgate demo ...                      the README's demo

This module is the application layer on top of everything else, the one place in
``fleetgate/`` allowed to import the coordinator, the demo and the tools (``tests/
test_layers.py`` says so); it imports each lazily, inside the subcommand that runs it, so
``fleetgate status`` never loads the coordinator and ``fleetgate coordinator`` never loads the
simulators. The read-only commands themselves are core (:mod:`fleetgate.commands`).

The library only names its loggers; logging is configured here (``-v``, ``--log-config``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import logging.config
import sys
from collections.abc import Callable, Sequence

from redis.exceptions import RedisError

from fleetgate import __version__
from fleetgate.configfile import redis_from_env
from fleetgate.errors import ConfigError, FleetgateError

__all__ = ["build_parser", "main", "resolve_redis"]

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2  # as in fleetgate.commands


def _redis_flags(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--redis and --prefix, in one order for every command: flag, environment, file, default."""
    p.add_argument(
        "--redis",
        metavar="URL",
        help="Redis URL (default: $FLEETGATE_REDIS_URL, else the config file's [redis] url, "
        "else redis://127.0.0.1:6379/0)",
    )
    p.add_argument(
        "--prefix",
        metavar="P",
        help="key prefix (default: $FLEETGATE_PREFIX, else the config file's, else 'fg')",
    )


def _redis_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("redis")
    _redis_flags(g)
    g.add_argument("--config", metavar="FILE", help="coordinator TOML config to take them from")


def _logging_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logs (-vv: debug)")
    p.add_argument(
        "--log-config", metavar="FILE", help="logging configuration file (logging.config format)"
    )


def _add_coordinator(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "coordinator",
        help="run the coordinator daemon",
        description="Run the coordinator: elect one leader through Redis, scrape each adaptive "
        "gate's /metrics, run AIMD and publish targets; standbys wait and take over when the "
        "leader's lease lapses. Stops cleanly on SIGTERM/SIGINT, releasing leadership at once.",
    )
    p.add_argument("--config", required=True, metavar="FILE", help="TOML config file")
    p.add_argument("--id", metavar="ID", help="coordinator id (default: host-pid-random)")
    _redis_flags(p)
    _logging_options(p)


def _add_status(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "status",
        help="leader, epoch and one line per gate",
        description="Show the leader, the epoch and per gate: limit, target, epoch, units "
        "held/limit, leases in flight, queued, saturated, last poll, schema; under a gate with "
        "waiters its queue per priority band (and whom a band's free units are kept for) and "
        "per tenant.",
    )
    _redis_options(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--tenants",
        type=int,
        default=5,
        metavar="N",
        help="tenants listed per gate, the largest queues first; the rest are summed as "
        "'other' (default 5)",
    )
    p.add_argument(
        "--watch",
        nargs="?",
        const=1.0,
        type=float,
        metavar="SECONDS",
        help="refresh every SECONDS (default 1) until Ctrl-C",
    )
    _logging_options(p)


def _add_inspect(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "inspect",
        help="one gate in detail",
        description="Show one gate: units held/limit, config, target, counters, its lanes "
        "(priority, tenant) in the order they are served with their head waiters, and holders. "
        "Exits 1 when Redis holds nothing of GATE and the registry does not list it (a typo, "
        "or another --prefix): the message names the registered gates.",
    )
    p.add_argument("gate", help="gate name")
    _redis_options(p)
    p.add_argument(
        "-n",
        type=int,
        default=10,
        help="lanes, waiters and holders to list (default 10, at most 1000; 0 = only the counts)",
    )
    p.add_argument("--json", action="store_true", help="print the raw snapshot as JSON")
    _logging_options(p)


def _add_check(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "check",
        help="health check (exit code 0 if Redis is usable)",
        description="Connect to Redis and check: version >= 7.0, maxmemory-policy noeviction "
        "(evicted semaphore keys would reset the cap), connected to a primary, the commands "
        "fleetgate sends allowed (Functions: FUNCTION LOAD and FCALL; EVALSHA for the "
        "coordinator; sharded pub/sub on Cluster; CLIENT SETINFO; commands of 3,999 "
        "arguments), each probed as fleetgate sends it (it loads fleetgate's Functions "
        "library, as any client does), and fleetgate's keys under the prefix hold the right "
        "types and numbers. Replicas are reported (a failover can lose recent grants). Exit 0 "
        "when healthy, 1 on any error; warnings and notes (a refused command fleetgate does "
        "without) keep 0.",
    )
    _redis_options(p)
    _logging_options(p)


def _add_init(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "init",
        help="stamp a new prefix, so that its first permits skip the recovery fence",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Stamp the prefix as deliberately new. Inside Redis a new prefix looks like a\n"
        "wiped one (no state), so the first permit of each gate waits one registration\n"
        "period (~3 s: the recovery fence), in case pods still run work the lost state\n"
        "counted. After init it is granted at once. A wipe (FLUSHALL, FLUSHDB, a\n"
        "restart without persistence, a failover to an empty replica) removes the stamp\n"
        "with the state, so the fence holds again then.\n\n"
        "Run it once, before any pod or coordinator uses the prefix. A stamped prefix\n"
        "is left as it is (exit 0); a prefix in use (its registry, a leader, a birth mark,\n"
        "a named gate's keys) is refused (exit 1, nothing written): a Redis that lost its\n"
        "state and was written to since looks the same, and the fence then protects the\n"
        "work still running. On Redis Cluster a gate's script reaches only its own slot,\n"
        "so the stamp is per gate: name the gates with --gate, or give the coordinator's\n"
        "--config to stamp its gates (exit 2 without either); a gate added later pays the\n"
        "fence once.\n"
        "See docs/failure-modes.md.",
        epilog="examples:\n"
        "  fleetgate init --prefix fg\n"
        "  fleetgate init --redis 'redis://c1:7000/0?cluster=1' --gate chat --gate embed\n"
        "  fleetgate init --config coordinator.toml   # its Redis, prefix and gates",
    )
    _redis_options(p)
    p.add_argument(
        "--gate",
        action="append",
        default=[],
        metavar="NAME",
        help="a gate to stamp by itself (repeat; required on Cluster, optional elsewhere)",
    )
    _logging_options(p)


def _positive_int(text: str) -> int:
    """``--workers``: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1, got {value}")
    return value


def _add_proxy(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "proxy",
        help="gateway mode: an HTTP reverse proxy taking a fleet-wide permit per request",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Forward HTTP requests to model servers, each inside a permit of its\n"
        "route's gate: callers in any language get the fleet-wide cap, queue bound, deadline,\n"
        "priority and tenant by pointing their base URL at the proxy.\n\n"
        "Request headers X-Fleetgate-Priority, X-Fleetgate-Tenant, X-Fleetgate-Weight and\n"
        "X-Fleetgate-Deadline-Ms are honoured within the route's allowed values and never\n"
        "forwarded. A full wait list answers 429 with Retry-After, a deadline spent queued 504,\n"
        "both with a JSON body naming the gate; upstream answers pass through unchanged.\n"
        "The proxy serves /metrics and /healthz itself. SIGTERM stops accepting and drains\n"
        "the requests in flight. Gate settings come from Redis (the coordinator's config);\n"
        "without a coordinator, --floor (the cap, default 1) and --max-queued set the one\n"
        "route's gate where Redis holds no settings for it yet.\n\n"
        "--workers N runs N worker processes under one parent, for a machine's cores: each\n"
        "has its own listening socket on the one port (SO_REUSEPORT: the kernel spreads\n"
        "connections over them) and its own Fleet (its own Redis connections and heartbeat).\n"
        "/metrics and /healthz, answered by any worker, cover all of them. SIGTERM to the\n"
        "parent drains every worker; a worker that dies is logged and replaced (more than 5\n"
        "deaths within 60 s: the proxy stops, exit 1).",
        epilog="examples:\n"
        "  fleetgate proxy --upstream http://reranker:8000 --gate rerank --listen 0.0.0.0:8080\n"
        "  fleetgate proxy --config proxy.toml   # routes by path and model; see\n"
        "                                        # proxy/example.toml\n"
        "  curl -H 'X-Fleetgate-Deadline-Ms: 5000' http://127.0.0.1:8080/v1/ranking -d @req.json",
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="proxy TOML: [proxy], [redis] and [[routes]] (path and/or model -> upstream, gate)",
    )
    p.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help="address to listen on (default: the config's, else 127.0.0.1:8080; port 0 = any)",
    )
    p.add_argument(
        "--workers",
        metavar="N",
        type=_positive_int,
        help="worker processes sharing the listening port, one Fleet each (default: the "
        "config's [proxy] workers, else 1: one process)",
    )
    p.add_argument("--upstream", metavar="URL", help="one route: forward every path to URL")
    p.add_argument("--gate", metavar="NAME", help="one route: the gate of every request")
    for flag, meaning in _ONE_ROUTE_GATE_FLAGS:
        p.add_argument(flag, metavar="N", type=int, help=f"one route: the gate's {meaning}")
    _redis_flags(p)
    _logging_options(p)


#: ``fleetgate proxy``'s one-route gate settings: registered only if Redis has none, as a
#: route's ``gate_defaults`` (a coordinator's config, when one runs, is what counts).
_ONE_ROUTE_GATE_FLAGS = (
    ("--floor", "cap without a coordinator's target (default 1: one call at a time)"),
    ("--ceiling", "most a coordinator's target may set (default 512, never below the floor)"),
    ("--max-queued", "fleet-wide wait list bound (default 1000; beyond it 429)"),
)


def _add_passthrough(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """sim, worker, demo: their options belong to their own parsers (see :data:`PASSTHROUGH`);
    these entries give them a line in ``fleetgate --help``."""
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


def build_parser() -> argparse.ArgumentParser:
    """The ``fleetgate`` argument parser (sim, worker and demo pass their options on)."""
    parser = argparse.ArgumentParser(
        prog="fleetgate",
        description="Fleet-wide concurrency gates for model servers, coordinated through Redis.",
    )
    parser.add_argument("--version", action="version", version=f"fleetgate {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    adders = (_add_coordinator, _add_status, _add_inspect, _add_check, _add_init, _add_proxy)
    for add in (*adders, _add_passthrough):
        add(sub)
    return parser


def _setup_logging(args: argparse.Namespace) -> None:
    if getattr(args, "log_config", None):
        logging.config.fileConfig(args.log_config, disable_existing_loggers=False)
        return
    level = {0: logging.WARNING, 1: logging.INFO}.get(getattr(args, "verbose", 0), logging.DEBUG)
    if args.command in ("coordinator", "proxy"):  # daemons: their INFO lines (access log) show
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
    return redis_from_env(url, prefix)


def _coordinator(args: argparse.Namespace) -> int:
    from fleetgate.coordinator.daemon import run_coordinator

    return int(
        run_coordinator(args.config, coordinator_id=args.id, redis=args.redis, prefix=args.prefix)
    )


def _status(args: argparse.Namespace) -> int:
    from fleetgate import commands

    url, prefix = resolve_redis(args)
    return asyncio.run(
        commands.status(url, prefix, as_json=args.json, watch=args.watch, tenants=args.tenants)
    )


def _inspect(args: argparse.Namespace) -> int:
    from fleetgate import commands

    url, prefix = resolve_redis(args)
    return asyncio.run(commands.inspect(url, prefix, args.gate, args.n, as_json=args.json))


def _check(args: argparse.Namespace) -> int:
    from fleetgate import commands

    url, prefix = resolve_redis(args)
    return asyncio.run(commands.check(url, prefix))


def _init(args: argparse.Namespace) -> int:
    from fleetgate.stamp import init_prefix

    url, prefix = resolve_redis(args)
    gates = list(args.gate)
    if args.config:  # a coordinator's config: its gates too (Cluster needs their names)
        from fleetgate.coordinator.config import load_config

        gates += [g.name for g in load_config(args.config).gates if g.name not in gates]
    outcome = asyncio.run(init_prefix(url, prefix, gates=gates))
    print(outcome.message(), file=sys.stdout if outcome.ok else sys.stderr)
    if outcome.ok:
        return EXIT_OK
    return EXIT_USAGE if outcome.result == "needs_gates" else EXIT_ERROR


def _proxy(args: argparse.Namespace) -> int:
    try:
        from fleetgate.proxy.main import run_proxy
    except ImportError as exc:  # the extra is not installed
        print(
            f"fleetgate proxy: {exc}; install the extra: pip install 'fleetgate[proxy]'",
            file=sys.stderr,
        )
        return EXIT_ERROR
    return run_proxy(args)


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "coordinator": _coordinator,
    "status": _status,
    "inspect": _inspect,
    "check": _check,
    "init": _init,
    "proxy": _proxy,
}


def _worker(argv: list[str]) -> int:
    from fleetgate.tools import load

    return load.main(argv)


def _demo(argv: list[str]) -> int:
    from fleetgate import demo

    return demo.main(argv)


def _sim(argv: list[str]) -> int | None:
    if argv[:1] == ["vllm"]:
        from fleetgate.tools.sim import vllm

        return vllm.main(argv[1:])
    if argv[:1] == ["rerank"]:
        from fleetgate.tools.sim import rerank

        return rerank.main(argv[1:])
    return None  # no simulator named: the main parser explains


# Commands whose options belong to another module's parser (so their --help is theirs).
PASSTHROUGH: dict[str, Callable[[list[str]], int | None]] = {
    "worker": _worker,
    "demo": _demo,
    "sim": _sim,
}


def _run(args: argparse.Namespace) -> int:
    """Run one parsed command; fleetgate's errors become one line and an exit code."""
    try:
        return COMMANDS[args.command](args)
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


def main(argv: Sequence[str] | None = None) -> int:
    """``fleetgate``: parse ``argv`` (None = ``sys.argv[1:]``), run, return the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough = PASSTHROUGH.get(argv[0]) if argv else None
    code = passthrough(argv[1:]) if passthrough is not None else None
    if code is not None:
        return code
    args = build_parser().parse_args(argv)
    _setup_logging(args)
    return _run(args)
