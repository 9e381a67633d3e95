"""Where a gate's tuned token budget went in the demo: from the configured ``token_limit`` to the
KV cache the server states, when it came within :data:`TOLERANCE` of it, where it settled. The
budget counts what callers are *charged*; the cache holds what calls *use*: the budget is
compared with the cache in tokens used (the budget x the used / charged ratio the coordinator
measured from the settlements, ``token_use_ratio``; 1 while unknown).

Pure functions of the samples (:class:`~fleetgate.demo.report.Sample`), used by the summary, the
printed report and the plot's token panel (:mod:`fleetgate.demo.picture`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import msgspec

__all__ = ["TOLERANCE", "TokenBudgetRun", "token_budget_run"]

#: "converged": the budget within this fraction of the server's stated KV cache
TOLERANCE = 0.10


class TokenBudgetRun(msgspec.Struct, kw_only=True):
    """One gate's token budget over the run (times in seconds since the load started)."""

    #: the budget of the first sample (the configured ``token_limit`` until the first tuning)
    first: int
    #: the budget of the last sample, and since when it has been that
    final: int
    final_since: float
    #: the last sample's budget in tokens the calls use, and the used / charged ratio behind it
    final_in_use: int
    use_ratio: float | None
    #: the KV cache the server stated (its last value seen)
    stated: int | None
    #: the first sample whose budget is within TOLERANCE of the stated cache (None: none was)
    reached_at: float | None
    #: whether every sample from ``reached_at`` on stays within TOLERANCE
    stayed: bool
    peak_held: int
    #: the server's preemptions over the run (None: unknown)
    preemptions: int | None

    def as_dict(self) -> dict[str, Any]:
        """Plain data, for ``demo.json``'s summary."""
        return msgspec.to_builtins(self)  # type: ignore[no-any-return]


class _Gate(Protocol):
    """What is read of a :class:`~fleetgate.demo.report.GateSample` (that module imports this
    one, so its types are described here, not imported)."""

    @property
    def token_limit(self) -> int | None: ...
    @property
    def tokens_held(self) -> int | None: ...
    @property
    def server_kv_tokens(self) -> int | None: ...
    @property
    def server_preemptions(self) -> int | None: ...
    @property
    def token_use_ratio(self) -> float | None: ...


class _Sample(Protocol):
    """What is read of a :class:`~fleetgate.demo.report.Sample`."""

    @property
    def t(self) -> float: ...
    @property
    def gates(self) -> Mapping[str, _Gate]: ...


def _near(budget: int, stated: int | None) -> bool:
    return stated is not None and stated > 0 and abs(budget - stated) <= TOLERANCE * stated


def token_budget_run(samples: Sequence[_Sample], gate: str) -> TokenBudgetRun | None:
    """What ``gate``'s token budget did over ``samples``; None when it has none."""
    rows = [
        (s.t, g)
        for s in samples
        if (g := s.gates.get(gate)) is not None and g.token_limit is not None
    ]
    if not rows:
        return None
    stated_seen = [g.server_kv_tokens for _, g in rows if g.server_kv_tokens is not None]
    stated = stated_seen[-1] if stated_seen else None
    budgets = [(t, int(g.token_limit or 0)) for t, g in rows]
    # a budget in tokens used: x the ratio known then (1 before it is)
    in_use = [
        int(b * (g.token_use_ratio or 1.0)) for (_, b), (_, g) in zip(budgets, rows, strict=True)
    ]
    final = budgets[-1][1]
    since = budgets[-1][0]
    for t, b in reversed(budgets):
        if b != final:
            break
        since = t
    reached = next((i for i, u in enumerate(in_use) if _near(u, stated)), None)
    preempted = [g.server_preemptions for _, g in rows if g.server_preemptions is not None]
    return TokenBudgetRun(
        first=budgets[0][1],
        final=final,
        final_since=since,
        final_in_use=in_use[-1],
        use_ratio=rows[-1][1].token_use_ratio,
        stated=stated,
        reached_at=budgets[reached][0] if reached is not None else None,
        stayed=reached is not None and all(_near(u, stated) for u in in_use[reached:]),
        peak_held=max((g.tokens_held or 0) for _, g in rows),
        preemptions=preempted[-1] - preempted[0] if preempted else None,
    )
