"""uncontended: one process, sequential ``async with gate.permit()`` vs a raw EVALSHA no-op pair.

Six variants run in the same process against the same private server, interleaved in short
rounds so drift (CPU frequency, other load) hits them alike. Each adds one cost to the previous:

* ``raw no-op pair``: two trivial ``return 1`` scripts by EVALSHA, no keys, on a plain redis-py
  client with its defaults (the baseline);
* ``+ fleetgate's client options``: the same on a client made by ``fleetgate._redis.connect``
  (socket timeouts, a bounded blocking pool);
* ``+ gate KEYS/ARGV``: the same no-ops given the real KEYS and ARGV (argument encoding);
* ``+ gate reply shape``: no-ops returning arrays shaped like acquire's and release's replies
  (reply parsing: costly with the pure-Python parser);
* ``scripts only (real Lua)``: ``fleet.scripts.acquire`` + ``release`` (server-side Lua), two
  calls as a caller that awaited each would make them;
* ``permit()``: ``async with gate.permit(): pass`` (the client logic: deadline, lease, metrics).
  A release leaves with the gate's next call, so sequential permits cost one
  script call each (the release of one rides with the acquire of the next): ``permit()`` can be
  cheaper than "scripts only", and the gap between them no longer isolates the client logic.

Ratio = permit() rate / raw no-op pair rate (target >= 0.8); the same ratio from median per-op
latencies is reported too, as it is insensitive to stalls caused by other load on the machine.
Server time per operation comes from INFO commandstats (``evalsha`` + ``fcall`` usec / calls,
script-internal commands included: the gate scripts are FCALLs of a Functions library).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aredis

from fleetgate._redis import connect

from ._common import (
    Headline,
    Options,
    figure,
    log,
    open_fleet,
    percentiles,
    save,
    table,
)
from ._server import (
    configure_gate,
    delta,
    private_redis,
    redis_counters,
    sync_client,
)

NAME = "uncontended"
GATE = "bench-uncontended"
TARGET = 0.8
BASELINE, PERMIT = "raw no-op pair", "permit()"


async def _timed(op: Callable[[], Awaitable[Any]], seconds: float) -> tuple[int, float, list[int]]:
    """Run ``op`` back to back for ``seconds``: (ops, elapsed s, per-op ns)."""
    lat: list[int] = []
    start = time.perf_counter_ns()
    end = start + int(seconds * 1e9)
    t = start
    while t < end:
        await op()
        t2 = time.perf_counter_ns()
        lat.append(t2 - t)
        t = t2
    return len(lat), (t - start) / 1e9, lat


async def _measure(url: str, opts: Options) -> dict[str, dict[str, Any]]:
    # Many short rounds: bursts of outside load then hit every variant about alike.
    rounds, seconds = opts.pick((20, 0.5), (5, 0.2))
    monitor = sync_client(url)
    # Plain redis-py (its defaults: simple pool, no socket timeouts), same parser.
    plain = aredis.Redis.from_url(url, decode_responses=True, **opts.flavor.redis_options())
    # A client made the way fleetgate makes its own (timeouts, bounded pool).
    raw = connect(url, **opts.flavor.redis_options())
    async with open_fleet(url, opts.flavor) as fleet:
        gate = fleet.gate(GATE)
        plain_a = plain.register_script("return 1")
        plain_b = plain.register_script("return 1 -- b")
        noop_a = raw.register_script("return 1")
        noop_b = raw.register_script("return 1 -- b")
        # acquire's reply shape
        shaped_a = raw.register_script("return {1, 2, 1, 1, 10000, 5000, 1}")
        shaped_b = raw.register_script("return {1, 1}")  # release's reply shape
        keys = gate.keys.script_keys()
        argv = ["pod:1", 30_000, *gate.defaults.argv()]

        async def raw_pair() -> None:
            await plain_a(keys=[], args=[])
            await plain_b(keys=[], args=[])

        async def raw_pair_fleetgate_client() -> None:
            await noop_a(keys=[], args=[])
            await noop_b(keys=[], args=[])

        async def raw_pair_args() -> None:
            await noop_a(keys=keys, args=argv)
            await noop_b(keys=keys, args=argv[:1])

        async def raw_pair_shaped() -> None:
            await shaped_a(keys=keys, args=argv)
            await shaped_b(keys=keys, args=argv[:1])

        ids = iter(range(1, 1 << 62))

        async def scripts_only() -> None:
            lease_id = f"{fleet.pod_key}:s{next(ids)}"
            await fleet.scripts.acquire(gate.keys, lease_id, 30_000, gate.defaults)
            await fleet.scripts.release(gate.keys, lease_id)

        async def permit() -> None:
            async with gate.permit(deadline=30.0):
                pass

        variants: dict[str, Callable[[], Awaitable[None]]] = {
            BASELINE: raw_pair,
            "+ fleetgate's client options": raw_pair_fleetgate_client,
            "+ gate KEYS/ARGV": raw_pair_args,
            "+ gate reply shape": raw_pair_shaped,
            "scripts only (real Lua)": scripts_only,
            PERMIT: permit,
        }
        acc: dict[str, dict[str, Any]] = {
            k: {"ops": 0, "seconds": 0.0, "lat": [], "evalsha_calls": 0.0, "evalsha_usec": 0.0}
            for k in variants
        }
        for op in variants.values():  # warm-up: scripts loaded, connections open
            await _timed(op, 0.2)
        for r in range(rounds):
            for name, op in variants.items():
                before = redis_counters(monitor)
                n, secs, lat = await _timed(op, seconds)
                d = delta(before, redis_counters(monitor))
                a = acc[name]
                a["ops"] += n
                a["seconds"] += secs
                a["lat"] += lat
                # the raw variants run EVALSHA, fleetgate's scripts FCALL (a Functions library)
                a["evalsha_calls"] += d.get("calls:evalsha", 0.0) + d.get("calls:fcall", 0.0)
                a["evalsha_usec"] += d.get("usec:evalsha", 0.0) + d.get("usec:fcall", 0.0)
            log(f"{NAME}: round {r + 1}/{rounds}")
    await raw.aclose()
    await plain.aclose()
    monitor.close()
    out: dict[str, dict[str, Any]] = {}
    for name, a in acc.items():
        pct = percentiles([x / 1000 for x in a["lat"]])
        out[name] = {
            "ops": a["ops"],
            "ops_per_s": a["ops"] / a["seconds"],
            "latency_us": pct,
            "lua_us_per_op": a["evalsha_usec"] / max(1, a["ops"]),
            "evalsha_per_op": a["evalsha_calls"] / max(1, a["ops"]),
        }
    return out


def run(opts: Options) -> list[Headline]:
    with private_redis() as rp:
        configure_gate(
            rp.url, GATE, floor=1, ceiling=1, max_queued=1000, lease_ms=10_000, waiter_ms=5_000
        )
        res = opts.flavor.run(_measure(rp.url, opts))
        base = res[BASELINE]
        rows = []
        for name, v in res.items():
            v["ratio"] = v["ops_per_s"] / base["ops_per_s"]
            # The same ratio from median latencies: insensitive to stalls caused by other load.
            v["ratio_p50"] = base["latency_us"]["p50"] / v["latency_us"]["p50"]
            lat = v["latency_us"]
            rows.append(
                (name, v["ops_per_s"], v["ratio"], v["ratio_p50"], lat["p50"], lat["p99"],
                 v["lua_us_per_op"])
            )  # fmt: skip
        ratio, ratio_p50 = res[PERMIT]["ratio"], res[PERMIT]["ratio_p50"]
        text = table(
            ("variant", "ops/s", "vs raw", "vs raw (p50)", "p50 µs", "p99 µs", "Lua µs/op"), rows
        )
        text += (
            f"\npermit() / raw no-op pair = {ratio:.2f} by rate, {ratio_p50:.2f} by median "
            f"latency (target >= {TARGET})"
        )
        fig, ax = figure(2)
        names = list(res)
        ax[0][0].barh(names, [res[n]["ops_per_s"] for n in names], color="tab:blue")
        ax[0][0].set_xlabel("sequential operations / s (one process)")
        ax[0][0].invert_yaxis()
        ax[0][1].barh(names, [res[n]["latency_us"]["p50"] for n in names], label="p50")
        ax[0][1].barh(names, [res[n]["lua_us_per_op"] for n in names], label="Lua (server)")
        ax[0][1].set_xlabel("µs per operation")
        ax[0][1].invert_yaxis()
        ax[0][1].tick_params(labelleft=False)
        ax[0][1].legend()
        fig.suptitle(f"uncontended acquire+release ({opts.flavor.label})")
        data = {"variants": res, "ratio": ratio, "ratio_p50": ratio_p50, "target": TARGET}
        save(NAME, opts, rp.url, data, text, fig)
    return [
        Headline(NAME, "permit() rate / raw EVALSHA pair", f"{ratio:.2f}", f">= {TARGET}",
                 ratio >= TARGET),
        Headline(NAME, "the same, by median latency", f"{ratio_p50:.2f}", f">= {TARGET}",
                 ratio_p50 >= TARGET),
    ]  # fmt: skip


if __name__ == "__main__":
    import sys

    from ._common import main

    sys.exit(main(only=[NAME]))
