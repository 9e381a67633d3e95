"""The token budget's controller: one pure step per poll, as the request limit has its AIMD.

A gate with a ``token_limit`` (tokens held at once by all its leases) and a metrics source gets
its budget tuned from what the server says of its KV cache; the tuned value is published as a
second target (``publish.lua``'s ``token_target``: the same epoch fence and lifetime as the
limit's target), and lapses to the configured ``token_limit`` when no leader renews it. No I/O
and no clock reads here: the caller passes ``now`` (a clock every leader shares) and what it
observed, so the rule is tested without a server; the state is stored with the gate's util
snapshot (``token_state``), so a new leader continues where the old one stopped.

The rule, per poll (constants in :class:`TokenParams`; ``docs/aimd.md``, "The token budget"):

``S`` is the capacity the server states, in tokens (vLLM's ``cache_config_info`` blocks x
block size, SGLang's ``max_total_num_tokens``, TGI's ``tgi_batch_max_total_tokens``,
TensorRT-LLM's KV blocks x tokens per block), times ``overcommit``, in the budget's own unit:
the tokens callers are *charged*. Callers charge an upper bound (a prompt estimated on the safe
side, ``max_tokens`` in full) and the settlements say what the calls used (``report(tokens=)``:
the obs counters ``ta``/``tu``); with ``r`` = used / charged (a running mean over the polls
whose window settled ``min_reports`` calls or more), ``S`` counts ``max(1, kv_target / r)``
charged tokens per token of cache (at most ``max_stretch``): a fleet that charges 30 % more
than it uses fills the cache to ``kv_target`` (0.98) at a budget 1.27 x the cache. ``L`` is the
budget learnt at the last exhaustion (scaled by how ``S`` moved since); the bound is the
smaller of the two known, never above ``high`` (the gate's ``token_ceiling``, else its
``token_limit``: as the request limit's target never passes the ceiling; the scripts clamp a
published budget to it too).

1. signals unknown (scrape failed) -> ``hold_unknown``, not re-published (the published budget
   lapses to ``token_limit``); after ``unknown_reset_polls`` such polls, ``token_limit`` is
   published once (``reset``).
2. budget above ``S`` (by more than ``deadband``) -> ``capacity``: straight down to it, even
   on a poll that saw preemptions (they are the budget's excess, not a short estimate: nothing
   is learnt); the drain period starts, as after a cut.
3. **exhausted** -- the server preempted (retracted, paused) since the last poll, or its KV
   usage is at ``kv_full`` while requests wait for capacity -> ``exhausted``: cut to
   ``decrease`` (0.8) of the smaller of the budget and what the fleet holds, remembered as
   ``L``; only while the fleet holds no more than the budget (more is the excess of before a
   cut or a capacity step, draining: ``hold_cooldown``; with its tokens unknown, once per
   ``drain_polls`` polls). The cut is the only step that lowers the
   budget below the bound: a stated capacity says how much fits, a preemption that the
   estimates behind the charges are short.
4. budget above the bound (``L``, or ``high``) -> ``capacity``: down to it.
5. **near full** -- the fleet holds ``near_full`` (0.8) of the budget or more -- and not
   exhausted: below the bound -> ``grow``: ``min(2 x budget, bound)`` (above the cache itself,
   only for a bound ``deadband`` (2 %) or more away: the use ratio's noise moves nothing); at
   a learnt bound with no stated capacity, a ``probe`` of +5 % after ``probe_polls`` clean
   near-full polls (a capacity that grew without a signal is found); else ``hold_capacity``.
6. otherwise -> ``hold_idle``.

The budget is always within [``low``, ``high``] (``low`` 1 by default). It never lowers the
token ceiling (the configuration's: a call it admits is not refused because the budget was
tuned down); a call heavier than the tuned budget waits until the budget has room for it. A
gate whose budget starts below its largest calls needs a ``token_ceiling`` that admits them,
else they are refused before the first tuned budget is published.
"""

from __future__ import annotations

import enum
import math

import msgspec

from fleetgate.errors import ConfigError

__all__ = [
    "TokenDecision",
    "TokenParams",
    "TokenReason",
    "TokenState",
    "TokenView",
    "dump_token_state",
    "load_token_state",
    "token_step",
]

_EPS = 1e-9


class TokenReason(str, enum.Enum):
    """Why a step chose its token budget (the ``reason`` label of the token metrics)."""

    GROW = "grow"
    CAPACITY = "capacity"
    EXHAUSTED = "exhausted"
    PROBE = "probe"
    HOLD_IDLE = "hold_idle"
    HOLD_CAPACITY = "hold_capacity"
    HOLD_COOLDOWN = "hold_cooldown"
    HOLD_UNKNOWN = "hold_unknown"
    RESET = "reset"

    def __str__(self) -> str:
        return self.value


class TokenParams(msgspec.Struct, frozen=True):
    """Bounds and constants of one gate's token budget. Defaults are the documented rule."""

    #: the configured ``token_limit``: where tuning starts and what the budget lapses to
    configured: int
    #: the budget never goes below this ...
    low: int = 1
    #: ... nor above this (the token ceiling; None: ``configured``)
    high: int | None = None
    poll_interval: float = 2.0
    unknown_reset_polls: int = 3
    #: an exhaustion cuts to this fraction of the smaller of the budget and the fleet's tokens
    decrease: float = 0.8
    #: near full when the fleet holds at least this fraction of the budget
    near_full: float = 0.8
    #: KV usage (a fraction) at which a server with requests waiting is exhausted
    kv_full: float = 0.98
    #: the budget may reach this multiple of the stated capacity (1: what the cache holds)
    overcommit: float = 1.0
    #: with the fleet's tokens unknown, a cut is repeated no sooner than this many polls
    drain_polls: float = 3.0
    #: clean near-full polls at a learnt bound (no stated capacity) before a probe above it
    probe_polls: int = 10
    #: a probe's step, as a fraction of the budget
    probe: float = 0.05
    #: settled calls a poll's window needs before its used / charged ratio counts
    min_reports: int = 10
    #: the cache's share the budget aims to fill when the charges exceed the use
    kv_target: float = 0.98
    #: the most charged tokens counted per token of cache
    max_stretch: float = 4.0
    #: a bound that moved less than this fraction from the budget leaves it alone (the use
    #: ratio's noise would otherwise move the budget by a percent every poll)
    deadband: float = 0.02

    def __post_init__(self) -> None:
        if not (
            self.configured >= 1
            and 1 <= self.low
            and (self.high is None or self.high >= self.low)
            and self.poll_interval > 0
            and self.unknown_reset_polls >= 1
            and 0 < self.decrease < 1
            and 0 < self.near_full <= 1
            and 0 < self.kv_full <= 1
            and self.overcommit > 0
            and self.drain_polls >= 0
            and self.probe_polls >= 1
            and 0 < self.probe <= 1
            and self.min_reports >= 1
            and 0 < self.kv_target <= 1
            and self.max_stretch >= 1
            and 0 <= self.deadband < 1
        ):
            raise ConfigError(f"token budget constants out of range: {self!r}")

    @property
    def bound(self) -> int:
        """The highest budget: ``high``, else the configured one (never below ``low``)."""
        return max(self.low, self.high if self.high is not None else self.configured)

    def clamp(self, value: float) -> int:
        """``value`` (rounded down) within [``low``, :attr:`bound`]."""
        return max(self.low, min(self.bound, math.floor(value + _EPS)))


class TokenState(msgspec.Struct, frozen=True):
    """What the token controller remembers between polls (stored for warm failover). Every field
    but ``budget`` has a default, so an older or newer state still loads."""

    budget: int
    #: the budget chosen at the last exhaustion (``L``), None before the first
    learnt: float | None = None
    #: the stated capacity when ``L`` was learnt (to scale it when the capacity moves)
    learnt_stated: float | None = None
    #: ``now`` of the last cut (shared clock), None before the first
    last_cut: float | None = None
    near_full_streak: int = 0
    unknown_streak: int = 0
    #: tokens used per token charged, a running mean of the settled windows (None: unknown)
    use_ratio: float | None = None

    @classmethod
    def initial(cls, params: TokenParams) -> TokenState:
        """A fresh controller: at the configured budget."""
        return cls(budget=params.clamp(params.configured))


class TokenView(msgspec.Struct, frozen=True):
    """One poll's view of a gate's KV cache: the server's signals and the fleet's tokens.
    ``None`` = unknown, never 0."""

    #: the KV cache in tokens, as the server states it
    stated: float | None = None
    #: KV usage, a fraction (1 = full)
    kv_usage: float | None = None
    #: requests preempted, retracted, paused or refused since the last poll
    preempted: float | None = None
    #: requests waiting for capacity
    waiting: float | None = None
    #: tokens the fleet's leases hold
    held: int | None = None
    #: the scrape was usable
    ok: bool = True
    #: the calls settled since the last poll (``report(tokens=)``), the tokens they were
    #: charged and the tokens they used
    reports: int = 0
    charged: int = 0
    used: int = 0


class TokenDecision(msgspec.Struct, frozen=True):
    """One step's outcome: publish ``budget`` as the token target when ``publish``."""

    state: TokenState
    budget: int
    reason: TokenReason
    publish: bool


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) and value >= 0 else None


def _use_ratio(state: TokenState, view: TokenView, p: TokenParams) -> float | None:
    """Tokens used per token charged: this poll's settlements averaged into the last mean,
    when they are ``min_reports`` calls or more."""
    if view.reports < p.min_reports or view.charged <= 0 or view.used <= 0:
        return state.use_ratio
    ratio = view.used / view.charged
    return ratio if state.use_ratio is None else (state.use_ratio + ratio) / 2


def _stated(view: TokenView, p: TokenParams, ratio: float | None) -> float | None:
    """The stated cache in charged tokens (module docstring), None when unstated."""
    stated = _finite(view.stated)
    if stated is None or stated < 1:
        return None
    stretch = 1.0 if ratio is None else min(p.max_stretch, max(1.0, p.kv_target / ratio))
    return stated * p.overcommit * stretch


def _learnt(state: TokenState, stated: float | None) -> float | None:
    """``L``, scaled by how the stated capacity moved since it was learnt."""
    if state.learnt is None:
        return None
    if stated is not None and state.learnt_stated:
        return state.learnt * stated / state.learnt_stated
    return state.learnt


def _exhausted(view: TokenView, p: TokenParams) -> bool:
    preempted, usage, waiting = _finite(view.preempted), _finite(view.kv_usage), view.waiting
    if preempted is not None and preempted > 0:
        return True
    return usage is not None and usage >= p.kv_full and waiting is not None and waiting > 0


def _may_cut(state: TokenState, view: TokenView, p: TokenParams, now: float) -> bool:
    """Cut only when the fleet holds no more than the budget: while it holds more (the excess of
    before a cut, whose leases end only as their calls do) a preemption is that excess, and a
    lower budget relieves nothing until it has drained. With the fleet's tokens unknown, one
    cut per ``drain_polls`` polls."""
    if view.held is not None:
        return view.held <= state.budget
    if state.last_cut is None or now < state.last_cut:
        return True
    return now - state.last_cut >= p.drain_polls * p.poll_interval


def token_step(
    state: TokenState, view: TokenView | None, p: TokenParams, now: float
) -> TokenDecision:
    """Advance one gate's token budget by one poll (module docstring). Pure."""
    budget = p.clamp(state.budget)
    state = msgspec.structs.replace(state, budget=budget)
    if view is None or not view.ok:
        return _unknown(state, p)
    ratio = _use_ratio(state, view, p)
    state = msgspec.structs.replace(state, unknown_streak=0, use_ratio=ratio)
    stated = _stated(view, p, ratio)
    if stated is not None and budget > p.clamp(stated * (1 + p.deadband)):
        # Above what the cache holds: straight down to it, whatever else this poll saw. A
        # preemption now is the budget's excess, not a short estimate: nothing is learnt, and
        # the drain period starts (the excess leaves only as its calls end).
        new = msgspec.structs.replace(
            state, budget=p.clamp(stated), last_cut=now, near_full_streak=0
        )
        return TokenDecision(new, new.budget, TokenReason.CAPACITY, True)
    if _exhausted(view, p):
        if not _may_cut(state, view, p, now):
            new = msgspec.structs.replace(state, near_full_streak=0)
            return TokenDecision(new, budget, TokenReason.HOLD_COOLDOWN, True)
        base = min(budget, view.held) if view.held is not None and view.held > 0 else budget
        cut = p.clamp(min(base * p.decrease, budget - 1))
        new = msgspec.structs.replace(
            state,
            budget=cut,
            learnt=float(cut),
            learnt_stated=stated,
            last_cut=now,
            near_full_streak=0,
        )
        return TokenDecision(new, cut, TokenReason.EXHAUSTED, True)
    known = [b for b in (stated, _learnt(state, stated)) if b is not None]
    bound = p.clamp(min(known)) if known else p.bound
    if budget > bound and (stated is None or bound < p.clamp(stated)):
        new = msgspec.structs.replace(state, budget=bound, last_cut=now, near_full_streak=0)
        return TokenDecision(new, bound, TokenReason.CAPACITY, True)
    held = view.held
    if held is None or held < p.near_full * budget:
        new = msgspec.structs.replace(state, near_full_streak=0)
        return TokenDecision(new, budget, TokenReason.HOLD_IDLE, True)
    streak = state.near_full_streak + 1
    cache = _stated(view, p, None) or 0.0  # the cache itself: the ramp to it is always whole
    if budget < bound and (budget < p.clamp(cache) or bound - budget > p.deadband * bound):
        grown = p.clamp(min(2 * budget, bound))
        new = msgspec.structs.replace(state, budget=grown, near_full_streak=streak)
        return TokenDecision(new, grown, TokenReason.GROW, True)
    if stated is None and state.learnt is not None and streak >= p.probe_polls:
        probed = p.clamp(budget + max(1.0, budget * p.probe))
        if probed > budget:
            # the probe raises the learnt bound with it: a clean probe is proof of room
            new = msgspec.structs.replace(
                state, budget=probed, learnt=float(probed), near_full_streak=0
            )
            return TokenDecision(new, probed, TokenReason.PROBE, True)
    new = msgspec.structs.replace(state, near_full_streak=streak)
    return TokenDecision(new, budget, TokenReason.HOLD_CAPACITY, True)


def _unknown(state: TokenState, p: TokenParams) -> TokenDecision:
    """No usable view: hold unpublished (the published budget lapses); after
    ``unknown_reset_polls`` such polls, back to the configured budget, published once."""
    streak = state.unknown_streak + 1
    if streak >= p.unknown_reset_polls:
        configured = p.clamp(p.configured)
        first = streak == p.unknown_reset_polls
        new = TokenState(
            budget=configured,
            learnt=state.learnt,
            learnt_stated=state.learnt_stated,
            unknown_streak=streak,
            use_ratio=state.use_ratio,
        )
        reason = TokenReason.RESET if first else TokenReason.HOLD_UNKNOWN
        return TokenDecision(new, configured, reason, first and state.budget != configured)
    new = msgspec.structs.replace(state, unknown_streak=streak, near_full_streak=0)
    return TokenDecision(new, state.budget, TokenReason.HOLD_UNKNOWN, False)


_DECODER = msgspec.json.Decoder(TokenState)


def dump_token_state(state: TokenState) -> str:
    """``state`` as JSON text, for the util snapshot's ``token_state``."""
    return msgspec.json.encode(state).decode()


def load_token_state(
    data: bytes | str | None, params: TokenParams, *, lapsed: bool = False
) -> TokenState:
    """The stored state, clamped to ``params``; a fresh one if absent or unreadable. ``lapsed``:
    the last published target ran out (no leader for longer than its lifetime): the budget in
    force is the configured one again, so the state continues from there, its learning kept."""
    if not data:
        return TokenState.initial(params)
    try:
        state = _DECODER.decode(data)
    except msgspec.DecodeError:
        return TokenState.initial(params)
    if lapsed:
        return TokenState(
            budget=params.clamp(params.configured),
            learnt=state.learnt,
            learnt_stated=state.learnt_stated,
            use_ratio=state.use_ratio,
        )
    return msgspec.structs.replace(state, budget=params.clamp(state.budget))
