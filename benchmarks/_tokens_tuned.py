"""The coordinator tuning a token budget, for :mod:`benchmarks.tokens`: an in-process
:class:`~fleetgate.coordinator.daemon.Coordinator` leading one gate on the KV-limited vLLM
simulator, its token budget starting from a wrong ``token_limit``; every poll's decision is
recorded (the budget, why, the KV cache the simulator states, the tokens the fleet held)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fleetgate.coordinator.config import Config
from fleetgate.coordinator.daemon import Coordinator

__all__ = ["converged_at", "effective", "tuned_coordinator"]

#: the tuned ways' poll interval (seconds): the convergence goal counts polls
POLL = 1.0
#: within this fraction of the stated capacity counts as converged
NEAR = 0.10


def _config(
    url: str,
    prefix: str,
    sim_url: str,
    gate: str,
    settings: dict[str, Any],
    tenants: dict[str, int],
    tune: bool,
) -> Config:
    weights = "\n".join(f"{t} = {w}" for t, w in tenants.items())
    toml = f"""
[redis]
url = "{url}"
prefix = "{prefix}"

[coordinator]
poll_interval = {POLL}
poll_jitter = 0.0
leader_ttl = 5.0
metrics_listen = "127.0.0.1:0"

[[gates]]
name = "{gate}"
base_url = "{sim_url}/v1"
server = "vllm"
floor = {settings["floor"]}
ceiling = {settings["floor"]}
max_queued = {settings["max_queued"]}
token_limit = {settings["token_limit"]}
token_ceiling = {settings.get("token_ceiling", settings["token_limit"])}
tune_tokens = {"true" if tune else "false"}
[gates.tenant_weights]
{weights}
"""
    return Config.from_toml_text(toml, env={})


@contextlib.asynccontextmanager
async def tuned_coordinator(
    url: str,
    prefix: str,
    sim_url: str,
    gate: str,
    settings: dict[str, Any],
    tenants: dict[str, int],
    *,
    tune: bool = True,
) -> AsyncIterator[list[dict[str, Any]]]:
    """A coordinator leading ``gate`` while the block runs (``tune`` False: it does not tune the
    token budget, so a static budget runs beside the same poll); yields its per-poll records
    (only with ``tune``)."""
    logging.getLogger("fleetgate.coordinator").setLevel(logging.WARNING)
    config = _config(url, prefix, sim_url, gate, settings, tenants, tune)
    coord = Coordinator(config, coordinator_id="bench-tokens")
    polls: list[dict[str, Any]] = []
    original = coord.poll_once

    async def recorded() -> Any:
        pubs = await original()
        for p in pubs:
            t, s = p.tokens, p.signals
            if t is None:
                continue
            polls.append(
                {
                    "budget": t.budget,
                    "reason": t.reason.value,
                    "publish": t.publish,
                    "kv_tokens": None if s is None else s.kv_tokens,
                    "kv_usage": None if s is None else s.kv_cache_usage,
                    "preempted": None if s is None else s.preempted,
                    "tokens_held": p.tokens_held,
                    "use_ratio": t.state.use_ratio,
                }
            )
        return pubs

    coord.poll_once = recorded  # type: ignore[method-assign]
    stop = asyncio.Event()
    task = asyncio.create_task(coord.run(stop))
    try:
        yield polls
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


def effective(poll: dict[str, Any]) -> float:
    """A poll's budget in tokens the calls use: the charged budget x the use ratio the
    coordinator measured (1 before it knew one)."""
    return float(poll["budget"]) * (poll.get("use_ratio") or 1.0)


def converged_at(polls: Sequence[dict[str, Any]], capacity: float) -> int | None:
    """The first poll (1-based) from which every budget, in tokens used (:func:`effective`),
    stays within :data:`NEAR` of ``capacity``; None when the last poll is not."""
    first = None
    for i, p in enumerate(polls, start=1):
        if abs(effective(p) - capacity) <= NEAR * capacity:
            first = first or i
        else:
            first = None
    return first
