"""Plumbing shared by the simulators: a FIFO slot limiter, JSON helpers and the uvicorn runners.

Everything here runs on the single asyncio loop that serves the app. :func:`serve_in_thread`
starts that loop in a background thread (for tests, benchmarks and the demo) and waits until the
server answers its health endpoint; :func:`run_server` runs it in the foreground (the CLI).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, NamedTuple, Protocol, TypeVar

import httpx
import msgspec
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.datastructures import State
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

__all__ = [
    "TEXT_PLAIN",
    "FifoLimiter",
    "QueueFull",
    "Resizable",
    "Served",
    "add_server_args",
    "common_routes",
    "error_response",
    "json_response",
    "read_json_object",
    "run_cli",
    "run_server",
    "run_unless_disconnected",
    "serve_in_thread",
]

T = TypeVar("T")
TEXT_PLAIN = CONTENT_TYPE_LATEST

_ENCODER = msgspec.json.Encoder()


class QueueFull(Exception):
    """Raised by :meth:`FifoLimiter.acquire` when the wait list is at its bound."""


class FifoLimiter:
    """A counting semaphore with a FIFO wait list, an optional wait-list bound and peak tracking.

    ``capacity`` may change at run time: growing it admits the head waiters at once, shrinking
    it never takes a slot away from a running holder (new grants stop until ``running`` drops
    below the new capacity). Not thread-safe: use it from the loop that serves the app.
    """

    def __init__(self, capacity: int, max_waiting: int | None = None) -> None:
        """Make ``capacity`` slots; ``max_waiting=None`` leaves the wait list unbounded."""
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        if max_waiting is not None and max_waiting < 0:
            raise ValueError("max_waiting must be >= 0 or None")
        self.capacity = capacity
        self.max_waiting = max_waiting
        self.running = 0
        self.peak_running = 0
        self.peak_in_flight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        """Number of parked acquirers."""
        return len(self._waiters)

    @property
    def in_flight(self) -> int:
        """Running plus waiting."""
        return self.running + len(self._waiters)

    async def acquire(self) -> None:
        """Take a slot, parking in FIFO order while none is free (no barging past waiters).

        Raises :class:`QueueFull` at once when a wait is needed and the list is full. Cancellation
        while parked leaves the list; cancellation racing a grant gives the slot back.
        """
        if not self._waiters and self.running < self.capacity:
            self.running += 1
            self._note_peaks()
            return
        if self.max_waiting is not None and len(self._waiters) >= self.max_waiting:
            raise QueueFull(f"wait list full ({self.max_waiting} waiting)")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self._note_peaks()
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release()  # granted just as we were cancelled: hand the slot on
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(fut)
            raise

    def release(self) -> None:
        """Give a slot back and admit head waiters while slots are free."""
        if self.running <= 0:
            raise RuntimeError("release() without a matching acquire()")
        self.running -= 1
        self._admit()

    def set_capacity(self, capacity: int) -> None:
        """Change the number of slots; growth admits waiters now, shrinkage kills nothing."""
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self._admit()

    def reset_peaks(self) -> None:
        """Restart peak tracking from the current running and in-flight counts."""
        self.peak_running = self.running
        self.peak_in_flight = self.in_flight

    def _admit(self) -> None:
        while self._waiters and self.running < self.capacity:
            fut = self._waiters.popleft()
            if fut.done():  # cancelled, its owner is on its way out
                continue
            self.running += 1
            fut.set_result(None)
        self._note_peaks()

    def _note_peaks(self) -> None:
        self.peak_running = max(self.peak_running, self.running)
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)


def json_response(body: Any, status_code: int = 200) -> Response:
    """Encode ``body`` with msgspec into an ``application/json`` response."""
    return Response(_ENCODER.encode(body), status_code=status_code, media_type="application/json")


def error_response(status_code: int, message: str, err_type: str) -> Response:
    """An OpenAI-style error body: ``{"error": {"message", "type", "param", "code"}}``."""
    body = {"error": {"message": message, "type": err_type, "param": None, "code": status_code}}
    return json_response(body, status_code)


async def read_json_object(request: Request) -> dict[str, Any] | None:
    """Decode the body as a JSON object; ``None`` when it is not valid JSON or not an object."""
    try:
        body = msgspec.json.decode(await request.body())
    except (msgspec.DecodeError, ClientDisconnect):  # a caller gone before its body: no answer
        return None
    return body if isinstance(body, dict) else None


class Resizable(Protocol):
    """What ``/admin/capacity`` and ``/admin/reset-peaks`` act on: a :class:`FifoLimiter`, or
    the vLLM simulator's KV scheduler."""

    def set_capacity(self, capacity: int) -> None: ...

    def reset_peaks(self) -> None: ...


def common_routes(
    limiter: Resizable,
    stats: Callable[[], dict[str, Any]],
    metrics: Callable[[], bytes],
    *,
    metrics_path: str | None = "/metrics",
    metrics_type: str = CONTENT_TYPE_LATEST,
) -> list[Route]:
    """``/health``, the metrics route and the ``/admin`` routes every simulator shares.

    The metrics are served at ``metrics_path`` (None: not at all, as a server without metrics)
    with Content-Type ``metrics_type``.

    ``POST /admin/capacity {"capacity": N}`` resizes ``limiter``; ``GET /admin/stats`` returns
    ``stats()``; ``POST /admin/reset-peaks`` restarts peak tracking. The admin routes answer with
    ``stats()``.
    """

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def render_metrics(request: Request) -> Response:
        return Response(metrics(), headers={"Content-Type": metrics_type})

    async def admin_capacity(request: Request) -> Response:
        body = await read_json_object(request)
        cap = body.get("capacity") if body is not None else None
        if not isinstance(cap, int) or isinstance(cap, bool) or cap < 0:
            return error_response(400, 'body must be {"capacity": <int >= 0>}', "BadRequestError")
        limiter.set_capacity(cap)
        return json_response(stats())

    async def admin_stats(request: Request) -> Response:
        return json_response(stats())

    async def admin_reset_peaks(request: Request) -> Response:
        limiter.reset_peaks()
        return json_response(stats())

    routes = [Route(metrics_path, render_metrics, methods=["GET"])] if metrics_path else []
    return [
        Route("/health", health, methods=["GET"]),
        *routes,
        Route("/admin/capacity", admin_capacity, methods=["POST"]),
        Route("/admin/stats", admin_stats, methods=["GET"]),
        Route("/admin/reset-peaks", admin_reset_peaks, methods=["POST"]),
    ]


async def run_unless_disconnected(request: Request, work: Awaitable[T]) -> tuple[bool, T | None]:
    """Run ``work`` but cancel it if the client goes away first (as vLLM aborts such requests).

    Call it after the body has been read. Returns ``(True, result)`` when the work finished, or
    ``(False, None)`` when the client disconnected first and the work was cancelled.
    """

    async def _wait_disconnect() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    work_task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect())
    try:
        await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work_task.done():
            work_task.cancel()
        await asyncio.gather(watcher, work_task, return_exceptions=True)
    if work_task.cancelled():
        return False, None
    return True, work_task.result()


class Served(NamedTuple):
    """What :func:`serve_in_thread` yields: the base URL (no trailing slash) and ``app.state``."""

    url: str
    state: State

    @property
    def port(self) -> int:
        """The TCP port the server listens on."""
        return int(self.url.rsplit(":", 1)[1])


@contextlib.contextmanager
def serve_in_thread(
    app: Starlette,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    ready_path: str = "/health",
    startup_timeout: float = 10.0,
    graceful_timeout: int = 2,
) -> Iterator[Served]:
    """Serve ``app`` with uvicorn on a background thread; yield once ``ready_path`` answers 200.

    ``port=0`` binds a free port (the socket is bound here, so there is no race). Signal handlers
    and the lifespan protocol are off, logs are quiet. On exit the server stops accepting, waits up
    to ``graceful_timeout`` seconds for in-flight requests, cancels the rest and joins the thread.
    """
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only then (without it every keep-alive
    # response waited ~40 ms for the caller's delayed ACK)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    bound_port = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        lifespan="off",
        log_level="warning",
        access_log=False,
        loop="asyncio",
        ws="none",
        timeout_graceful_shutdown=graceful_timeout,
        # Idle keep-alive connections stay open (uvicorn's default closes them after 5 s): a
        # client reusing one just as the server closes it gets a ReadError that no server
        # rejection caused (tests/client/test_burst.py counted one as a failed request under load).
        timeout_keep_alive=120,
    )
    server = uvicorn.Server(config)
    errors: list[BaseException] = []

    def _run() -> None:
        try:
            server.run(sockets=[sock])
        except BaseException as exc:  # reported to the caller, never lost
            errors.append(exc)

    thread = threading.Thread(target=_run, name=f"fleetgate-sim:{bound_port}", daemon=True)
    thread.start()
    url = f"http://{host}:{bound_port}"
    try:
        _wait_ready(server, thread, errors, url + ready_path, startup_timeout)
        yield Served(url, app.state)
    finally:
        server.should_exit = True
        thread.join(graceful_timeout + 5.0)
        if thread.is_alive():
            server.force_exit = True
            thread.join(5.0)
        sock.close()


def _wait_ready(
    server: uvicorn.Server,
    thread: threading.Thread,
    errors: list[BaseException],
    health_url: str,
    timeout: float,
) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=1.0) as client:
        while True:
            if errors or not thread.is_alive():
                raise RuntimeError(f"simulator server failed to start: {errors!r}")
            if server.started:
                with contextlib.suppress(httpx.TransportError):
                    if client.get(health_url).status_code == 200:
                        return
            if time.monotonic() > deadline:
                raise TimeoutError(f"simulator at {health_url} not ready after {timeout}s")
            time.sleep(0.005)


def add_server_args(parser: argparse.ArgumentParser, default_port: int) -> None:
    """Add ``--host``, ``--port`` and ``--log-level`` to a simulator's parser."""
    parser.add_argument(
        "--host", default="127.0.0.1", help="interface to listen on (default: %(default)s)"
    )
    parser.add_argument(
        "--port", type=int, default=default_port, help="TCP port (default: %(default)s)"
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn log level; the access log is on only at debug (default: %(default)s)",
    )


def run_server(app: Starlette, host: str, port: int, log_level: str = "info") -> None:
    """Serve ``app`` in the foreground until SIGINT/SIGTERM (uvicorn handles the signals)."""
    uvicorn.Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            lifespan="off",
            ws="none",
            access_log=log_level == "debug",
            timeout_graceful_shutdown=5,
        )
    ).run()


def run_cli(
    parser: argparse.ArgumentParser,
    make_app: Callable[[argparse.Namespace], Starlette],
    argv: list[str] | None,
) -> int:
    """Parse ``argv``, build the app (a ``ValueError`` becomes a usage error) and serve it."""
    ns = parser.parse_args(argv)
    try:
        app = make_app(ns)
    except ValueError as exc:
        parser.error(str(exc))
    run_server(app, ns.host, ns.port, ns.log_level)
    return 0
