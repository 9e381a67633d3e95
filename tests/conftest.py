"""Fixtures: real, private Redis servers.

Every test that runs a script talks to a real ``redis-server`` started here on a free port and
stopped afterwards. A server we did not start is used only when FLEETGATE_TEST_REDIS_URL names it
(then each test gets its own prefix and nothing is flushed). If ``redis-server`` is missing and a
Docker engine is reachable, testcontainers starts one; otherwise the run fails saying how to
install Redis.

Tests marked ``servers`` run once per server of the server matrix (Redis and each Valkey:
tests/_servers.py): the fixtures below start the matrix's server for them.
"""

from __future__ import annotations

import asyncio
import gc
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import pytest
import redis
import redis.asyncio as aredis
from prometheus_client import CollectorRegistry

from fleetgate.client import Fleet
from fleetgate.keys import fleet_keys
from fleetgate.stamp import init_prefix
from fleetgate.tools.redisproc import INSTALL_HINT, RedisClusterProcess, RedisProcess

from ._servers import REQUIRE_ENV, MatrixServer, matrix

# Markers whose tests are long by nature: every test carrying one is in the long tier
# (``make test-long``) without a ``long`` marker of its own; see pytest_collection_modifyitems.
LONG_BY_NATURE = ("chaos", "real_server", "slow")


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects (the mark plugin's hook runs after)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Put every chaos, real-server and slow (load, burst) test in the long tier.

    The tiers are ``-m "not long"`` (``make test``) and ``-m long`` (``make test-long``), so
    each test runs in exactly one of them (``tests/test_tiers.py`` checks the Makefile's
    commands). A test is long by its ``long`` marker (set where a module's or a test's measured
    duration puts it there) or by one of the markers above, which a new chaos or real-server
    test carries anyway: it cannot land in the fast tier by forgetting a second marker.
    """
    for item in items:
        if any(item.get_closest_marker(name) for name in LONG_BY_NATURE):
            item.add_marker(pytest.mark.long)


@dataclass
class RedisUnderTest:
    url: str
    prefix: str
    process: RedisProcess | None  # None when the server is not ours (no kill/restart)


def _testcontainers_url() -> tuple[str, object] | None:
    try:
        from testcontainers.redis import RedisContainer

        container = RedisContainer("redis:7")
        container.start()
    except Exception:
        return None
    host = container.get_container_host_ip()
    port = container.get_exposed_port(6379)
    return f"redis://{host}:{port}/0", container


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test marked ``servers`` that starts a server runs once per server of the matrix
    (tests/_servers.py); one that starts none (a module's pure tests) runs once. A server that
    cannot be had is left out (the report's header says why), but for the test marked
    ``servers(report_missing=True)``, which skips on it, and with FLEETGATE_REQUIRE_VALKEY set,
    where every test fails on it."""
    marker = metafunc.definition.get_closest_marker("servers")
    if marker is None or "matrix_server" not in metafunc.fixturenames:
        return
    servers = matrix()
    if not (marker.kwargs.get("report_missing") or os.environ.get(REQUIRE_ENV)):
        servers = tuple(s for s in servers if not s.missing)
    ids = [s.name for s in servers]
    metafunc.parametrize("matrix_server", servers, ids=ids, indirect=True, scope="session")


def pytest_report_header(config: pytest.Config) -> list[str]:
    """One line naming the servers of the matrix, and why any is not run."""
    servers = matrix()
    line = "server matrix: " + ", ".join(s.name for s in servers if not s.missing)
    return [line] + [f"server matrix: {s.name} not run: {s.missing}" for s in servers if s.missing]


@pytest.fixture(scope="session")
def matrix_server(request: pytest.FixtureRequest) -> MatrixServer | None:
    """The server of the matrix a ``servers`` test runs against (None: the suite's server).
    One that cannot be had skips the test, saying why; with FLEETGATE_REQUIRE_VALKEY set, fails."""
    server: MatrixServer | None = getattr(request, "param", None)
    if server is not None and server.missing:
        if os.environ.get(REQUIRE_ENV):
            pytest.fail(f"{REQUIRE_ENV} is set and {server.missing}", pytrace=False)
        pytest.skip(server.missing)
    return server


def _binary(server: MatrixServer | None) -> str | None:
    return server.binary if server is not None else None


@pytest.fixture(scope="session")
def shared_redis(matrix_server: MatrixServer | None) -> Iterator[RedisUnderTest]:
    """One server for the session (per server of the matrix); tests isolate themselves by
    prefix."""
    binary = _binary(matrix_server)
    external = os.environ.get("FLEETGATE_TEST_REDIS_URL")
    if external and binary is None:
        yield RedisUnderTest(external, "", None)
        return
    if binary or RedisProcess.available():
        with RedisProcess(binary=binary) as proc:
            yield RedisUnderTest(proc.url, "", proc)
        return
    started = _testcontainers_url()
    if started is None:
        pytest.fail(INSTALL_HINT, pytrace=False)
    url, container = started
    try:
        yield RedisUnderTest(url, "", None)
    finally:
        container.stop()  # type: ignore[attr-defined]


@pytest.fixture
def rut(shared_redis: RedisUnderTest) -> RedisUnderTest:
    """The shared server with a fresh key prefix for this test.

    The prefix is marked as one this server has held state under for long (``<prefix>:born``
    = 0), which is true of every test prefix in the sense that matters: no process ran work
    under it that a wipe could have lost. So a test's first gate is not held behind the
    recovery fence (lua/lib_fence.lua gate_birth) that a server seen empty imposes; tests of the
    fence use their own servers (``own_redis``).
    """
    prefix = f"t{uuid.uuid4().hex[:10]}"
    with redis.Redis.from_url(shared_redis.url) as client:
        client.set(fleet_keys(prefix).born, 0)
    return RedisUnderTest(shared_redis.url, prefix, shared_redis.process)


@pytest.fixture(scope="session")
def redis_cluster(matrix_server: MatrixServer | None) -> Iterator[RedisClusterProcess]:
    """A real 3-master Redis Cluster for the session (tests isolate themselves by prefix)."""
    binary = _binary(matrix_server)
    if binary is None and not RedisProcess.available():
        pytest.fail(INSTALL_HINT, pytrace=False)
    with RedisClusterProcess(3, binary=binary) as cluster:
        yield cluster


@pytest.fixture
def cluster_rut(redis_cluster: RedisClusterProcess) -> RedisUnderTest:
    """The cluster with a fresh key prefix for this test (``?cluster=1`` URL)."""
    return RedisUnderTest(redis_cluster.url, f"c{uuid.uuid4().hex[:10]}", None)


@pytest.fixture
def own_redis(matrix_server: MatrixServer | None) -> Iterator[RedisProcess]:
    """A private server for this test alone, which the test may kill and restart.

    Its default prefix ``fg`` is stamped by ``fleetgate init`` (:func:`fleetgate.stamp.
    init_prefix`: no work ran on the new server), so the recovery fence applies only once the
    test wipes it (kill and start, or FLUSHALL), as in production: the wipe tests
    (tests/chaos/test_wipe.py) are tests of a stamped prefix. Tests of a first start on an
    empty server start their own.
    """
    binary = _binary(matrix_server)
    if binary is None and not RedisProcess.available():
        pytest.fail(INSTALL_HINT, pytrace=False)
    with RedisProcess(binary=binary) as proc:
        outcome = asyncio.run(init_prefix(proc.url, "fg"))
        assert outcome.result == "stamped", outcome.message()
        yield proc


@pytest.fixture
def sync_redis(rut: RedisUnderTest) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(rut.url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture
async def async_redis(rut: RedisUnderTest) -> AsyncIterator[aredis.Redis]:
    client = aredis.Redis.from_url(rut.url, decode_responses=True)
    yield client
    await client.aclose()


@pytest.fixture(autouse=True)
def _leaks_fail_the_leaking_test() -> Iterator[None]:
    """Collect the young garbage after every test, so a leak fails the test that leaks.

    A connection, transport or socket left open is reported (a ResourceWarning, an error under
    ``filterwarnings = error``) only when the garbage collector frees it: without this, in
    whichever later test the collector happens to run. This fixture is set up before, so torn
    down after, the test's other function-scoped fixtures (its event loop included); pytest then
    reports the warning as an error in this test's teardown. Only the young generations: a full
    collection costs ~30 ms a test; what got old during the test is collected at the end of
    its file (:func:`_leaks_fail_the_leaking_file`).
    """
    yield
    gc.collect(1)


@pytest.fixture(scope="module", autouse=True)
def _leaks_fail_the_leaking_file() -> Iterator[None]:
    """A full collection after the file's last test and its module-scoped fixtures (servers,
    event loops on threads): a leak fails that last test, never one of another file."""
    yield
    gc.collect()


@pytest.fixture
def no_gc_during_test() -> Iterator[None]:
    """Collect dead background tasks after the test, not in the middle of it.

    Tests that plant wrong-typed keys or deny commands make the client's background cleanups
    fail. If the garbage collector finalises such a task while Python 3.11.7 is inside
    ``ast.parse`` (traceback printing calls it), CPython can raise "SystemError: AST constructor
    recursion depth mismatch" and pytest dies with INTERNALERROR. The client logs those
    failures (``Gate._forget_later``); this keeps the runs deterministic all the same.
    """
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()


@pytest.fixture
def registry() -> CollectorRegistry:
    """A Prometheus registry of the test's own (metrics never leak between tests)."""
    return CollectorRegistry()


@pytest.fixture
async def fleet(rut: RedisUnderTest, registry: CollectorRegistry) -> AsyncIterator[Fleet]:
    """A started Fleet on the Redis under test, heartbeat every 0.2 s. Test files that need
    other settings define their own ``fleet``."""
    async with Fleet(rut.url, prefix=rut.prefix, registry=registry, heartbeat_interval=0.2) as f:
        yield f
