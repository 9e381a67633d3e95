"""One worker process of ``fleetgate proxy --workers N``:
``python -m fleetgate.proxy._worker FD`` (started by :mod:`.workers`, never by hand).

The parent passes the listening socket as file descriptor ``FD`` (inherited) and writes one JSON
object to the worker's stdin (the configuration: the Redis URL may hold a password, which the
command line would show to every user of the machine): ``config``, ``via_name``, ``workers``,
``metrics_dir``, ``log_level``, ``log_config``, ``index``, ``parent`` (the parent's
pid). ``PROMETHEUS_MULTIPROC_DIR`` is already in the environment (prometheus-client reads it
when imported). The worker serves as a
single proxy does, with :class:`~._shared.WorkerContext`; once it accepts it writes ``ready`` to
stdout, then points its stdout at stderr (nobody reads the pipe after that line). SIGINT is
ignored (a Ctrl-C reaches the whole process group: the parent turns it into one SIGTERM per
worker); SIGTERM drains, a second stops at once; a worker whose parent is gone drains too.
"""

from __future__ import annotations

import asyncio
import logging
import logging.config
import os
import signal
import socket
import sys
from typing import Any

import msgspec

from ._shared import WorkerContext
from .config import ProxyConfig
from .main import run
from .server import serve

__all__ = ["main"]


async def _orphaned(parent: int, stop: asyncio.Event) -> None:
    """Set ``stop`` once this process's parent is no longer ``parent`` (it died: the worker
    is re-parented, to 1 or a subreaper), checked twice a second; a ``parent`` that was already
    gone when the worker started is seen at the first check."""
    while os.getppid() == parent:  # noqa: ASYNC110 - no event says a parent died
        await asyncio.sleep(0.5)
    logging.getLogger("fleetgate.proxy").warning("fleetgate proxy worker: the parent is gone")
    stop.set()


async def _serve(config: ProxyConfig, sock: socket.socket, worker: WorkerContext) -> None:
    stop = asyncio.Event()
    watch = asyncio.ensure_future(_orphaned(worker.parent, stop))

    def ready(url: str) -> None:
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    try:
        await serve(config, sock=sock, on_ready=ready, stop=stop, worker=worker)
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)


def main(argv: list[str] | None = None) -> int:
    """Serve the configuration read from stdin on the inherited socket; 0 after a drain."""
    args = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    brief: dict[str, Any] = msgspec.json.decode(sys.stdin.buffer.read())
    if brief.get("log_config"):
        logging.config.fileConfig(brief["log_config"], disable_existing_loggers=False)
    else:
        logging.basicConfig(
            level=int(brief["log_level"]),
            format=f"%(asctime)s %(levelname)s %(name)s[worker {brief['index']}, "
            "pid %(process)d]: %(message)s",
            stream=sys.stderr,
        )
    config = ProxyConfig.from_mapping(brief["config"], env={})
    worker = WorkerContext(
        via_name=str(brief["via_name"]),
        workers=int(brief["workers"]),
        metrics_dir=str(brief["metrics_dir"]),
        parent=int(brief["parent"]),
    )
    sock = socket.socket(fileno=int(args[0]))
    sock.setblocking(False)
    run(_serve(config, sock, worker))
    return 0


if __name__ == "__main__":
    sys.exit(main())
