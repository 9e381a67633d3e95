"""A SIGKILLed leader hands over warm under the default lifetimes.

Real ``fleetgate coordinator`` processes with the default ``poll_interval`` (2 s),
``leader_ttl`` (10 s) and ``target_ttl_polls`` (3), one adaptive gate against the vLLM
simulator, load from a ``fleetgate worker`` process. Once the gate's target has grown well above
its floor and settled, the leader is SIGKILLed; the standby wins the lease when it lapses. The
target outlives the takeover: were it to live only ``target_ttl_polls × poll_interval`` (6 s),
less than the takeover (~10 s), the new leader would find every target run out and restart each
gate from its floor (231 -> 8), and the pods' limit would fall to the floor meanwhile.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as aredis

from fleetgate.coordinator.config import CoordinatorSettings
from fleetgate.keys import GateKeys
from fleetgate.scripts import GateScripts
from fleetgate.tools.sim import serve_in_thread
from fleetgate.tools.sim.vllm import VllmSimConfig, build_app

from ..conftest import RedisUnderTest

FLOOR = 4
USERS = 48  # the load's request loops: the target settles at the first power of 2 above them
DEFAULTS = CoordinatorSettings()


def _config(tmp_path: Path, rut: RedisUnderTest, base_url: str) -> Path:
    # No poll_interval, leader_ttl nor target_ttl_polls: the defaults are what is tested.
    path = tmp_path / "coordinator.toml"
    path.write_text(
        f"""
[redis]
url = "{rut.url}"
prefix = "{rut.prefix}"
[coordinator]
metrics_listen = "127.0.0.1:0"
[[gates]]
name = "llm"
floor = {FLOOR}
ceiling = 512
max_queued = 1000
base_url = "{base_url}/v1"
server = "vllm"
"""
    )
    return path


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(10)


def _start(tmp_path: Path, argv: list[str], log: str) -> subprocess.Popen[bytes]:
    with open(tmp_path / log, "wb") as out:  # a file, not a pipe nobody reads: never blocks
        return subprocess.Popen([sys.executable, "-m", *argv], stdout=out, stderr=out)


async def _until(check, timeout: float, what: str):  # type: ignore[no-untyped-def]
    """Poll the coroutine function ``check`` until it returns something truthy; return that."""
    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


@pytest.mark.slow
@pytest.mark.timeout(150)
async def test_sigkilled_leader_hands_over_warm_under_the_default_lifetimes(
    tmp_path: Path, rut: RedisUnderTest, procs: list[subprocess.Popen[bytes]]
) -> None:
    r = aredis.Redis.from_url(rut.url, decode_responses=True)
    keys = GateKeys.of(rut.prefix, "llm")
    scripts = GateScripts(r)
    leader_key = f"{rut.prefix}:leader"
    sim = VllmSimConfig(capacity=512, service_ms=1000.0)
    try:
        with serve_in_thread(build_app(sim)) as served:
            cfg = _config(tmp_path, rut, served.url)
            by_id: dict[str, subprocess.Popen[bytes]] = {}
            for cid in ("c1", "c2"):
                argv = ["fleetgate.cli", "coordinator", "--config", str(cfg), "--id", cid]
                by_id[cid] = _start(tmp_path, argv, f"{cid}.log")
                procs.append(by_id[cid])
            load = [
                "fleetgate.tools.load",
                *("--redis", rut.url, "--prefix", rut.prefix, "--gate", "llm"),
                *("--target-url", served.url, "--concurrency", str(USERS), "--rate", "0"),
                *("--floor", str(FLOOR), "--metrics-listen", "127.0.0.1:0"),
            ]
            procs.append(_start(tmp_path, load, "load.log"))

            # The target grows from the floor (slow start) and settles where the load stops
            # filling it: wait until two consecutive polls published the same value, >= 8x floor.
            seen: list[tuple[str, int]] = []

            async def settled() -> bool:
                target = await r.hgetall(keys.target)
                poll = (await r.hget(keys.util, "last_poll")) or ""
                if "value" in target and (not seen or seen[-1][0] != poll):
                    seen.append((poll, int(target["value"])))
                last = [v for _, v in seen[-3:]]
                return len(last) == 3 and len(set(last)) == 1 and last[0] >= 8 * FLOOR

            await _until(settled, 60, f"a settled target >= {8 * FLOOR} (seen {seen})")
            leader = await r.get(leader_key)
            assert leader in by_id
            old_epoch = int(await r.hget(keys.target, "epoch") or 0)

            by_id[leader].kill()  # SIGKILL: no resignation, the lease has to lapse
            by_id[leader].wait(10)
            t_kill = time.monotonic()
            # Nobody writes until the standby wins: this is the last target before the kill.
            before = await r.hgetall(keys.target)
            assert int(before["epoch"]) == old_epoch
            last_before = int(before["value"])

            # The limit the pods see (the gate's snapshot, as `fleetgate inspect` reads it),
            # sampled through the takeover until the new epoch's first target.
            limits: list[int] = []

            async def new_epoch_target() -> int | None:
                snap = await scripts.snapshot(keys, listed=0)
                limits.append(snap.limit)
                if (snap.epoch or 0) > old_epoch and snap.live_target is not None:
                    return snap.live_target
                return None

            takeover = DEFAULTS.leader_ttl + DEFAULTS.poll_interval + 10
            first_after = await _until(new_epoch_target, takeover, "the new leader's target")
            took = time.monotonic() - t_kill
            new_leader = await r.get(leader_key)
            print(
                f"leader SIGKILL under the defaults: new epoch's first target {first_after}, "
                f"last before kill {last_before}; lowest limit during the takeover "
                f"{min(limits)} (floor {FLOOR}); new target {took:.1f} s after the kill"
            )
            assert new_leader in by_id and new_leader != leader
            # The case at stake: the takeover outlasts target_ttl_polls polls (6 s).
            assert took > DEFAULTS.target_ttl_polls * DEFAULTS.poll_interval
            assert abs(first_after - last_before) <= 0.1 * last_before, (first_after, last_before)
            assert min(limits) > FLOOR, sorted(set(limits))
    finally:
        await r.aclose()
