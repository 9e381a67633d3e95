"""Throughput through the adaptive gate against a static limit of N and against no gate, on one
real llama-server in one run (rounds interleaved A S G, G S A so that drift hits all alike).

The same closed-loop callers (3 per slot) in each mode; a call generates N_PREDICT tokens. Each
measured window is read from the server's own counters: how many slots were busy per decode step
on average (N when the server never waits for a request), and slot-tokens decoded per second
(every decode step adds its busy slots); calls completed are printed too. The assertion is on the
busy slots: adaptive >= 0.9 x no gate. Not on calls/s nor tokens/s: a window holds only 10-40
calls, and the speed of a decode step follows the machine's load, which on a shared 2-core box
swung 2x between two rounds of the same mode (no gate 90 then 39 slot-tokens/s, calls/s 0.5 or
1.5 by chance), while what the gate decides -- whether a freed slot gets its next request at
once -- shows in the busy slots whatever the speed. The throughput goal (>= 0.97 and >= the best
static limit) is for the benchmark's medians, not for CI.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import redis.asyncio as aredis
from prometheus_client import CollectorRegistry

from fleetgate.client import Fleet, Gate
from fleetgate.keys import GateKeys

from ..conftest import RedisUnderTest
from ..coordinator._coordinator import running as coordinating
from ._llama import (
    N_PREDICT,
    PERMIT_DEADLINE,
    POLL,
    SLOTS,
    Callers,
    LlamaServer,
    PollRecord,
    coordinator_config,
    first_in,
    llama_gate,
    median,
    recording,
)

pytestmark = [pytest.mark.real_server, pytest.mark.timeout(300)]

GATE = "llama"
STATIC = "llama-static"
ORDERS = (("adaptive", "static", "none"), ("none", "static", "adaptive"))
#: seconds each mode runs before and while it is measured
WARMUP, MEASURE = 2.0, 8.0


async def _decoded(http: httpx.AsyncClient) -> tuple[float, float]:
    """Decode steps the server has run since it started, and slot-tokens (busy slots summed
    over those steps), from its /metrics: ``n_decode_total`` and ``n_busy_slots_per_decode``."""
    resp = await http.get("/metrics")
    resp.raise_for_status()
    samples = (line.split() for line in resp.text.splitlines() if line and line[0] != "#")
    values = {name: float(value) for name, value in samples}
    steps = values["llamacpp:n_decode_total"]
    return steps, steps * values["llamacpp:n_busy_slots_per_decode"]


async def _converged(record: PollRecord, timeout: float) -> int:
    """Polls until the target is in [0.8 N, 1.25 N] (fails after ``timeout`` s)."""
    start = len(record.polls)
    end = time.monotonic() + timeout
    while True:
        at = first_in(record.targets(start), 0.8 * SLOTS, 1.25 * SLOTS)
        if at is not None:
            return at
        assert time.monotonic() < end, f"adaptive target not in range: {record}"
        await asyncio.sleep(0.05)


async def test_adaptive_gate_keeps_the_server_about_as_busy_as_no_gate(
    rut: RedisUnderTest, async_redis: aredis.Redis, llama: LlamaServer
) -> None:
    keys = GateKeys.of(rut.prefix, GATE)
    # The static limit is a configured fixed gate, as an operator would set it.
    static_gate = f"""
[[gates]]
name = "{STATIC}"
signal = "fixed"
floor = {SLOTS}
ceiling = {SLOTS}
max_queued = 1000
"""
    cfg = coordinator_config(rut.url, rut.prefix, llama_gate(GATE, llama.url) + static_gate)
    busy: dict[str, list[float]] = {"adaptive": [], "static": [], "none": []}
    tokens: dict[str, list[float]] = {"adaptive": [], "static": [], "none": []}
    calls: dict[str, list[float]] = {"adaptive": [], "static": [], "none": []}
    settle: list[int] = []
    async with (
        Fleet(rut.url, prefix=rut.prefix, registry=CollectorRegistry()) as fleet,
        httpx.AsyncClient(base_url=llama.url, timeout=PERMIT_DEADLINE) as http,
        recording(async_redis, keys) as record,
        coordinating(cfg),
    ):
        gates: dict[str, Gate | None] = {
            "adaptive": fleet.gate(GATE, floor=1, ceiling=32),
            # the fixed gate: its limit is its floor, N
            "static": fleet.gate(STATIC, floor=SLOTS, ceiling=SLOTS),
            "none": None,
        }
        for order in ORDERS:
            for mode in order:
                callers = Callers(http, 3 * SLOTS, gates[mode])
                async with callers.running():
                    await asyncio.sleep(WARMUP)
                    if mode == "adaptive":
                        # measured at its target: after the other modes' load, which this
                        # gate saw as foreign, it has to converge again first
                        settle.append(await _converged(record, timeout=30 * POLL))
                    start, (steps, decoded) = time.monotonic(), await _decoded(http)
                    await asyncio.sleep(MEASURE)
                    end, (steps_end, decoded_end) = time.monotonic(), await _decoded(http)
                busy[mode].append(round((decoded_end - decoded) / (steps_end - steps), 2))
                tokens[mode].append(round((decoded_end - decoded) / (end - start), 1))
                calls[mode].append(round(callers.rate(start, end), 2))
    adaptive, static, none = (sum(busy[m]) / len(busy[m]) for m in ("adaptive", "static", "none"))
    print(
        f"real-server: throughput N={SLOTS}, {3 * SLOTS} callers, {N_PREDICT} tokens a call, "
        f"busy slots per decode step per round: {busy}; slot-tokens/s: {tokens}; calls/s: "
        f"{calls}; mean busy slots adaptive {adaptive:.2f}, static {static:.2f}, no gate "
        f"{none:.2f}; adaptive/no gate {adaptive / none:.3f}, adaptive/static "
        f"{adaptive / static:.3f}; polls to settle per adaptive round {settle}; median target "
        f"{median([t for t in record.targets() if t is not None])}"
    )
    assert adaptive >= 0.9 * none, (busy, tokens, calls)
