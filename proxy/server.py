"""Running the proxy: a fleet, the app, uvicorn on one socket, and the drain on SIGTERM.

:func:`serve` is the whole life of one proxy process: open the :class:`~fleetgate.client.Fleet`
(its client metrics and the proxy's in one registry), bind the listener, serve until told to
stop, then drain -- uvicorn stops accepting, tells keep-alive callers to close, and waits up to
``drain_seconds`` for the requests in flight (queued ones included) before cancelling the rest;
every permit is released on the way out, and the fleet leaves its wait lists and closes.

:func:`serve_in_thread` runs the same in a background thread (tests, benchmarks) and yields the
base URL once ``/healthz`` answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import sniffio
import uvicorn
from prometheus_client import CollectorRegistry

from fleetgate._redis import redact
from fleetgate.client import Fleet

from ._shared import WorkerContext
from ._timeouts import with_head_timeout
from .app import ProxyApp
from .config import ProxyConfig

__all__ = ["bind", "serve", "serve_in_thread"]

log = logging.getLogger("fleetgate.proxy")


def bind(host: str, port: int, *, reuse_port: bool = False, listen: bool = True) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: any free port). ``reuse_port``: with
    SO_REUSEPORT, one of several on the port (``--workers``); ``listen=False``: bound only (the
    port held, no connection ever queued on it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto named: asyncio sets TCP_NODELAY only on sockets whose proto is IPPROTO_TCP, and
    # without it a response written as headers + body waits out the caller's delayed ACK
    # (40 ms per keep-alive request on Linux)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    if listen:
        sock.listen(2048)
    sock.setblocking(False)
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server without its signal handling: uvicorn re-raises a captured SIGTERM once
    it has shut down, which would kill the process before the fleet releases and closes.
    :func:`serve` handles the signals itself."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def install_signal_handlers(self) -> None:  # uvicorn < 0.29
        pass


def _http_protocol() -> type[asyncio.Protocol] | str:
    """uvicorn's httptools protocol when httptools is installed (the ``fast`` extra; its C
    parser costs a fraction of h11's per request), mended
    (:class:`~._httptools.GuardedHttpTools`: the head-size guard h11 has built in, and more);
    else ``"h11"``."""
    try:
        from ._httptools import GuardedHttpTools
    except ImportError:
        return "h11"
    return GuardedHttpTools


def _handle_signals(
    server: uvicorn.Server, sigs: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)
) -> Callable[[], None]:
    """``sigs`` (SIGTERM/SIGINT) start the drain (a second one stops at once); returns the
    undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        if server.should_exit:
            server.force_exit = True
        server.should_exit = True
        log.info("fleetgate proxy: %s", sig.name)

    for sig in sigs:
        loop.add_signal_handler(sig, on_signal, sig)

    def undo() -> None:
        for sig in sigs:
            loop.remove_signal_handler(sig)

    return undo


def _uvicorn_config(app: ProxyApp, config: ProxyConfig) -> uvicorn.Config:
    settings = config.proxy
    return uvicorn.Config(
        app,
        lifespan="off",
        log_config=None,  # the CLI configures logging; uvicorn must not replace it
        access_log=False,  # the proxy writes its own, without query strings
        loop="none",  # the running one: uvloop's when the CLI found it (main.py)
        http=with_head_timeout(_http_protocol(), settings.head_timeout_s),
        ws="none",
        # a little above ours, so the app answers 431 with a JSON body; beyond, h11 answers 400
        # (httptools: 431, GuardedHttpTools)
        h11_max_incomplete_event_size=settings.max_header_bytes + 4096,
        timeout_graceful_shutdown=max(1, round(settings.drain_seconds)),
        timeout_keep_alive=75,
        server_header=False,
        date_header=False,  # the upstream's passes through; the app dates its own answers
        # the caller's address is the peer's: uvicorn would take X-Forwarded-For/-Proto from
        # any loopback caller (a sidecar's neighbours) as the truth, for the access log and
        # the X-Forwarded-For the proxy appends to
        proxy_headers=False,
    )


async def serve(
    config: ProxyConfig,
    *,
    registry: CollectorRegistry | None = None,
    sock: socket.socket | None = None,
    on_ready: Callable[[str], None] | None = None,
    stop: asyncio.Event | None = None,
    fleet_options: dict[str, Any] | None = None,
    worker: WorkerContext | None = None,
) -> None:
    """Serve ``config`` until SIGTERM/SIGINT (in the main thread) or ``stop`` is set, then drain.

    ``on_ready(url)`` is called once the listener accepts (``url`` is ``http://host:port``).
    ``worker``: this process is one worker of ``--workers N`` (:mod:`._shared`).
    """
    registry = CollectorRegistry() if registry is None else registry
    # httpcore asks sniffio which event loop runs on every lock and connection close; its
    # answer, set for this thread, skips the lookup (~3 % of the proxy's CPU per request)
    before = getattr(sniffio.thread_local, "name", None)
    sniffio.thread_local.name = "asyncio"
    # one filter object, left in place: adding it again (another proxy in the process) is a
    # no-op, and removing it would unmute a proxy still serving
    logging.getLogger("uvicorn.error").addFilter(_CUT_FILTER)
    try:
        await _serve(config, registry, sock, on_ready, stop, fleet_options, worker)
    finally:
        sniffio.thread_local.name = before


class _CutOnPurpose(logging.Filter):
    """Drops uvicorn's ERROR "ASGI callable returned without completing response.": the proxy
    ends a response early on purpose when the upstream failed mid-body (the caller must see a
    truncated body, not a complete one); its access log line says why."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != "ASGI callable returned without completing response."


_CUT_FILTER = _CutOnPurpose()


async def _serve(
    config: ProxyConfig,
    registry: CollectorRegistry,
    sock: socket.socket | None,
    on_ready: Callable[[str], None] | None,
    stop: asyncio.Event | None,
    fleet_options: dict[str, Any] | None,
    worker: WorkerContext | None,
) -> None:
    host, port = config.proxy.address
    own_sock = sock is None
    sock = bind(host, port) if sock is None else sock
    bound = sock.getsockname()
    url = f"http://{'[' + bound[0] + ']' if ':' in bound[0] else bound[0]}:{bound[1]}"
    try:
        async with Fleet(
            config.redis.url,
            prefix=config.redis.prefix,
            registry=registry,
            **(fleet_options or {}),
        ) as fleet:
            app = ProxyApp(config, fleet, registry, worker=worker)
            server = _Server(_uvicorn_config(app, config))
            watcher = asyncio.ensure_future(_watch(server, app, url, on_ready, stop))
            undo = _handle_signals(server, *(() if worker is None else (worker.signals,)))
            try:
                await server.serve(sockets=[sock])
            finally:
                undo()
                watcher.cancel()
                await asyncio.gather(watcher, return_exceptions=True)
                await app.aclose()
            log.info("fleetgate proxy on %s stopped (redis %s)", url, redact(config.redis.url))
    finally:
        if own_sock:
            sock.close()


async def _watch(
    server: uvicorn.Server,
    app: ProxyApp,
    url: str,
    on_ready: Callable[[str], None] | None,
    stop: asyncio.Event | None,
) -> None:
    """Announce readiness; turn ``stop`` (or uvicorn's own exit flag) into the drain."""
    while not server.started:
        if server.should_exit:
            return
        await asyncio.sleep(0.01)
    for route in app.config.routes:
        log.info("route %s", route.describe())
    parser = "h11" if server.config.http == "h11" else "httptools"
    loop = type(asyncio.get_running_loop()).__module__.split(".")[0]
    log.info("fleetgate proxy: HTTP parser %s, %s event loop", parser, loop)
    log.info("fleetgate proxy listening on %s", url)  # the last word: the URL (demo reads it)
    if on_ready is not None:
        on_ready(url)
    while not server.should_exit:
        if stop is not None and stop.is_set():
            server.should_exit = True
            break
        app.refresh()
        await asyncio.sleep(0.05)
    app.draining = True
    log.info(
        "fleetgate proxy on %s draining: no new connections, finishing requests in flight", url
    )


@contextlib.contextmanager
def serve_in_thread(
    config: ProxyConfig,
    *,
    registry: CollectorRegistry | None = None,
    startup_timeout: float = 15.0,
    fleet_options: dict[str, Any] | None = None,
) -> Iterator[str]:
    """Run :func:`serve` on a background thread's own event loop; yield its base URL once it
    accepts; on exit, drain and join."""
    ready = threading.Event()
    urls: list[str] = []
    errors: list[BaseException] = []
    loop = asyncio.new_event_loop()
    stop: asyncio.Event | None = None

    async def main() -> None:
        nonlocal stop
        stop = asyncio.Event()

        def on_ready(url: str) -> None:
            urls.append(url)
            ready.set()

        await serve(
            config, registry=registry, on_ready=on_ready, stop=stop, fleet_options=fleet_options
        )

    def run() -> None:
        try:
            loop.run_until_complete(main())
        except BaseException as exc:
            errors.append(exc)
        finally:
            ready.set()
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    thread = threading.Thread(target=run, name="fleetgate-proxy", daemon=True)
    thread.start()
    try:
        if not ready.wait(startup_timeout) or not urls:
            raise RuntimeError(f"proxy did not start: {errors!r}")
        yield urls[0]
    finally:
        if stop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stop.set)
        thread.join(config.proxy.drain_seconds + 15)
