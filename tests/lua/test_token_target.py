"""The coordinator's tuned token budget, through the scripts on a real redis-server: a second
target beside the limit's (``publish.lua``'s pair ``token_target``), fenced by the same epoch,
living as long as the target does, then lapsing to the configured ``token_limit``. While it
lives every script grants by it; it never lowers the token ceiling (a call the configuration
admits waits for room instead of being refused); a raised one hands the room to the waiters in
the publish itself.
"""

from __future__ import annotations

import json
import time

import pytest
import redis

from fleetgate.settings import GateSettings

from .test_token_budget import GRANTED, LONG_MS, PARKED, TokenGate

# the scripts against each server of the matrix (tests/_servers.py)
pytestmark = pytest.mark.servers

CONFIGURED = 1000


def publish(g: TokenGate, epoch: int, ttl_ms: int, token_target: int | str | None) -> int:
    """The coordinator's publish of the gate's settings (as the TokenGate's defaults) with a
    token target (None: none sent; '': withdrawn); returns accepted."""
    cfg: dict[str, object] = dict(
        GateSettings(
            floor=4, ceiling=64, lease_ms=LONG_MS, waiter_ms=LONG_MS, token_limit=CONFIGURED
        ).as_cfg()
    )
    if token_target is not None:
        cfg["token_target"] = token_target
    flat = [x for kv in cfg.items() for x in kv]
    return int(g.call("publish", epoch, ttl_ms, "", len(cfg), *flat)[0])


def budget(g: TokenGate) -> tuple[int, bool]:
    """(the token budget in force, whether it is the tuned one), as inspect reports them."""
    snap = json.loads(g.call("inspect", 0))
    return int(snap["token_limit"]), bool(snap["token_tuned"])


def test_a_tuned_budget_replaces_the_configured_one_while_it_lives(r: redis.Redis) -> None:
    g = TokenGate(r, floor=4, token_limit=CONFIGURED)
    assert publish(g, 1, LONG_MS, 400) == 1
    assert budget(g) == (400, True)
    assert g.acquire(("p:1", 300)) == [GRANTED]
    # 300 + 200 fits the configured 1000, not the tuned 400: it parks
    assert g.acquire(("p:2", 200)) == [PARKED]
    # the heartbeat, the release and the resize answer by the same budget
    assert g.heartbeat("p", [("p:1t300", 1)]).token_limit == 400
    assert g.resize(g.held()[0].pop(), 350)[0] == 0  # 350 + nothing else, but p:2 waits
    assert g.held()[2] == 300


def test_a_raised_budget_grants_the_waiters_in_the_publish(r: redis.Redis) -> None:
    g = TokenGate(r, floor=4, token_limit=CONFIGURED)
    assert publish(g, 1, LONG_MS, 400) == 1
    assert g.acquire(("p:1", 300), ("p:2", 300)) == [GRANTED, PARKED]
    assert publish(g, 1, LONG_MS, 800) == 1
    ids, _, tokens = g.held()
    assert tokens == 600 and len(ids) == 2 and g.waiting() == []


def test_a_call_heavier_than_the_tuned_budget_waits_instead_of_being_refused(
    r: redis.Redis,
) -> None:
    """The ceiling stays the configuration's: 700 tokens fit the configured 1000, so with a
    tuned 400 the call waits (in big) and is granted once the budget is raised again."""
    g = TokenGate(r, floor=4, token_limit=CONFIGURED)
    assert publish(g, 1, LONG_MS, 400) == 1
    assert g.acquire(("p:1", 700)) == [PARKED]
    snap = json.loads(g.call("inspect", 0))
    assert snap["token_ceiling"] == CONFIGURED
    assert publish(g, 1, LONG_MS, CONFIGURED) == 1
    assert g.held()[2] == 700


def test_the_tuned_budget_lapses_to_the_configured_one(r: redis.Redis) -> None:
    g = TokenGate(r, floor=4, token_limit=CONFIGURED)
    assert publish(g, 1, 300, 400) == 1
    assert budget(g) == (400, True)
    assert g.acquire(("p:1", 300), ("p:2", 300)) == [GRANTED, PARKED]
    time.sleep(0.4)
    assert budget(g) == (CONFIGURED, False)
    # the next heartbeat hands the room of the configured budget to the waiter
    reply = g.heartbeat("p", [("p:1t300", 1)])
    assert reply.token_limit == CONFIGURED
    assert g.held()[2] == 600


def test_a_stale_epoch_writes_no_token_target_and_an_empty_one_withdraws(
    r: redis.Redis,
) -> None:
    g = TokenGate(r, floor=4, token_limit=CONFIGURED)
    assert publish(g, 5, LONG_MS, 400) == 1
    assert publish(g, 4, LONG_MS, 900) == 0  # a deposed leader
    assert budget(g) == (400, True)
    assert publish(g, 5, LONG_MS, None) == 1  # a poll that leaves the token target alone
    assert budget(g) == (400, True)
    assert publish(g, 5, LONG_MS, "") == 1
    assert budget(g) == (CONFIGURED, False)
    assert r.hget(g.keys.cfg, "token_target") is None


def test_a_gate_without_a_token_budget_ignores_a_token_target(r: redis.Redis) -> None:
    """A tuned budget replaces a configured one; it never creates one (tokens asked by callers
    of a gate without a budget are counted, never limited)."""
    g = TokenGate(r, floor=4, token_limit=CONFIGURED)
    cfg = dict(GateSettings(floor=4, lease_ms=LONG_MS, waiter_ms=LONG_MS).as_cfg())
    cfg["token_limit"] = ""  # the configuration withdraws the budget
    cfg["token_target"] = 10
    flat = [x for kv in cfg.items() for x in kv]
    assert int(g.call("publish", 1, LONG_MS, "", len(cfg), *flat)[0]) == 1
    snap = json.loads(g.call("inspect", 0))
    assert snap.get("token_limit") is None and snap["token_tuned"] is False
    assert g.acquire(("p:1", 500), ("p:2", 500)) == [GRANTED, GRANTED]


def test_a_tuned_budget_stops_at_the_token_ceiling(r: redis.Redis) -> None:
    """As the limit's target stops at the ceiling: a budget published above the token ceiling
    (by an older coordinator, or by hand) is the ceiling."""
    g = TokenGate(r, floor=4, token_limit=CONFIGURED)
    assert publish(g, 1, LONG_MS, 5000) == 1
    assert budget(g) == (CONFIGURED, True)  # the ceiling defaults to the configured budget
    cfg = dict(
        GateSettings(
            floor=4, lease_ms=LONG_MS, waiter_ms=LONG_MS, token_limit=CONFIGURED, token_ceiling=3000
        ).as_cfg()
    )
    cfg["token_target"] = 5000
    flat = [x for kv in cfg.items() for x in kv]
    assert int(g.call("publish", 1, LONG_MS, "", len(cfg), *flat)[0]) == 1
    assert budget(g) == (3000, True)
