"""Request-level fan-out through a gate: ``gate.map(fn, items, ...)``.

Each item's call runs inside its own permit of the gate (the fleet-wide cap), at most
``max_in_flight`` of one request's calls at once (the per-request fan-out cap), under one total
deadline that covers queue waits, calls and retries. Retries happen inside the permit, so a
retrying call never re-enters the queue. The first failure cancels the siblings (parked ones
leave the queue, running ones are cancelled, every permit is released) unless the caller asks for
per-item outcomes.
"""

from __future__ import annotations

import asyncio
import inspect
import warnings
from collections.abc import AsyncIterable, Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    wait_random_exponential,
)
from tenacity.stop import stop_base

from fleetgate._aio import within
from fleetgate.ask import Ask, check_deadline
from fleetgate.errors import ConfigError, FleetgateError

from ._deadline import Deadline
from ._report import CallReport, timed

if TYPE_CHECKING:
    from ._metrics import ClientMetrics

__all__ = ["DEFAULT_RETRY", "FleetgateWarning", "is_transient", "run_map"]

T = TypeVar("T")
R = TypeVar("R")

# Retries of transient failures: attempts in total, and the jittered back-off bounds (seconds).
DEFAULT_ATTEMPTS = 4
BACKOFF_MULTIPLIER = 0.05
BACKOFF_MAX = 2.0

# fn is sync or async; precise overloads would add little over Any for callers.
Fn = Callable[[T], Any]
RetryPolicy = AsyncRetrying | bool | None


class FleetgateWarning(UserWarning):
    """A configuration that works but probably does not do what was meant."""


class _Releasable(Protocol):
    async def release(self) -> None: ...

    def report(self, outcome: str, latency: float | None = None) -> None: ...

    @property
    def is_revoked(self) -> bool: ...


# How often a call whose lease lives on another event loop looks whether it was revoked (a lease
# of this loop has an event to wait on).
REVOKED_POLL_S = 0.05
# What a call cut short because its lease was revoked returns in place of a result.
_REVOKED = object()


async def _revocation(lease: _Releasable) -> None:
    """Return once ``lease`` is revoked (the gate asked for it back): for a lease of another
    event loop, whose flag is all this loop can read."""
    while not lease.is_revoked:  # noqa: ASYNC110 - the flag is set on another loop's thread
        await asyncio.sleep(REVOKED_POLL_S)


class PermitSource(Protocol):
    """Where ``run_map`` gets its permits: a :class:`Gate`, or a proxy to one on another loop."""

    @property
    def name(self) -> str: ...

    @property
    def metrics(self) -> ClientMetrics: ...

    async def acquire_for(self, dl: Deadline, ask: Ask) -> _Releasable: ...


def is_transient(exc: BaseException) -> bool:
    """The default retry predicate: timeouts, connection errors and 5xx-like HTTP statuses.

    Never fleetgate's own errors (``Overloaded`` above all: retrying an overload deepens it).
    """
    if isinstance(exc, FleetgateError):
        return False
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return True
    try:
        import httpx
    except ImportError:  # pragma: no cover - httpx is a dependency
        httpx = None  # type: ignore[assignment]
    if httpx is not None:
        if isinstance(exc, httpx.TransportError):  # connect/read timeouts, network errors
            return True
        if isinstance(exc, httpx.HTTPStatusError):
            return 500 <= exc.response.status_code <= 599
    status = getattr(exc, "status_code", None) or getattr(exc, "status", None)
    return isinstance(status, int) and 500 <= status <= 599


class _StopAtDeadline(stop_base):
    """Stop retrying when ``base`` says so, or when the next back-off would outlive the total
    deadline."""

    def __init__(self, dl: Deadline, base: Callable[[RetryCallState], bool]) -> None:
        self.dl = dl
        self.base = base

    def __call__(self, retry_state: RetryCallState) -> bool:
        if self.base(retry_state):
            return True
        left = self.dl.remaining()
        return left is not None and left <= (retry_state.upcoming_sleep or 0.0)


DEFAULT_RETRY = AsyncRetrying(
    retry=retry_if_exception(is_transient),
    wait=wait_random_exponential(multiplier=BACKOFF_MULTIPLIER, max=BACKOFF_MAX),
    stop=stop_after_attempt(DEFAULT_ATTEMPTS),
    reraise=True,
)


def _policy(
    retry: RetryPolicy, dl: Deadline, on_retry: Callable[[RetryCallState], None]
) -> AsyncRetrying:
    if retry is False:
        return AsyncRetrying(stop=stop_after_attempt(1), reraise=True)
    base = DEFAULT_RETRY if retry is None or retry is True else retry
    assert isinstance(base, AsyncRetrying), "retry must be a tenacity AsyncRetrying, bool or None"
    # Whatever the caller's policy: never retry fleetgate's errors, never past the deadline.
    return base.copy(
        retry=base.retry & retry_if_exception(lambda e: not isinstance(e, FleetgateError)),
        stop=_StopAtDeadline(dl, base.stop),
        before_sleep=on_retry,
        reraise=True,
    )


def _as_async(fn: Fn[T]) -> Callable[[T], Awaitable[Any]]:
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - async callables
    ):
        return fn  # an async callable: its calls are awaitables already

    async def in_thread(item: T) -> Any:
        # A thread cannot be interrupted: on cancellation the permit is released and the
        # result abandoned while the thread finishes on its own.
        result = await asyncio.to_thread(fn, item)
        if inspect.isawaitable(result):
            return await result
        return result

    return in_thread


async def _aiter(items: Iterable[T] | AsyncIterable[T]) -> Any:
    if isinstance(items, AsyncIterable):
        async for item in items:
            yield item
    else:
        for item in items:
            yield item


async def run_map(
    source: PermitSource,
    fn: Fn[T],
    items: Iterable[T] | AsyncIterable[T],
    *,
    max_in_flight: int | None = 8,
    deadline: float | None = 30.0,
    retry: RetryPolicy = None,
    return_exceptions: bool = False,
    call_timeout: float | None = None,
    weight: int | Callable[[Any], int] = 1,
    priority: int = 0,
    tenant: str | None = None,
    tokens: int | Callable[[Any], int] = 0,
) -> list[Any]:
    """The body of :meth:`Gate.map` (see there)."""
    seconds = _check_map_options(source.name, deadline, max_in_flight, call_timeout)
    metrics, name = source.metrics, source.name
    run = _MapRun(source, _as_async(fn), max_in_flight, call_timeout)
    run.weigh, run.priority, run.tenant, run.tokens = weight, priority, tenant, tokens
    counter = metrics.deadline_exceeded.labels(name)
    async with Deadline(name, seconds, where="map", on_expire=counter.inc) as dl:
        policy = _policy(retry, dl, run.count_retry)
        try:
            return await run.all(items, dl, policy, return_exceptions)
        finally:
            metrics.calls_per_request.labels(name).observe(run.calls)


def _check_map_options(
    gate: str, deadline: float | None, max_in_flight: int | None, call_timeout: float | None
) -> float | None:
    """The total deadline in seconds (None: none); ConfigError for a bad option."""
    seconds = check_deadline(deadline)
    if max_in_flight is not None and (isinstance(max_in_flight, bool) or max_in_flight < 1):
        raise ConfigError(f"max_in_flight: expected int >= 1 or None, got {max_in_flight!r}")
    if call_timeout is not None and call_timeout <= 0:
        raise ConfigError(f"call_timeout: expected > 0 seconds or None, got {call_timeout!r}")
    if seconds is not None and call_timeout is not None and seconds < call_timeout:
        warnings.warn(
            f"gate {gate!r}: total deadline {seconds}s is shorter than the per-call "
            f"timeout {call_timeout}s: the deadline fires first and no retry can happen",
            FleetgateWarning,
            stacklevel=4,  # the caller of Gate.map (via run_map)
        )
    return seconds


class _MapRun:
    """One ``gate.map`` request: its calls, each in a permit, at most ``max_in_flight`` at once."""

    def __init__(
        self,
        source: PermitSource,
        call: Callable[[Any], Awaitable[Any]],
        max_in_flight: int | None,
        call_timeout: float | None,
    ) -> None:
        self.source = source
        self.call = call
        self.call_timeout = call_timeout
        self.fan = asyncio.Semaphore(max_in_flight) if max_in_flight else None
        self.results: dict[int, Any] = {}
        #: each item's weight and tokens (an int for all, or a function of the item),
        #: priority, tenant
        self.weigh: int | Callable[[Any], int] = 1
        self.tokens: int | Callable[[Any], int] = 0
        self.priority = 0
        self.tenant: str | None = None
        #: attempts made (first calls and retries), for the calls-per-request histogram
        self.calls = 0
        #: calls cut short because their lease was revoked (each queued again)
        self.revoked = 0

    def count_retry(self, _: RetryCallState) -> None:
        self.source.metrics.retries.labels(self.source.name).inc()

    async def all(
        self,
        items: Iterable[Any] | AsyncIterable[Any],
        dl: Deadline,
        policy: AsyncRetrying,
        return_exceptions: bool,
    ) -> list[Any]:
        """Run one call per item; results (or, with ``return_exceptions``, outcomes) in order.

        Fail fast otherwise: on the first failure parked siblings leave the queue, running ones
        are cancelled and permits are released -- all before the error reaches the caller.
        """
        tasks: list[asyncio.Task[None]] = []
        try:
            async for item in _aiter(items):
                tasks.append(asyncio.create_task(self._capped(len(tasks), item, dl, policy)))
            if return_exceptions:
                outcomes = await asyncio.gather(*tasks, return_exceptions=True)
                for i, outcome in enumerate(outcomes):
                    if isinstance(outcome, BaseException):
                        self.results[i] = outcome
            elif tasks:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
                for t in tasks:
                    exc = t.exception() if t in done else None
                    if exc is not None:
                        raise exc
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return [self.results[i] for i in range(len(tasks))]

    async def _capped(self, index: int, item: Any, dl: Deadline, policy: AsyncRetrying) -> None:
        if self.fan is None:
            return await self._one(index, item, dl, policy)
        async with self.fan:
            return await self._one(index, item, dl, policy)

    async def _one(self, index: int, item: Any, dl: Deadline, policy: AsyncRetrying) -> None:
        weight = self.weigh(item) if callable(self.weigh) else self.weigh
        tokens = self.tokens(item) if callable(self.tokens) else self.tokens
        # the call's own ask; the request's deadline (dl) covers it
        ask = Ask.of(
            weight=weight, priority=self.priority, tenant=self.tenant, deadline=None, tokens=tokens
        )
        while True:
            lease = await self.source.acquire_for(dl, ask)
            report = CallReport()
            try:
                outcome = await self._unless_revoked(lease, policy(self._attempt, item, report))
                if outcome is _REVOKED:
                    report.outcome = None  # cut short: it says nothing of the server
            except asyncio.CancelledError:
                report.outcome = None  # a cancelled call reports nothing
                raise
            finally:
                report.send(lease)
                await lease.release()
            if outcome is not _REVOKED:
                self.results[index] = outcome
                return
            # The gate asked for the permit back (a higher band waited): the call was cancelled
            # and its permit released; it queues again within the request's deadline.
            self.revoked += 1

    async def _unless_revoked(self, lease: _Releasable, call: Awaitable[Any]) -> Any:
        """``call``'s result, or :data:`_REVOKED` if ``lease`` is revoked first (the call is
        cancelled then). A lease of this loop cancels the call from the heartbeat that learns it
        (``when_revoked``: no task or event per call); one of another loop is watched."""
        task = asyncio.ensure_future(call)
        cut: list[bool] = []

        def revoked() -> None:
            cut.append(True)
            task.cancel()

        hook = getattr(lease, "when_revoked", None)
        watch = None if hook is not None else asyncio.ensure_future(_revocation(lease))
        if hook is not None:
            hook(revoked)
        try:
            if watch is None:
                await asyncio.wait({task})  # (a cancellation of this task stops here)
            else:
                await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
                if not task.done():
                    revoked()
                    await asyncio.wait({task})
            if cut and task.cancelled():
                return _REVOKED
            return task.result()
        finally:
            if hook is not None:
                hook(None)
            for t in (task, watch):
                if t is not None:
                    t.cancel()
            await asyncio.gather(
                *(t for t in (task, watch) if t is not None), return_exceptions=True
            )

    async def _attempt(self, item: Any, report: CallReport) -> Any:
        self.calls += 1
        if self.call_timeout is None:
            return await timed(self.call(item), report)
        return await timed(within(self.call(item), self.call_timeout), report)


def batched(items: Sequence[T], size: int) -> list[Sequence[T]]:
    """Split ``items`` into consecutive batches of at most ``size``."""
    if size < 1:
        raise ConfigError(f"batch_size: expected int >= 1, got {size!r}")
    return [items[i : i + size] for i in range(0, len(items), size)]


def merge_indexed(batches: Sequence[Sequence[tuple[int, R]]], size: int, total: int) -> list[R]:
    """Place each batch's ``(local index, value)`` pairs at ``batch id × size + local index``."""
    out: list[Any] = [None] * total
    seen = 0
    for batch_id, pairs in enumerate(batches):
        for local, value in pairs:
            out[batch_id * size + local] = value
            seen += 1
    if seen != total:
        raise ValueError(f"batched results cover {seen} of {total} items")
    return out
