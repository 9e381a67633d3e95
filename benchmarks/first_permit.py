"""first_permit: the very first permit on a new Redis, with and without ``fleetgate init``.

Each round starts a private redis-server that never held fleetgate state, opens a ``Fleet``
with the defaults (heartbeat 1 s, so a recovery fence of 3 s) and times its first
``async with gate.permit()`` from the call until the block is entered; the Fleet's opening
(connections, first contact) is timed apart. Variant ``init``: ``fleetgate init``
(:func:`fleetgate.stamp.init_prefix`) ran before the Fleet opened; ``no init``: a first start
as before it, where a new prefix cannot be told from a wiped one and the first permit waits
the fence. The same two on a 3-master Cluster started once, a new prefix each round, stamped
per gate (``init --gate``). The variants alternate round by round. The first permit includes
loading the scripts (a Functions library) onto the new server: what any first start pays.

Target: the first permit after init in < 100 ms (issue 40), at the largest of the rounds.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from prometheus_client import CollectorRegistry

from fleetgate.client import Fleet
from fleetgate.stamp import init_prefix
from fleetgate.tools.redisproc import RedisClusterProcess, RedisProcess

from ._common import Headline, Options, log, open_fleet, save, table
from ._server import PREFIX

NAME = "first_permit"
TARGET_MS = 100.0
GATE = "bench-first"
VARIANTS = ("init", "no init", "Cluster: init --gate", "Cluster: no init")


async def _first_permit(fleet: Fleet) -> float:
    """ms from the call of the first ``permit()`` until its block is entered."""
    t0 = time.perf_counter()
    async with fleet.gate(GATE, floor=4).permit(deadline=30):
        return (time.perf_counter() - t0) * 1000


async def _round(stamp: bool, opts: Options) -> tuple[float, float]:
    """(ms to open the Fleet, ms of its first permit) on a new server."""
    with RedisProcess() as proc:
        if stamp:
            outcome = await init_prefix(proc.url, PREFIX)
            assert outcome.result == "stamped", outcome.message()
        t0 = time.perf_counter()
        async with open_fleet(proc.url, opts.flavor) as fleet:
            opened = (time.perf_counter() - t0) * 1000
            return opened, await _first_permit(fleet)


async def _cluster_round(url: str, stamp: bool) -> tuple[float, float]:
    """The same on a prefix new to a running 3-master cluster (stamped per gate)."""
    prefix = f"fp{uuid.uuid4().hex[:8]}"
    if stamp:
        outcome = await init_prefix(url, prefix, gates=[GATE])
        assert outcome.result == "stamped", outcome.message()
    t0 = time.perf_counter()
    async with Fleet(url, prefix=prefix, registry=CollectorRegistry()) as fleet:
        opened = (time.perf_counter() - t0) * 1000
        return opened, await _first_permit(fleet)


def run(opts: Options) -> list[Headline]:
    rounds = opts.pick(10, 3)
    ms: dict[str, list[tuple[float, float]]] = {v: [] for v in VARIANTS}
    with RedisClusterProcess(3) as cluster:
        for i in range(rounds):
            order = VARIANTS if i % 2 == 0 else VARIANTS[::-1]
            for variant in order:
                stamp = "no init" not in variant
                if variant.startswith("Cluster"):
                    one = opts.flavor.run(_cluster_round(cluster.url, stamp))
                else:
                    one = opts.flavor.run(_round(stamp, opts))
                ms[variant].append(one)
                log(f"{NAME}: round {i + 1}/{rounds} {variant}: first permit {one[1]:.1f} ms")
    rows: list[tuple[Any, ...]] = []
    data: dict[str, Any] = {"rounds": rounds, "target_ms": TARGET_MS, "variants": {}}
    for variant in VARIANTS:
        firsts = sorted(f for _, f in ms[variant])
        opens = sorted(o for o, _ in ms[variant])
        med = firsts[len(firsts) // 2]
        rows.append((variant, med, firsts[-1], opens[len(opens) // 2]))
        data["variants"][variant] = {"first_permit_ms": firsts, "fleet_open_ms": opens}
    text = table(("variant", "first permit median ms", "max ms", "Fleet open median ms"), rows)
    with RedisProcess() as proc:  # the server's version, for the record
        save(NAME, opts, proc.url, data, text)
    heads = []
    for variant in ("init", "Cluster: init --gate"):
        worst = max(f for _, f in ms[variant])
        heads.append(
            Headline(
                NAME, f"first permit after {variant} (max)", f"{worst:.1f} ms",
                f"< {TARGET_MS:.0f} ms", worst < TARGET_MS,
            )
        )  # fmt: skip
    return heads
