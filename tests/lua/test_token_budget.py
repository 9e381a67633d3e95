"""A gate with two budgets, through the scripts on a real redis-server: units (requests x
weight) and tokens held at once. A permit is granted only when both fit; a head that does not
fit the tokens waits and reserves as one that does not fit the units does (no passing); a
resize shrinks at once (the freed tokens go to the waiters in the same call) and grows only into
tokens nobody waits for; releases, reaps, adoption and the heartbeat count tokens as they count
units; and a token ceiling refuses what could never be granted, at once or once lowered.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import redis

from fleetgate.admission import lane_class, weighted_id
from fleetgate.keys import GateKeys
from fleetgate.scripts import SCRIPT_NAMES, HeartbeatReply, script_source

# the scripts against each server of the matrix (tests/_servers.py)
pytestmark = pytest.mark.servers

LONG_MS = 600_000
GRANTED, PARKED, TOO_MANY_TOKENS = 1, 2, 6


class TokenGate:
    """One gate: ``floor`` units, ``token_limit`` tokens (ceiling ``token_ceiling``)."""

    def __init__(
        self, r: redis.Redis, floor: int, token_limit: int, token_ceiling: int | None = None
    ) -> None:
        self.r = r
        self.keys = GateKeys.of(f"t{uuid.uuid4().hex[:8]}", "tokens")
        self.scripts = {n: r.register_script(script_source(n)) for n in SCRIPT_NAMES}
        tc = "" if token_ceiling is None else token_ceiling
        self.defaults = [floor, 64, 100, LONG_MS, LONG_MS, 100, 0, token_limit, tc, 0, "", "", ""]

    def call(self, name: str, *args: object) -> Any:
        return self.scripts[name](keys=self.keys.script_keys(), args=list(args))

    def acquire(self, *reqs: tuple[str, int], releases: tuple[str, ...] = ()) -> list[int]:
        """reqs: (lease id, tokens) of weight 1, priority 0; returns the statuses."""
        triples = []
        for base, tokens in reqs:
            triples += [weighted_id(base, 1, tokens), LONG_MS, lane_class(0, None)]
        reply = self.call("acquire", *self.defaults, 0, len(releases), *releases, 0, *triples)
        return [int(x) for x in reply[5::5]]

    def release(self, *ids: str) -> int:
        return int(self.call("release", 0, *ids))

    def resize(self, lease_id: str, tokens: int) -> tuple[int, str, int]:
        status, new_id, held = self.call("resize", lease_id, tokens)
        return int(status), new_id, int(held)

    def held(self) -> tuple[set[str], int, int]:
        """(lease ids, units held, tokens held), as the scripts count them."""
        ids = set(self.r.zrange(self.keys.holders, 0, -1))
        tok = int(self.r.hget(self.keys.adm, "tok") or 0)
        extra = int(self.r.hget(self.keys.adm, "extra") or 0)
        return ids, len(ids) + extra, tok

    def waiting(self) -> list[str]:
        return [m.rsplit("}", 1)[1] for m in self.r.zrange(self.keys.lanes, 0, -1)]

    def heartbeat(self, pod: str, leases: list[tuple[str, int]]) -> HeartbeatReply:
        args: list[object] = [pod, 10_000, len(leases)]
        for lease_id, known in leases:
            args += [lease_id, known]
        args += [0, 0, 0, *self.defaults]
        return HeartbeatReply.decode(self.call("heartbeat", *args))


def test_a_permit_needs_both_budgets_and_a_head_short_of_tokens_is_not_passed(
    r: redis.Redis,
) -> None:
    g = TokenGate(r, floor=4, token_limit=1000)
    assert g.acquire(("p:1", 600), ("p:2", 300)) == [GRANTED, GRANTED]
    # units are free (2 of 4) but 500 tokens are not (100 left): it parks ...
    assert g.acquire(("p:3", 500)) == [PARKED]
    # ... and a small one that would fit does not pass it (FIFO, the head reserves)
    assert g.acquire(("p:4", 50)) == [PARKED]
    assert g.held()[1:] == (2, 900)
    # releasing 600 tokens hands them to the head, then the next one, in the same call
    assert g.release("p:1t600") == 1
    ids, units, tokens = g.held()
    assert ids == {"p:2t300", "p:3t500", "p:4t50"} and (units, tokens) == (3, 850)
    assert g.waiting() == []


def test_tokens_are_freed_by_release_reap_and_the_counter_never_outlives_the_leases(
    r: redis.Redis,
) -> None:
    g = TokenGate(r, floor=8, token_limit=100)
    assert g.acquire(("p:1", 40), ("p:2", 60), ("p:3", 0)) == [GRANTED] * 3
    assert g.held()[2] == 100
    # a lease that expires is reaped with its tokens when an arrival does not fit
    r.zadd(g.keys.holders, {"p:2t60": 1})
    assert g.acquire(("p:4", 50)) == [GRANTED]
    assert g.held()[2] == 90
    assert g.release("p:1t40", "p:4t50", "p:3") == 3
    assert g.r.hexists(g.keys.adm, "tok") is False  # gone with the last tokened lease


def test_more_tokens_than_the_token_ceiling_are_refused_at_once(r: redis.Redis) -> None:
    g = TokenGate(r, floor=4, token_limit=100, token_ceiling=150)
    reply = g.call("acquire", *g.defaults, 0, 0, 0, weighted_id("p:1", 1, 151), LONG_MS, "")
    assert (int(reply[5]), int(reply[7])) == (TOO_MANY_TOKENS, 150)
    assert g.held()[0] == set() and g.waiting() == []


def test_a_lowered_token_ceiling_refuses_the_parked_head_and_its_lane_moves_on(
    r: redis.Redis,
) -> None:
    g = TokenGate(r, floor=4, token_limit=100)
    assert g.acquire(("p:1", 100)) == [GRANTED]
    assert g.acquire(("p:2", 80), ("p:3", 10)) == [PARKED, PARKED]
    # the coordinator's config lowers the budget and its ceiling to 50: 80 can never fit
    cfg = {"token_limit": 50, "token_ceiling": 50}
    flat = [x for kv in cfg.items() for x in kv]
    assert g.call("publish", 1, LONG_MS, "", len(cfg), *flat)[0] == 1
    assert g.waiting() == ["p:3t10"]
    assert g.r.zscore(g.keys.evicted, "p:2t80=c") is not None
    assert "p:2t80=k50" in g.r.lrange(g.keys.wake("p"), 0, -1)
    assert g.release("p:1t100") == 1
    assert "p:3t10" in g.held()[0]


def test_shrinking_frees_tokens_to_the_head_in_the_same_call(r: redis.Redis) -> None:
    g = TokenGate(r, floor=4, token_limit=100)
    assert g.acquire(("p:1", 90)) == [GRANTED]
    assert g.acquire(("p:2", 40)) == [PARKED]
    assert g.resize("p:1t90", 60) == (1, "p:1t60", 60)
    ids, _, tokens = g.held()
    assert ids == {"p:1t60", "p:2t40"} and tokens == 100
    # the old id is gone for good: a heartbeat that still carries it neither renews nor
    # counts it again, however fresh the pod believed it
    reply = g.heartbeat("p", [("p:1t90", 10**15)])
    assert reply.lost_leases == ["p:1t90"] and reply.adopted == []
    assert g.held()[2] == 100 and reply.tokens == 100 and reply.token_limit == 100


def test_growth_takes_only_free_tokens_nobody_waits_for_and_is_all_or_nothing(
    r: redis.Redis,
) -> None:
    g = TokenGate(r, floor=4, token_limit=100)
    assert g.acquire(("p:1", 30), ("p:2", 30)) == [GRANTED, GRANTED]
    assert g.resize("p:1t30", 60) == (1, "p:1t60", 60)  # 90 of 100
    assert g.resize("p:1t60", 80) == (0, "p:1t60", 60)  # 110 would not fit: unchanged
    assert g.held()[2] == 90
    # with a caller parked, the free tokens are owed to it: no growth, even into them
    assert g.acquire(("p:3", 20)) == [PARKED]
    assert g.resize("p:2t30", 35) == (0, "p:2t30", 30)
    assert g.release("p:2t30") == 1  # the head is granted: 60 + 20
    assert g.held()[2] == 80 and g.waiting() == []
    assert g.resize("p:1t60", 80) == (1, "p:1t80", 80)  # nobody waits now: 100 of 100
    assert g.resize("nobody:1t5", 1) == (-1, "nobody:1t5", 0)


def test_a_lease_lost_by_the_server_is_adopted_again_with_its_tokens(r: redis.Redis) -> None:
    g = TokenGate(r, floor=4, token_limit=100)
    assert g.acquire(("p:1", 70)) == [GRANTED]
    assert g.resize("p:1t70", 80) == (1, "p:1t80", 80)
    r.delete(g.keys.holders, g.keys.adm)  # the gate's state is lost, the work still runs
    reply = g.heartbeat("p", [("p:1t80", 10**15)])
    assert reply.adopted == ["p:1t80"]
    assert g.held()[1:] == (1, 80)
    assert g.acquire(("q:1", 30)) == [PARKED]  # 80 + 30 > 100: the adopted tokens count


def test_a_gate_without_a_token_budget_counts_tokens_but_never_limits_by_them(
    r: redis.Redis,
) -> None:
    g = TokenGate(r, floor=2, token_limit=0)
    g.defaults[7] = ""
    assert g.acquire(("p:1", 10**9), ("p:2", 10**9)) == [GRANTED, GRANTED]
    assert g.acquire(("p:3", 1)) == [PARKED]  # the units limit still holds
    assert g.held()[2] == 2 * 10**9


def test_a_lease_resized_back_to_an_earlier_size_is_adopted_again_when_lost(
    r: redis.Redis,
) -> None:
    """Found by the token model: resized back, a lease has its old id again, whose tombstone
    (kept so a heartbeat in flight with the old id does not count it twice) must not stop the
    heartbeat from counting it again once Redis loses it."""
    g = TokenGate(r, floor=4, token_limit=100)
    assert g.acquire(("p:1", 0)) == [GRANTED]
    assert g.resize("p:1", 10) == (1, "p:1t10", 10)
    assert g.resize("p:1t10", 0) == (1, "p:1", 0)
    r.zrem(g.keys.holders, "p:1")  # lost while the work runs
    reply = g.heartbeat("p", [("p:1", 10**15)])
    assert reply.adopted == ["p:1"] and "p:1" in g.held()[0]
