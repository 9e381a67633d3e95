"""Every coordinator write of a gate is epoch-fenced: a deposed leader that
wakes up between its validity check and its pipeline (a GC pause, CPU starvation, a slow link)
must not overwrite its successor's gate configuration (``fg:{G}:cfg``: the floor *is* the cap
of a fixed gate) nor its utilisation snapshot and controller state (``fg:{G}:util``: the next
leader resumes from it), just as ``set_target`` refuses its target.

The Publisher is driven directly with two epochs: the minimal honest reproduction, since a real
leader pauses at an arbitrary instant (the process tests of the election cover the rest).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aredis

from fleetgate._redis import connect
from fleetgate.coordinator.config import Config, GateConfig
from fleetgate.coordinator.controller import ControllerState, Decision, Reason
from fleetgate.coordinator.publisher import Publication, Publisher
from fleetgate.keys import GateKeys
from fleetgate.scripts import GateScripts
from fleetgate.settings import GateSettings

from .._workers import wait_for
from ..conftest import RedisUnderTest
from ._coordinator import start

TTL_MS = 60_000


def gates(llm_floor: int, fixed_floor: int) -> tuple[GateConfig, ...]:
    return Config.from_toml_text(
        f"""
[[gates]]
name = "llm"
floor = {llm_floor}
ceiling = 64
metrics_url = "http://127.0.0.1:9/metrics"
[[gates]]
name = "fixed"
floor = {fixed_floor}
max_queued = 100
""",
        env={},
    ).gates


def publications(cfg: tuple[GateConfig, ...], target: int, polled_at: float) -> list[Publication]:
    llm, fixed = cfg
    return [
        Publication(
            llm,
            Decision(ControllerState(target=target), target, Reason.INCREASE, publish=True),
            None,
            0,
            polled_at,
        ),
        Publication(
            fixed,
            Decision(ControllerState(target=fixed.floor), fixed.floor, Reason.STATIC, False),
            None,
            0,
            polled_at,
        ),
    ]


@pytest.fixture(params=["standalone", "cluster"])
async def where(request: pytest.FixtureRequest) -> AsyncIterator[tuple[aredis.Redis, str]]:
    rut: RedisUnderTest = request.getfixturevalue(
        "rut" if request.param == "standalone" else "cluster_rut"
    )
    client = connect(rut.url)
    yield client, rut.prefix
    await client.aclose()


async def test_deposed_leader_writes_nothing(where: tuple[aredis.Redis, str]) -> None:
    client, prefix = where
    pub = Publisher(client, prefix)
    llm, fixed = GateKeys.of(prefix, "llm"), GateKeys.of(prefix, "fixed")
    old_cfg, new_cfg = gates(llm_floor=4, fixed_floor=32), gates(llm_floor=2, fixed_floor=8)

    # The old leader (epoch 4) published; then a new leader (epoch 5, a new config) took over.
    assert await pub.publish(4, TTL_MS, publications(old_cfg, 20, 100.0)) == [True, True]
    assert await pub.publish(5, TTL_MS, publications(new_cfg, 10, 200.0)) == [True, True]
    new = {k: await client.hgetall(k) for g in (llm, fixed) for k in (g.cfg, g.util, g.target)}

    # The old leader wakes up and publishes its poll: every write of it is refused.
    accepted = await pub.publish(4, TTL_MS, publications(old_cfg, 40, 300.0))
    assert accepted == [False, False]
    after = {k: await client.hgetall(k) for g in (llm, fixed) for k in (g.cfg, g.util, g.target)}
    changed = sorted(k for k in new if after[k] != new[k])
    assert changed == [], f"the deposed leader overwrote {changed}"
    assert await client.hget(fixed.cfg, "floor") == "8"
    assert await client.hget(llm.util, "last_poll") == "200.0"
    # The cap is the new leader's: its fixed gate's floor, not the old config's 32.
    scripts = GateScripts(client)
    assert (await scripts.snapshot(fixed)).limit == 8
    assert (await scripts.snapshot(llm)).limit == 10


async def test_growth_by_config_hands_off_at_once(rut: RedisUnderTest) -> None:
    """The fenced write is the same script that hands new room to waiters: raising a fixed gate's
    floor grants its waiters in the publishing call, as a target increase does."""
    client = connect(rut.url)
    try:
        pub = Publisher(client, rut.prefix)
        keys = GateKeys.of(rut.prefix, "fixed")
        scripts = GateScripts(client)
        assert await pub.publish(1, TTL_MS, publications(gates(2, 1), 2, 1.0)) == [True, True]
        d = GateSettings(lease_ms=TTL_MS, waiter_ms=TTL_MS)
        assert (await scripts.acquire(keys, "a:1", TTL_MS, d)).status == 1
        assert (await scripts.acquire(keys, "b:1", TTL_MS, d)).status == 2
        assert await pub.publish(1, TTL_MS, publications(gates(2, 2), 2, 2.0)) == [True, True]
        assert await client.zscore(keys.holders, "b:1") is not None
        [wake] = await client.lrange(keys.wake("b"), 0, -1)
        assert wake.partition("=")[0] == "b:1"  # <id>=<token>
    finally:
        await client.aclose()


# ------------------------------------------------------- real processes: a late write lands


class HoldingProxy:
    """A loopback TCP proxy that, once armed (:meth:`arm`) and a client sends ``trigger``,
    holds every byte from the clients (the trigger's chunk included) until :meth:`release`
    delivers them in order: a request delayed in the network (retransmissions, a congested
    link) that reaches Redis after its sender was deposed. Replies from Redis pass through."""

    def __init__(self, upstream_port: int, trigger: bytes) -> None:
        self.upstream_port, self.trigger = upstream_port, trigger
        self.armed = False
        self.triggered = threading.Event()
        self._lock = threading.Lock()
        self._held: list[tuple[socket.socket, bytearray, list[bool]]] = []
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            with self._lock:
                self._sockets += [client, upstream]
            threading.Thread(target=self._pump_up, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._pump_down, args=(upstream, client), daemon=True).start()

    def _pump_up(self, client: socket.socket, upstream: socket.socket) -> None:
        buf, closed = bytearray(), [False]
        with self._lock:
            self._held.append((upstream, buf, closed))
        while True:
            try:
                data = client.recv(65536)
            except OSError:
                data = b""
            with self._lock:
                if not data:
                    closed[0] = True
                    if not buf:
                        with contextlib.suppress(OSError):
                            upstream.shutdown(socket.SHUT_WR)
                    return
                if self.armed and self.trigger in data:
                    self.triggered.set()
                if self.triggered.is_set() and not self._released:
                    buf += data
                    continue
                try:
                    upstream.sendall(data)
                except OSError:  # closed by close()
                    return

    @staticmethod
    def _pump_down(upstream: socket.socket, client: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := upstream.recv(65536):
                client.sendall(data)

    _released = False

    def arm(self) -> None:
        with self._lock:
            self.armed = True

    def release(self) -> None:
        """Deliver everything held, each connection's bytes in one write, in order."""
        with self._lock:
            self._released = True
            for upstream, buf, closed in self._held:
                with contextlib.suppress(OSError):
                    if buf:
                        upstream.sendall(bytes(buf))
                        buf.clear()
                    if closed[0]:
                        upstream.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept()
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()


def coordinator_config(tmp_path: Path, url: str, prefix: str, floor: int, poll: float) -> Path:
    path = tmp_path / f"coordinator-{floor}.toml"
    path.write_text(
        f"""
[redis]
url = "{url}"
prefix = "{prefix}"
[coordinator]
poll_interval = {poll}
poll_jitter = 0.0
leader_ttl = 2.0
metrics_listen = "127.0.0.1:0"
scrape_timeout = 0.2
[[gates]]
name = "fixed"
floor = {floor}
"""
    )
    return path


def test_late_publish_of_a_deposed_leader_lands_nowhere(
    tmp_path: Path, rut: RedisUnderTest, procs: list[subprocess.Popen[bytes]]
) -> None:
    """A config rollout: the old leader (floor 32) is deposed while its publish pipeline is
    stuck in the network; the new leader (floor 8) publishes; then the old pipeline arrives."""
    assert rut.process is not None
    r = redis.Redis.from_url(rut.url, decode_responses=True)
    keys = GateKeys.of(rut.prefix, "fixed")
    # SADD of the registry: the first command of every publish pipeline, and only there.
    proxy = HoldingProxy(rut.process.port, trigger=b"SADD")
    try:
        old = coordinator_config(tmp_path, proxy.url, rut.prefix, floor=32, poll=0.3)
        procs.append(start(old, "old"))
        wait_for(lambda: r.hget(keys.cfg, "floor") == "32", 20)
        # The new leader polls once when it wins, then not for a minute: only the old
        # leader's late pipeline can change the gate in what follows.
        new = coordinator_config(tmp_path, rut.url, rut.prefix, floor=8, poll=60.0)
        procs.append(start(new, "new"))
        proxy.arm()
        assert proxy.triggered.wait(10), "the old leader published nothing"
        # Everything of the old leader is held now: its lease lapses, the new one wins.
        wait_for(lambda: r.get(f"{rut.prefix}:leader") == "new", 20)
        wait_for(lambda: r.hget(keys.cfg, "floor") == "8", 10)
        util = r.hgetall(keys.util)
        sadd_before = _calls(r, "sadd")
        proxy.release()
        # The held pipeline starts with the registry SADD; Redis runs the whole delivered
        # buffer before it answers another client, so once the SADD is counted it all ran.
        wait_for(lambda: _calls(r, "sadd") > sadd_before, 10)
        assert r.hget(keys.cfg, "floor") == "8", "the deposed leader's config landed"
        assert r.hgetall(keys.util) == util, "the deposed leader's snapshot landed"
        assert asyncio.run(limit_of(rut.url, keys)) == 8  # the cap in force, not 32
        assert r.get(f"{rut.prefix}:leader") == "new"
    finally:
        proxy.close()
        r.close()


async def limit_of(url: str, keys: GateKeys) -> int:
    client = connect(url)
    try:
        return (await GateScripts(client).snapshot(keys)).limit
    finally:
        await client.aclose()


def _calls(r: redis.Redis, command: str) -> int:
    stats = r.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))
