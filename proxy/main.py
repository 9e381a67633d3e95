"""``fleetgate proxy``'s run: the configuration from ``--config`` and the flags, then serve."""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
from collections.abc import Coroutine
from typing import Any

from fleetgate.errors import ConfigError

from .config import ProxyConfig, load_config, one_route
from .server import serve

__all__ = ["config_from_args", "run", "run_proxy"]

_GATE_FIELD = re.compile(r"routes\[0\]\.gate_defaults: gate '[^']*': (\w+): ")


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    """``--config FILE`` (with ``--listen``/``--redis``/``--prefix``/``--workers`` over its
    values), or the one route of ``--upstream URL --gate NAME``."""
    one = (args.upstream, args.gate)
    workers = getattr(args, "workers", None)
    defaults = {
        name: value
        for name in ("floor", "ceiling", "max_queued")
        if (value := getattr(args, name, None)) is not None
    }
    if args.config:
        if any(one):
            raise ConfigError(
                "--upstream/--gate define a route of their own: put it in the --config file's "
                "[[routes]] instead"
            )
        if defaults:
            raise ConfigError(
                "--floor/--ceiling/--max-queued belong to the one route of --upstream/--gate: "
                "with --config, set them in the route's gate_defaults"
            )
        return load_config(args.config).with_overrides(
            listen=args.listen, redis=args.redis, prefix=args.prefix, workers=workers
        )
    if not all(one):
        raise ConfigError("give --config FILE, or both --upstream URL and --gate NAME")
    try:
        return one_route(
            upstream=args.upstream,
            gate=args.gate,
            listen=args.listen,
            redis=args.redis,
            prefix=args.prefix,
            workers=workers,
            gate_defaults=defaults,
        )
    except ConfigError as exc:  # name the flag, not the TOML field
        text = _GATE_FIELD.sub(lambda m: "--" + m[1].replace("_", "-") + ": ", str(exc))
        text = text.replace("routes[0].upstream", "--upstream")
        text = text.replace("routes[0].gate", "--gate").replace("proxy.listen", "--listen")
        text = text.replace("redis.url", "--redis").replace("redis.prefix", "--prefix")
        raise ConfigError(text) from None


def run(main: Coroutine[Any, Any, None]) -> None:
    """On uvloop's event loop when it is installed (the ``fast`` extra), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)


def run_proxy(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; 0 after a clean drain. With ``workers`` > 1, this process
    supervises that many worker processes (:func:`~.workers.supervise`)."""
    config = config_from_args(args)

    def ready(url: str) -> None:
        print(f"fleetgate proxy: listening on {url}", flush=True)

    try:
        if config.proxy.workers > 1:
            from .workers import supervise

            return supervise(config, ready, log_config=getattr(args, "log_config", None))
        run(serve(config, on_ready=ready))
    except OSError as exc:  # the listen address is taken or not ours
        print(f"fleetgate proxy: cannot listen on {config.proxy.listen}: {exc}", file=sys.stderr)
        return 1
    return 0
