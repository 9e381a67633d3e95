"""What a load-generating process is told to drive (:class:`LoadSpec`, one :class:`GateLoad` per
gate) and what it reports (:class:`WorkerStats`); the demo hands a spec over as JSON in
``$FLEETGATE_LOAD_SPEC``."""

from __future__ import annotations

from typing import Literal

import msgspec

__all__ = ["SPEC_ENV", "GateLoad", "Kind", "LoadSpec", "WorkerStats"]

SPEC_ENV = "FLEETGATE_LOAD_SPEC"

Kind = Literal["completions", "chat", "embed", "rerank"]


class GateLoad(msgspec.Struct, frozen=True):
    """The load one process puts on one gate."""

    name: str
    kind: Kind
    url: str  # the server's base URL, without /v1 and trailing slash
    floor: int = 1  # registered if Redis has no config for the gate yet
    users: int = 1  # concurrent request loops
    rate: float = 0.0  # request starts per second shared by the users, 0 = back to back
    calls: int = 1  # calls per request (gate.map over them): embed, rerank
    fan: int = 1  # max_in_flight of that map
    passages: int = 64  # rerank: passages per call
    model: str = ""  # sent as "model" when set
    stream: bool = False  # completions, chat: ask for a streamed reply and read it to its end
    #: completions, chat: the prompt's length in tokens as the simulator counts them (4
    #: characters a token), padded after the request's own text; 0: that text alone
    prompt_tokens: int = 0
    max_tokens: int = 0  # completions, chat: the output asked; 0: 16 (completions), 32 (chat)
    #: completions, chat: charge the gate's token budget per call (permit(tokens=...): the prompt
    #: at 3 characters a token plus max_tokens, in whole blocks of this many tokens) and report
    #: the tokens the reply's usage says were used; 0: no tokens charged
    token_block: int = 0


class LoadSpec(msgspec.Struct, frozen=True):
    """Everything one load-generating process needs."""

    redis_url: str
    prefix: str
    gates: list[GateLoad]
    pod_id: str | None = None  # None: the client's host-pid-random id
    deadline: float = 30.0  # total deadline of one request, queue wait included
    retry: bool = False  # let gate.map retry transient call failures
    duration: float = 0.0  # stop after this many seconds, 0 = at SIGTERM/SIGINT
    metrics_listen: tuple[str, int] | None = None  # where to serve /metrics
    log_interval: float = 0.0  # seconds between progress lines, 0 = none
    stats_path: str | None = None  # WorkerStats as JSON, replaced every second and at exit
    parent_pid: int | None = None  # stop when the parent is no longer this pid


class WorkerStats(msgspec.Struct):
    """What a process reports: per gate, requests and calls that succeeded, errors by kind."""

    worker_id: str
    pid: int
    updated: float = 0.0
    requests: dict[str, int] = msgspec.field(default_factory=dict)
    calls: dict[str, int] = msgspec.field(default_factory=dict)
    errors: dict[str, dict[str, int]] = msgspec.field(default_factory=dict)
    stopped: bool = False
