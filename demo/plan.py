"""What the demo runs: its gates, the simulator behind each and the load the workers put on them,
the coordinators' timings, and :class:`Setup`, where everything ended up once started."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetgate.coordinator.config import CoordinatorSettings
from fleetgate.tools.load import Kind

__all__ = [
    "BLOCK_SIZE",
    "COORDINATORS",
    "GATES",
    "INGEST_LOOPS",
    "KV_TOKENS",
    "LEADER_TTL",
    "POLL_INTERVAL",
    "SEARCH_RATE",
    "DemoGate",
    "Setup",
]

# The coordinators run with the default poll, leader lease and target lifetime (no override in
# the generated config), so the failover shown is the one a default deployment gets.
_DEFAULTS = CoordinatorSettings()
POLL_INTERVAL = _DEFAULTS.poll_interval
SEARCH_RATE = 4.0  # the search pod's interactive calls per second
INGEST_LOOPS = 240  # its batch backlog at two thirds of the run
LEADER_TTL = _DEFAULTS.leader_ttl
COORDINATORS = ("coord-a", "coord-b")
KV_TOKENS = 32_768  # the chat simulator's KV cache (2,048 blocks of 16 tokens)
BLOCK_SIZE = 16


@dataclass(frozen=True)
class DemoGate:
    """One gate, the simulator behind it and the load each worker puts on it."""

    name: str
    kind: Kind
    model: str
    capacity: int  # the simulator's max_num_seqs / concurrency
    floor: int
    service_ms: float
    users: int  # per worker
    calls: int  # calls per request
    fan: int  # of which at most this many at once
    #: the simulator's KV cache in tokens (None: slots alone). With it the gate has a token
    #: budget, tuned by the coordinator from the cache the server states: it starts at
    #: ``token_limit`` (deliberately a quarter of the cache) and may reach ``token_ceiling``
    kv_tokens: int | None = None
    token_limit: int | None = None
    token_ceiling: int | None = None
    prompt_tokens: int = 0  # each call's prompt (tools/load.py: GateLoad.prompt_tokens)
    max_tokens: int = 0  # and the output it asks (0: the load's default)


GATES = (
    # A call: 600 prompt tokens + 128 out = 736 tokens of KV cache at its end (46 blocks); it is
    # charged 800 + 128 = 928 (its prompt at 3 characters a token). The coordinator learns from
    # the settlements that calls use 0.79 of their charge and fills the 32,768-token cache to
    # 98 % with what they use: a budget of ~40,500 charged tokens, 43 calls. The token budget,
    # not the 48 slots, bounds the calls until the slots are halved (24) at two thirds of the
    # run.
    DemoGate(
        name="llama-3.1-8b", kind="chat", model="meta-llama/Llama-3.1-8B-Instruct",
        capacity=48, floor=4, service_ms=1500.0, users=24, calls=1, fan=1,
        kv_tokens=KV_TOKENS, token_limit=KV_TOKENS // 4, token_ceiling=2 * KV_TOKENS,
        prompt_tokens=600, max_tokens=128,
    ),
    DemoGate(
        name="bge-m3", kind="embed", model="BAAI/bge-m3",
        capacity=96, floor=4, service_ms=1000.0, users=16, calls=8, fan=4,
    ),
    DemoGate(
        name="rerank/nemoretriever-500m-v2", kind="rerank",
        model="nvidia/llama-3.2-nemoretriever-500m-rerank-v2",
        capacity=32, floor=32, service_ms=500.0, users=6, calls=8, fan=4,
    ),
)  # fmt: skip


@dataclass
class Setup:
    """What :func:`~fleetgate.demo.processes.prepare` started."""

    redis_url: str
    redis_label: str
    prefix: str
    urls: dict[str, str]  # gate name → simulator base URL
    gates: list[dict[str, Any]] = field(default_factory=list)
    stats_paths: list[Path] = field(default_factory=list)
    #: the search pod's stats file (fleetgate.demo.interactive), None before it starts
    interactive_path: Path | None = None
    #: the non-Python caller's record (one HTTP status per line), None when curl is missing
    gateway_path: Path | None = None
    #: what ``fleetgate init`` said (the prefix stamped before anything used it)
    stamp: str = ""
