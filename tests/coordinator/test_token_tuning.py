"""The token budget's rule (coordinator/token_tuning.py), pure: state and view in, budget out."""

from __future__ import annotations

import msgspec
import pytest

from fleetgate.coordinator.token_tuning import (
    TokenParams,
    TokenReason,
    TokenState,
    TokenView,
    dump_token_state,
    load_token_state,
    token_step,
)
from fleetgate.errors import ConfigError

CAPACITY = 16_384


def run(
    p: TokenParams, state: TokenState, polls: int, view_of: object, start: float = 0.0
) -> list[int]:
    """The budgets of ``polls`` polls; ``view_of(budget)`` is what each poll sees."""
    budgets = []
    for i in range(polls):
        view = view_of(state.budget)  # type: ignore[operator]
        d = token_step(state, view, p, start + i * p.poll_interval)
        state = d.state
        budgets.append(d.budget)
    return budgets


def busy(budget: int) -> TokenView:
    """A fleet that fills its budget; the server states its cache and preempts nothing."""
    return TokenView(stated=CAPACITY, kv_usage=0.5, preempted=0, waiting=0, held=budget)


@pytest.mark.parametrize("start", [CAPACITY // 4, 4 * CAPACITY])
def test_the_budget_reaches_the_stated_capacity_from_either_side(start: int) -> None:
    p = TokenParams(configured=start, high=4 * CAPACITY)  # a token ceiling of 4x the cache
    budgets = run(p, TokenState.initial(p), 8, busy)
    first = next(i for i, b in enumerate(budgets) if abs(b - CAPACITY) <= 0.1 * CAPACITY)
    assert first <= 2 and budgets[-1] == CAPACITY
    assert all(b <= max(start, CAPACITY) for b in budgets)


def test_a_too_large_budget_is_cut_to_the_capacity_even_when_idle() -> None:
    p = TokenParams(configured=4 * CAPACITY)
    d = token_step(TokenState.initial(p), TokenView(stated=CAPACITY, held=0), p, 0.0)
    assert d.budget == CAPACITY
    assert (d.budget, d.reason, d.publish) == (CAPACITY, TokenReason.CAPACITY, True)


def test_an_idle_budget_holds_and_is_renewed() -> None:
    p = TokenParams(configured=CAPACITY // 4)
    d = token_step(TokenState.initial(p), TokenView(stated=CAPACITY, held=100), p, 0.0)
    assert (d.budget, d.reason, d.publish) == (CAPACITY // 4, TokenReason.HOLD_IDLE, True)


def test_a_preemption_cuts_below_what_the_fleet_holds_and_is_remembered() -> None:
    p = TokenParams(configured=CAPACITY, high=4 * CAPACITY)
    s = TokenState.initial(p)
    d = token_step(s, TokenView(stated=CAPACITY, preempted=3, held=15_000), p, 0.0)
    assert d.reason is TokenReason.EXHAUSTED and d.budget == int(15_000 * 0.8)
    # growth stops at the learnt level although the server states more
    budgets = run(p, d.state, 5, busy, start=10.0)
    assert budgets == [d.budget] * 5
    # ... until the stated capacity moves: the learnt level scales with it
    grown = lambda b: msgspec.structs.replace(busy(b), stated=2 * CAPACITY)  # noqa: E731
    doubled = run(p, d.state, 2, grown, start=10.0)
    assert doubled[-1] == 2 * d.budget


def test_kv_exhaustion_with_requests_waiting_cuts_too() -> None:
    p = TokenParams(configured=CAPACITY)
    full = TokenView(stated=CAPACITY, kv_usage=0.99, waiting=2, held=CAPACITY)
    assert token_step(TokenState.initial(p), full, p, 0.0).reason is TokenReason.EXHAUSTED
    full_no_queue = TokenView(stated=CAPACITY, kv_usage=0.99, waiting=0, held=CAPACITY)
    d = token_step(TokenState.initial(p), full_no_queue, p, 0.0)
    assert d.reason is not TokenReason.EXHAUSTED


def test_no_cut_while_the_fleet_holds_more_than_the_budget() -> None:
    """The excess of before a cut is still held: a preemption then is that excess draining."""
    p = TokenParams(configured=CAPACITY, poll_interval=1.0)
    view = TokenView(stated=CAPACITY, preempted=1, held=CAPACITY)
    first = token_step(TokenState.initial(p), view, p, 0.0)
    for t in (1.0, 5.0):
        later = token_step(first.state, view, p, t)  # the excess is still held
        assert later.reason is TokenReason.HOLD_COOLDOWN and later.budget == first.budget
    drained = TokenView(stated=CAPACITY, preempted=1, held=first.budget - 1)
    assert token_step(first.state, drained, p, 1.0).reason is TokenReason.EXHAUSTED
    # the fleet's tokens unknown: one cut per drain_polls polls
    blind = TokenView(stated=CAPACITY, preempted=1)
    assert token_step(first.state, blind, p, 1.0).reason is TokenReason.HOLD_COOLDOWN
    assert token_step(first.state, blind, p, 3.0).reason is TokenReason.EXHAUSTED


def test_a_budget_above_the_stated_capacity_goes_to_it_and_learns_nothing() -> None:
    """Preemptions while the budget is above what the cache holds are the budget's excess: the
    step to the capacity is not a learnt cut, and growth back to the capacity stays open."""
    p = TokenParams(configured=4 * CAPACITY)
    view = TokenView(stated=CAPACITY, preempted=12, held=3 * CAPACITY)
    d = token_step(TokenState.initial(p), view, p, 0.0)
    assert (d.budget, d.reason, d.state.learnt) == (CAPACITY, TokenReason.CAPACITY, None)
    # the excess drains: still preempting while held above the budget, no cut
    assert token_step(d.state, view, p, 1.0).reason is TokenReason.HOLD_COOLDOWN


def test_without_a_stated_capacity_it_grows_to_the_ceiling_and_probes_after_a_cut() -> None:
    p = TokenParams(configured=1000, high=3000, probe_polls=3)
    no_stated = lambda b: TokenView(kv_usage=0.5, preempted=0, waiting=0, held=b)  # noqa: E731
    assert run(p, TokenState.initial(p), 3, no_stated) == [2000, 3000, 3000]
    cut = token_step(TokenState(budget=3000), TokenView(preempted=1, held=3000), p, 0.0)
    budgets = run(p, cut.state, 4, no_stated, start=10.0)
    assert budgets[:2] == [2400, 2400] and budgets[2] == 2520  # +5 % after 3 clean polls


def test_bounds_hold() -> None:
    p = TokenParams(configured=1000, low=800, high=1200)
    d = token_step(TokenState.initial(p), TokenView(preempted=5, held=500), p, 0.0)
    assert d.budget == 800
    assert run(p, TokenState.initial(p), 3, lambda b: TokenView(held=b)) == [1200] * 3


def test_without_a_token_ceiling_the_budget_is_only_ever_cut() -> None:
    """The configured budget is the bound (high None), as a gate's ceiling bounds its target:
    the server's larger cache does not raise it; its smaller cache and preemptions lower it."""
    p = TokenParams(configured=CAPACITY // 2)
    assert run(p, TokenState.initial(p), 3, busy) == [CAPACITY // 2] * 3
    p = TokenParams(configured=2 * CAPACITY)
    assert run(p, TokenState.initial(p), 2, busy) == [CAPACITY] * 2


def test_unknown_polls_hold_unpublished_then_reset_to_the_configured_budget_once() -> None:
    p = TokenParams(configured=1000, high=8000, unknown_reset_polls=3)
    s = TokenState(budget=4000, learnt=4000.0)
    out = []
    for i in range(4):
        d = token_step(s, TokenView(ok=False), p, float(i))
        s = d.state
        out.append((d.budget, d.reason, d.publish))
    assert out == [
        (4000, TokenReason.HOLD_UNKNOWN, False),
        (4000, TokenReason.HOLD_UNKNOWN, False),
        (1000, TokenReason.RESET, True),
        (1000, TokenReason.HOLD_UNKNOWN, False),
    ]
    assert s.learnt == 4000.0  # what was learnt is kept


def test_stored_state_round_trips_and_garbage_starts_fresh() -> None:
    p = TokenParams(configured=1000, high=8000)
    s = TokenState(budget=3000, learnt=2500.0, learnt_stated=16384.0, last_cut=12.5)
    assert load_token_state(dump_token_state(s), p) == s
    assert load_token_state("{not json", p) == TokenState.initial(p)
    assert load_token_state(None, p) == TokenState.initial(p)
    lapsed = load_token_state(dump_token_state(s), p, lapsed=True)
    assert (lapsed.budget, lapsed.learnt) == (1000, 2500.0)


def test_constants_out_of_range_are_a_config_error() -> None:
    with pytest.raises(ConfigError, match="token budget constants"):
        TokenParams(configured=1000, low=2000, high=1500)


def settled(budget: int, ratio: float, reports: int = 50) -> TokenView:
    """A busy poll whose window settled ``reports`` calls using ``ratio`` of their charges."""
    charged = 10_000
    return msgspec.structs.replace(
        busy(budget), reports=reports, charged=charged, used=round(charged * ratio)
    )


def test_charges_above_the_use_stretch_the_cache_to_kv_target() -> None:
    """Calls that use 77 % of what they are charged: the cache holds 0.98 / 0.77 of itself in
    charges, and the budget goes there (the tokens actually held: 98 % of the cache)."""
    p = TokenParams(configured=CAPACITY, high=4 * CAPACITY)
    budgets = run(p, TokenState.initial(p), 4, lambda b: settled(b, 0.77))
    stretched = int(CAPACITY * 0.98 / 0.77)
    assert budgets[-1] == stretched and budgets[0] == stretched
    assert abs(budgets[-1] * 0.77 - 0.98 * CAPACITY) <= 2


def test_exact_or_short_charges_stretch_nothing_and_few_reports_count_not() -> None:
    p = TokenParams(configured=CAPACITY, high=4 * CAPACITY)
    for ratio in (1.0, 1.3):  # exact, or calls that use more than they are charged
        assert run(p, TokenState.initial(p), 3, lambda b, r=ratio: settled(b, r)) == [CAPACITY] * 3
    few = run(p, TokenState.initial(p), 3, lambda b: settled(b, 0.5, reports=3))
    assert few == [CAPACITY] * 3
    # at most max_stretch charged tokens per token of cache
    wild = run(p, TokenState.initial(p), 4, lambda b: settled(b, 0.01))
    assert wild[-1] == 4 * CAPACITY


def test_the_use_ratio_is_a_running_mean_kept_across_polls_without_reports() -> None:
    p = TokenParams(configured=CAPACITY, high=4 * CAPACITY)
    d = token_step(TokenState.initial(p), settled(CAPACITY, 0.5), p, 0.0)
    d = token_step(d.state, settled(d.budget, 0.7), p, 1.0)
    assert d.state.use_ratio == pytest.approx(0.6)
    quiet = token_step(d.state, busy(d.budget), p, 2.0)  # no calls settled this poll
    assert quiet.state.use_ratio == pytest.approx(0.6) and quiet.budget == d.budget


def test_the_use_ratios_noise_moves_no_budget() -> None:
    """Above the cache, a bound within 2 % of the budget leaves it alone, up or down."""
    p = TokenParams(configured=CAPACITY, high=4 * CAPACITY)
    d = token_step(TokenState.initial(p), settled(CAPACITY, 0.77), p, 0.0)
    first = d.budget
    for i, ratio in enumerate((0.78, 0.765, 0.775, 0.77)):
        d = token_step(d.state, settled(d.budget, ratio), p, 1.0 + i)
        assert d.budget == first and d.reason is TokenReason.HOLD_CAPACITY, (ratio, d)
