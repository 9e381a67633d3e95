"""first_permit: the very first permit on a new Redis, with and without ``fleetgate init``.

Each round starts a private redis-server that never held fleetgate state, opens a ``Fleet``
with the defaults (heartbeat 1 s, so a recovery fence of 3 s) and times its first
``async with gate.permit()`` from the call until the block is entered; the Fleet's opening
(connections, first contact) is timed apart. Variant ``init``: ``fleetgate init``
(:func:`fleetgate.stamp.init_prefix`) ran before the Fleet opened; ``no init``: a first start
as before it, where a new prefix cannot be told from a wiped one and the first permit waits
the fence. The two alternate round by round. The first permit includes loading the scripts
(a Functions library) onto the new server: what any first start pays.

Target: the first permit after init in < 100 ms (issue 40), at the largest of the rounds.
"""

from __future__ import annotations

import time
from typing import Any

from fleetgate.stamp import init_prefix
from fleetgate.tools.redisproc import RedisProcess

from ._common import Headline, Options, log, open_fleet, save, table
from ._server import PREFIX

NAME = "first_permit"
TARGET_MS = 100.0
VARIANTS = ("init", "no init")


async def _round(stamp: bool, opts: Options) -> tuple[float, float]:
    """(ms to open the Fleet, ms of its first permit) on a new server."""
    with RedisProcess() as proc:
        if stamp:
            outcome = await init_prefix(proc.url, PREFIX)
            assert outcome.result == "stamped", outcome.message()
        t0 = time.perf_counter()
        async with open_fleet(proc.url, opts.flavor) as fleet:
            t1 = time.perf_counter()
            async with fleet.gate("bench-first", floor=4).permit(deadline=30):
                t2 = time.perf_counter()
        return (t1 - t0) * 1000, (t2 - t1) * 1000


def run(opts: Options) -> list[Headline]:
    rounds = opts.pick(10, 3)
    ms: dict[str, list[tuple[float, float]]] = {v: [] for v in VARIANTS}
    for i in range(rounds):
        for variant in VARIANTS if i % 2 == 0 else VARIANTS[::-1]:
            opened, first = opts.flavor.run(_round(variant == "init", opts))
            ms[variant].append((opened, first))
            log(f"{NAME}: round {i + 1}/{rounds} {variant}: first permit {first:.1f} ms")
    rows: list[tuple[Any, ...]] = []
    data: dict[str, Any] = {"rounds": rounds, "target_ms": TARGET_MS, "variants": {}}
    for variant in VARIANTS:
        firsts = sorted(f for _, f in ms[variant])
        opens = sorted(o for o, _ in ms[variant])
        med = firsts[len(firsts) // 2]
        rows.append((variant, med, firsts[-1], opens[len(opens) // 2]))
        data["variants"][variant] = {"first_permit_ms": firsts, "fleet_open_ms": opens}
    text = table(("variant", "first permit median ms", "max ms", "Fleet open median ms"), rows)
    worst = max(f for _, f in ms["init"])
    with RedisProcess() as proc:  # the server's version, for the record
        save(NAME, opts, proc.url, data, text)
    return [
        Headline(
            NAME, "first permit after init (max)", f"{worst:.1f} ms", f"< {TARGET_MS:.0f} ms",
            worst < TARGET_MS,
        )
    ]  # fmt: skip
