"""Weights, bands and tenants as ``fleetgate status`` and ``inspect`` show them, and as the
README's redis-cli commands read them, over one scene on a real redis-server. The same scene's
key types are ``fleetgate check``'s (``test_redis_safety.py``); the coordinator's units in
flight: ``tests/coordinator/test_units_in_flight.py``; the client metrics' priority and tenant
labels: ``tests/client/test_metrics.py``."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from fleetgate.client import Fleet, Gate, Lease, Overloaded
from fleetgate.commands import format_inspect
from fleetgate.status import format_status, gather_status
from fleetgate.tools.redisproc import RedisProcess

README = Path(__file__).resolve().parents[2] / "README.md"


@dataclass
class Scene:
    gate: Gate
    held: list[Lease]
    tasks: list[asyncio.Task[Lease]]
    refusals: list[str]


async def _scene(fleet: Fleet) -> Scene:
    """Gate ``rerank``, limit 8 (ceiling 16): 7 units held by 2 leases; waiting: search 3 at
    priority 10 (its weight-4 head keeps the free unit: reserved), the default tenant 1 at
    priority 5 (weight 12: heavier than the limit) and 1 at priority 0, ingest 2 at priority 0
    (its third was evicted by search's third); one call refused per tenant bound, one shed."""
    r = fleet.redis
    gate = fleet.gate("rerank", floor=8, ceiling=16)
    cfg = {"floor": 8, "ceiling": 16, "max_queued": 7, "max_queued_per_tenant": 3}
    await r.hset(gate.keys.cfg, mapping={**cfg, "shed_below": 0})
    await r.hset(gate.keys.tenant_weights, mapping={"search": 3, "ingest": 1})
    held = [await gate.acquire(weight=3), await gate.acquire(weight=4), await gate.acquire()]
    tasks: list[asyncio.Task[Lease]] = []

    def park(weight: int = 1, priority: int = 0, tenant: str | None = None) -> None:
        call = gate.acquire(deadline=60, weight=weight, priority=priority, tenant=tenant)
        tasks.append(asyncio.create_task(call))

    for _ in range(3):
        park(tenant="ingest")
    park(priority=10, tenant="search", weight=4)
    park(priority=10, tenant="search")
    park()
    park(priority=5, weight=12)
    await _until(lambda: _queued(gate) == 7)
    refusals = []
    for priority, tenant in ((0, "ingest"), (-5, None)):
        with pytest.raises(Overloaded) as info:
            await gate.acquire(deadline=1, priority=priority, tenant=tenant)
        refusals.append(str(info.value))
    park(priority=10, tenant="search")  # the list is full: ingest's newest waiter leaves
    await _until(lambda: sum(t.done() for t in tasks) == 1)
    await held.pop().release()  # one unit free, kept for search's weight-4 head
    await fleet.flush()
    return Scene(gate, held, tasks, refusals)


def _queued(gate: Gate) -> int:
    return sum(1 for w in gate.waiters.values() if w.parked)


async def _until(check: object, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.02)


async def _end(scene: Scene) -> None:
    for task in scene.tasks:
        task.cancel()
    for outcome in await asyncio.gather(*scene.tasks, return_exceptions=True):
        if isinstance(outcome, Lease):
            await outcome.release()
    for lease in scene.held:
        await lease.release()


@pytest.fixture
async def scene_fleet() -> AsyncIterator[tuple[RedisProcess, Fleet, Scene]]:
    """The scene in a private server under the default prefix (the README's key names)."""
    if not RedisProcess.available():
        pytest.skip("redis-server missing")
    with RedisProcess() as proc:
        async with Fleet(proc.url, registry=CollectorRegistry(), heartbeat_interval=0.2) as fleet:
            scene = await _scene(fleet)
            await fleet.redis.sadd("fg:gates", "rerank")
            try:
                yield proc, fleet, scene
            finally:
                await _end(scene)


def fleetgate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fleetgate.cli", *args], capture_output=True, text=True, timeout=60
    )


# ------------------------------------------------------------------------- status and inspect


async def test_status_shows_units_bands_and_tenants(
    scene_fleet: tuple[RedisProcess, Fleet, Scene],
) -> None:
    proc, fleet, scene = scene_fleet
    assert len(scene.refusals) == 2
    status = await gather_status(fleet.redis, "fg", tenants=1)
    [g] = status.gates
    assert (g.units, g.limit, g.in_flight, g.queued, g.schema) == (7, 8, 2, 7, 2)
    assert (g.max_queued_per_tenant, g.shed_below) == (3, 0)
    assert g.tenant_weights == {"search": 3, "ingest": 1}
    assert [(b.priority, b.queued, b.lanes) for b in g.bands] == [(10, 3, 1), (5, 1, 1), (0, 3, 2)]
    assert g.bands[0].reserved is not None and g.bands[0].reserved.endswith("w4")
    assert g.bands[0].reserved_tenant == "search"
    # capped at one tenant (the largest queue), the rest summed as other
    assert [(t.tenant, t.queued) for t in g.tenants] == [("search", 3)]
    assert (g.tenants_other, g.unlisted) == (4, 0)
    assert (g.evicted, g.shed, g.rejected_tenant, g.too_heavy) == (1, 1, 1, 0)

    text = format_status(status, time.time())
    assert "7/8" in text
    assert re.search(
        r"queued by priority: p10 3 \(units kept for \S+w4 of search\), p5 1, p0 3", text
    )
    assert "queued by tenant:   search 3, other 4" in text

    out = fleetgate("status", "--json", "--tenants", "2", "--redis", proc.url)
    assert out.returncode == 0, out.stderr
    [row] = json.loads(out.stdout)["gates"]
    assert row["in_flight"] == 2 and row["units"] == 7  # the old field keeps its meaning
    # a tie (ingest and the default tenant wait 2 each) keeps the order of service
    assert [t["tenant"] for t in row["tenants"]] == ["search", ""]
    assert row["tenants_other"] == 2


async def test_inspect_lists_lanes_in_service_order_with_their_heads(
    scene_fleet: tuple[RedisProcess, Fleet, Scene],
) -> None:
    proc, _, scene = scene_fleet
    snap = await scene.gate.snapshot()
    text = format_inspect("rerank", snap)
    lanes = [line.split() for line in text.splitlines() if line.startswith("    p")]
    # band 10 first; in band 0 the lanes by tag (equal: by name, the default tenant first);
    # the oversize lane after the fair order
    assert [(lane[0], lane[1]) for lane in lanes] == [
        ("p10", "search"),
        ("p0", "(default)"),
        ("p0", "ingest"),
        ("p5", "(default)"),
    ]
    lines = {
        line.split()[0] + line.split()[1]: line
        for line in text.splitlines()
        if line.startswith("    p")
    }
    assert "units kept for" in lines["p10search"]
    assert "heavier than the limit" in lines["p5(default)"]
    assert "units held 7/8 by 2 leases" in text and "tenant weights ingest=1 search=3" in text
    heads = re.findall(r"waiter (\S+)\s+weight (\d+)", text)
    assert heads[0][1] == "4" and len(heads) == 7

    out = fleetgate("inspect", "rerank", "--redis", proc.url, "-n", "2")
    assert out.returncode == 0, out.stderr
    assert "p10   search" in out.stdout and "2 more waiting in lanes not listed" in out.stdout
    assert "weight 4" in out.stdout
    raw = json.loads(fleetgate("inspect", "rerank", "--json", "--redis", proc.url).stdout)
    assert raw["units"] == 7 and [lane["priority"] for lane in raw["lanes"]] == [10, 0, 0, 5]


# ------------------------------------------------------------------- the README's redis-cli


def _readme_commands() -> list[tuple[str, str]]:
    """(command, comment) of the README's redis-cli block, the ``G=`` line excepted."""
    text = README.read_text()
    section = text[text.index("## Inspecting a gate with redis-cli") :]
    block = section[section.index("```bash") + len("```bash") :]
    block = block[: block.index("```")]
    out = []
    for line in block.strip().splitlines():
        if line.startswith("G="):
            assert line == "G='fg:{rerank}'"
            continue
        command, _, comment = line.partition("  #")
        out.append((command.strip(), comment.strip()))
    return out


@pytest.mark.skipif(shutil.which("redis-cli") is None, reason="redis-cli missing")
async def test_readme_redis_cli_commands_read_a_real_gate(
    scene_fleet: tuple[RedisProcess, Fleet, Scene],
) -> None:
    proc, _, scene = scene_fleet
    answers: dict[str, list[str]] = {}
    for command, _ in _readme_commands():
        assert command.startswith("redis-cli "), command
        shell = f"G='fg:{{rerank}}'; redis-cli -p {proc.port} {command[len('redis-cli ') :]}"
        out = await asyncio.to_thread(
            subprocess.run, ["bash", "-c", shell], capture_output=True, text=True, timeout=10
        )
        assert out.returncode == 0 and "ERR" not in out.stdout, (command, out.stdout, out.stderr)
        answers[command] = out.stdout.split()

    def answer(start: str) -> list[str]:
        [found] = [v for k, v in answers.items() if k.startswith(start)]
        return found

    snap = await scene.gate.snapshot()
    held, extra = (
        answer('redis-cli ZCARD   "$G:holders"'),
        answer('redis-cli HGET    "$G:adm" extra'),
    )
    assert int(held[0]) + int(extra[0]) == snap.units == 7
    assert len(answer('redis-cli ZRANGE  "$G:fair" 0 -1')) == 3
    assert answer('redis-cli ZRANGE  "$G:big"') == ["}095", "12"]
    line = answer('redis-cli ZRANGE  "$G:lanes" "[search}090}"')
    assert len(line) == 3 and all(m.startswith("search}090}") for m in line)
    assert line[0].endswith("w4")
    assert answer('redis-cli ZLEXCOUNT "$G:lanes" "[search}090}"') == ["3"]
    assert answer('redis-cli ZLEXCOUNT "$G:lanes" "[search}" ') == ["3"]
    assert answer('redis-cli ZLEXCOUNT "$G:lanes" "[}"') == ["2"]
    assert answer('redis-cli ZRANGE  "$G:fair" "[090}"')[0].endswith("}search")
    assert answer('redis-cli HGET    "$G:adm" rsv:090') == [line[0]]
    weights = answer('redis-cli HGETALL "$G:tw"')
    assert dict(zip(weights[::2], weights[1::2], strict=True)) == {"search": "3", "ingest": "1"}
    stats = answer('redis-cli HGETALL "$G:stats"')
    counters = dict(zip(stats[::2], stats[1::2], strict=True))
    assert (counters["shed"], counters["rejected_tenant"], counters["evicted"]) == ("1", "1", "1")
    assert answer('redis-cli ZCARD   "$G:waiters"') == [str(snap.queued)]
    assert "2" in answer('redis-cli HGETALL "$G:cfg"')  # the schema
