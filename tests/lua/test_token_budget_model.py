"""Property-based test of the token budget and the band shares: random transitions against the
real scripts, on a real redis-server, with the two budgets' and the shares' rules checked after
every step.

The machine draws requests of several weights, priorities, tenants and token sizes (some above
the token budget, some above the token ceiling), releases, cancels, resizes (shrinks and
growths), heartbeats, expiries (a lease's or a waiter's entry set in the past), Redis losing a
lease while its work runs (adopted again by the heartbeat), and publishes that lower or restore
the ceilings, change the band shares, or tune the token budget (the coordinator's token target:
lowered, raised up to the ceiling, withdrawn). It keeps only what callers know (their leases, by the
ids the replies name) and checks against Redis:

  * tokens held (adm ``tok``) = the sum of the holders' tokens, units = their weights;
  * units <= limit and tokens <= the token budget in force (the tuned one, clamped to the
    ceiling, else the configured) whenever the step granted anything, and a resize
    never grows a lease past the budget nor while anyone eligible waits;
  * each band's drain counts no more grants than the hand-offs made (deadline admission on);
  * the units held per band (adm ``held``) = the holders' by the band in their ids; a lease
    granted in a band never takes a share binding that band above its units (shares lowered
    meanwhile included), and a call heavier than its band's share of the ceiling is refused;
  * FIFO inside a lane: a waiter is never granted while an older waiter of its lane waits;
  * nothing is granted above the token ceiling in force (a waiter above a lowered ceiling is
    refused when it reaches the head of its lane, as one above a lowered weight ceiling);
  * every non-empty lane is in exactly one of fair / big; each lane's tag in adm is its entry's
    in the fair order, through settlements (releases that report the tokens a call used move
    their lane's tag), and a band's reservation names a waiter of a lane in it.

The exact state machine of the units (``test_transitions_model.py``) mirrors the library; this
one checks the rules the token budget adds, whatever the library chose.
"""

from __future__ import annotations

import itertools
import os
import uuid
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from fleetgate.admission import lane_class, member_id, tokens_of, weight_of, weighted_id
from fleetgate.bands import share_cap
from fleetgate.keys import GateKeys
from fleetgate.observed import encode_report, tally
from fleetgate.scripts import SCRIPT_NAMES, script_source
from fleetgate.settings import GateSettings

from ..conftest import RedisUnderTest
from ._model_library import held_field, priority_of

LIMIT, TOKEN_LIMIT, TOKEN_CEILING = 4, 100, 150
LONG_MS = 600_000
TOKENS = (0, 10, 25, 40, 60, 100, 120, 160)  # 120: above the budget; 160: above the ceiling
PODS = ("pa", "pb")
EXAMPLES = int(os.environ.get("FLEETGATE_MODEL_EXAMPLES", "400"))


class TokenGateMachine(RuleBasedStateMachine):
    def __init__(self, url: str) -> None:
        super().__init__()
        self.r = redis.Redis.from_url(url, decode_responses=True)
        self.keys = GateKeys.of(f"k{uuid.uuid4().hex[:8]}", "model")
        self.scripts = {n: self.r.register_script(script_source(n)) for n in SCRIPT_NAMES}
        self.ids = itertools.count(1)
        self.granted_now = False
        self.token_ceiling = TOKEN_CEILING
        self.members: dict[str, str] = {}  # parked id -> its waiter member
        self.classes: dict[str, str] = {}  # lease id -> the lane class it asked in
        self.shares: dict[int, float] = {}  # the band shares published
        self.granted: set[str] = set()  # what the last step granted
        self.revoke = False  # revocation on (revoke_after 1 ms: any waiting head qualifies)
        self.token_target: int | None = None  # the coordinator's tuned budget (None: none)

    @property
    def budget(self) -> int:
        """The token budget in force: the tuned one up to the ceiling, else the configured."""
        if self.token_target is None:
            return TOKEN_LIMIT
        return min(self.token_target, self.token_ceiling)

    def call(self, name: str, *args: object) -> Any:
        return self.scripts[name](keys=self.keys.script_keys(), args=list(args))

    def defaults(self) -> list[object]:
        # deadline admission on: the hand-offs keep the bands' drain (no call here has a
        # deadline short enough to be refused by it)
        return [
            LIMIT,
            LIMIT,
            6,
            LONG_MS,
            LONG_MS,
            6,
            0,
            TOKEN_LIMIT,
            TOKEN_CEILING,
            1,
            "",
            "",
            "a}2",
        ]

    # -- what Redis holds -----------------------------------------------------------------

    def holders(self) -> list[str]:
        return list(self.r.zrange(self.keys.holders, 0, -1))

    def lanes(self) -> list[str]:
        return list(self.r.zrange(self.keys.lanes, 0, -1))

    def held(self) -> tuple[int, int]:
        ids = self.holders()
        return sum(weight_of(i) for i in ids), sum(tokens_of(i) for i in ids)

    def step(self, before: set[str], waiting_before: list[str]) -> None:
        """After a script: what it granted, checked against FIFO inside each lane."""
        granted = set(self.holders()) - before
        self.granted_now, self.granted = bool(granted), granted
        for lid in granted:  # a waiter above a lowered token ceiling is refused, never granted
            assert tokens_of(lid) <= self.token_ceiling, f"{lid} granted above the token ceiling"
        still = set(self.lanes())
        for m in waiting_before:
            if member_id(m) in granted:
                lane = m.rsplit("}", 2)[0]
                older = [w for w in waiting_before if w < m and w.startswith(lane + "}")]
                assert not (set(older) & still), f"{m} granted before an older waiter of its lane"

    # -- transitions ------------------------------------------------------------------------

    @rule(
        pod=st.sampled_from(PODS),
        weight=st.sampled_from((1, 1, 2)),
        priority=st.sampled_from((0, 0, 5)),
        tenant=st.sampled_from((None, "a", "b")),
        tokens=st.sampled_from(TOKENS),
        n=st.integers(1, 3),
    )
    def acquire(
        self, pod: str, weight: int, priority: int, tenant: str | None, tokens: int, n: int
    ) -> None:
        before, waiting = set(self.holders()), self.lanes()
        args: list[object] = [*self.defaults(), 0, 0, 0]
        ids = []
        for _ in range(n):
            lid = weighted_id(f"{pod}:{next(self.ids)}", weight, tokens, priority)
            ids.append(lid)
            args += [lid, LONG_MS, lane_class(priority, tenant)]
            self.classes[lid] = lane_class(priority, tenant)
        reply = self.call("acquire", *args)
        bound = [share_cap(f, LIMIT) for p, f in self.shares.items() if p >= priority]
        for k, lid in enumerate(ids):
            status = int(reply[5 + 5 * k])
            if weight > min(bound, default=weight):
                assert status == 8, (lid, status)  # heavier than its share of the ceiling
            elif tokens > self.token_ceiling:
                assert status == 6, (lid, status)
            if status == 2:
                self.members[lid] = next(m for m in self.lanes() if m.endswith("}" + lid))
        self.step(before, waiting)

    @precondition(lambda self: self.r.zcard(self.keys.holders) > 0)
    @rule(data=st.data(), used=st.sampled_from((None, 0, 5, 50, 400)))
    def release(self, data: st.DataObject, used: int | None) -> None:
        """A release, with a report of the tokens the call used (a settlement: its lane's
        tag moves while the lane waits) or without."""
        before, waiting = set(self.holders()), self.lanes()
        lid = data.draw(st.sampled_from(sorted(before)))
        usage = None if used is None else (tokens_of(lid), used, self.classes.get(lid, ""))
        pairs = tally([encode_report("ok", 0.01, usage)])
        assert int(self.call("release", len(pairs), *pairs, lid)) == 1
        self.step(before - {lid}, waiting)

    @precondition(lambda self: self.r.zcard(self.keys.holders) > 0)
    @rule(data=st.data(), tokens=st.sampled_from(TOKENS))
    def resize(self, data: st.DataObject, tokens: int) -> None:
        before, waiting = set(self.holders()), self.lanes()
        lid = data.draw(st.sampled_from(sorted(before)))
        held = self.held()[1]
        eligible = self.r.zcard(self.keys.fair) > 0
        status, new_id, now_held = self.call("resize", lid, tokens)
        self.classes[new_id] = self.classes.get(lid, "")
        grow = tokens > tokens_of(lid)
        if tokens > self.token_ceiling:
            assert int(status) == -2
        elif grow and (eligible or held + tokens - tokens_of(lid) > self.budget):
            assert (int(status), new_id) == (0, lid)  # no growth into owed or missing tokens
        else:
            assert int(status) == 1 and tokens_of(new_id) == tokens == int(now_held)
        after = set(self.holders())
        self.step(before - {lid} | ({new_id} if new_id in after else set()), waiting)

    @precondition(lambda self: bool(self.members))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        before, waiting = set(self.holders()), self.lanes()
        lid = data.draw(st.sampled_from(sorted(self.members)))
        self.call("cancel", lid, self.members.pop(lid))
        self.step(before - {lid}, waiting)

    @precondition(lambda self: self.r.zcard(self.keys.holders) > 0)
    @rule(data=st.data(), lost=st.booleans())
    def expire_or_lose_a_lease(self, data: st.DataObject, lost: bool) -> None:
        """A lease lapses (its expiry set in the past: reaped with its tokens), or Redis loses
        it while its work runs (the heartbeat adopts it again, counting its tokens)."""
        lid = data.draw(st.sampled_from(sorted(self.holders())))
        if lost:
            self.r.zrem(self.keys.holders, lid)
            tok = tokens_of(lid)
            if tok:
                self.r.hincrby(self.keys.adm, "tok", -tok)
            if weight_of(lid) > 1:
                self.r.hincrby(self.keys.adm, "extra", 1 - weight_of(lid))
            held = held_field(self.holders())  # (the per-band counts, for the band shares)
            if held:
                self.r.hset(self.keys.adm, "held", held)
            else:
                self.r.hdel(self.keys.adm, "held")
            pod = lid.rpartition(":")[0]
            before, waiting = set(self.holders()), self.lanes()
            self.call("heartbeat", pod, 10_000, 1, lid, 10**15, 0, 0, 0, *self.defaults())
            assert lid in self.holders()
            self.step(before | {lid}, waiting)
        else:
            self.r.zadd(self.keys.holders, {lid: 1})
            before, waiting = set(self.holders()) - {lid}, self.lanes()
            self.call("heartbeat", "", 1000, 0, 0)
            self.step(before, waiting)

    def publish(self) -> None:
        """The coordinator's publish: a gate's settings together (the stored configuration is
        all the scripts read: a field it lacks takes its default, not the acquires'), with the
        token ceiling and the band shares of this machine."""
        cfg = GateSettings(
            floor=LIMIT,
            ceiling=LIMIT,
            max_queued=6,
            lease_ms=LONG_MS,
            waiter_ms=LONG_MS,
            max_queued_per_tenant=6,
            tenant_weights={"a": 2},
            token_limit=TOKEN_LIMIT,
            token_ceiling=self.token_ceiling,
            band_share=self.shares,
        ).as_cfg()
        # 1 ms, below what a client may set (0.1 s): the model's steps take longer than that
        cfg["revoke_after_ms"] = 1 if self.revoke else ""
        cfg["token_target"] = "" if self.token_target is None else self.token_target
        flat = [x for kv in cfg.items() for x in kv]
        assert self.call("publish", 0, LONG_MS, "", len(cfg), *flat)[0] == 1

    @rule(ceiling=st.sampled_from((TOKEN_CEILING, TOKEN_CEILING, TOKEN_LIMIT)))
    def publish_token_ceiling(self, ceiling: int) -> None:
        """The coordinator's config lowers or restores the token ceiling (the budget stays)."""
        before, waiting = set(self.holders()), self.lanes()
        self.token_ceiling = ceiling
        self.publish()
        self.step(before, waiting)

    @rule(value=st.sampled_from((None, 40, 100, 140, 200)))
    def publish_token_target(self, value: int | None) -> None:
        """The coordinator tunes the token budget: lowered, raised (up to the ceiling: 200 is
        clamped), or withdrawn (the configured budget again). A raised one hands the room to
        the waiters in the publish; a lowered one takes nothing back."""
        before, waiting = set(self.holders()), self.lanes()
        self.token_target = value
        self.publish()
        self.step(before, waiting)

    @rule(share=st.sampled_from(({}, {0: 0.5}, {5: 0.75, 0: 0.5}, {0: 0.25}, {5: 0.5})))
    def publish_band_share(self, share: dict[int, float]) -> None:
        """The coordinator's config sets, changes or removes the band shares (a lowered one
        refuses a parked head heavier than its new share of the ceiling; nothing held is taken
        back)."""
        before, waiting = set(self.holders()), self.lanes()
        self.shares = share
        self.publish()
        self.step(before, waiting)

    @rule(on=st.booleans())
    def publish_revoke_after(self, on: bool) -> None:
        """The coordinator's config turns revocation on or off."""
        before, waiting = set(self.holders()), self.lanes()
        self.revoke = on
        self.publish()
        self.step(before, waiting)

    def marked(self) -> set[str]:
        """The lease ids marked revoked (lib_revoke.lua: '<id>=v' in evicted)."""
        return {m[:-2] for m in self.r.zrangebyscore(self.keys.evicted, 2**52, 2**52)}

    @precondition(lambda self: self.r.zcard(self.keys.holders) > 0)
    @rule(pod=st.sampled_from(PODS))
    def holder_heartbeat(self, pod: str) -> None:
        """A pod's heartbeat with its leases, newest first: with revocation on, a waiting head
        asks lower bands for units and this pod marks its own. A mark frees nothing; marks go
        only to leases of bands strictly below the first waiting band, and only as many units
        as its head lacks beyond those revoked and still held (one lease's weight over, at
        most: a lease is marked whole)."""
        before, waiting = set(self.holders()), self.lanes()
        mine = sorted(
            (h for h in before if h.startswith(pod + ":")),
            key=lambda i: int(i.split(":")[1].split("b")[0].split("w")[0].split("t")[0]),
            reverse=True,
        )
        top = self.r.zrange(self.keys.fair, 0, 0)
        marked_before = self.marked()
        revoked_held = sum(weight_of(i) for i in marked_before if i in before)
        head_weight = 0
        if top:
            band, _, tenant = top[0].split("}")
            head = self.r.zrangebylex(
                self.keys.lanes, f"[{tenant}}}{band}}}", f"({tenant}}}{band}~", 0, 1
            )
            head_weight = weight_of(member_id(head[0])) if head else 0
        args: list[object] = [pod, 10_000, len(mine)]
        for lid in mine:
            args += [lid, 10**15]
        reply = self.call("heartbeat", *args, 0, 0, 0, *self.defaults())
        told = set(reply[21])
        new = self.marked() - marked_before
        assert told <= set(mine) and new <= told, (told, mine, new)
        if not self.revoke:
            assert not new, new
        if new:
            assert top, f"{new} revoked with nobody waiting"
            for lid in new:  # strictly below the first waiting band
                assert priority_of(lid) < 100 - int(band), (lid, top)
            units = sum(weight_of(i) for i in new)
            heaviest = max(weight_of(i) for i in new)
            assert units <= max(0, head_weight - revoked_held) + heaviest - 1, (new, top)
        assert before <= set(self.holders()), before - set(self.holders())  # a mark frees nothing
        self.step(before, waiting)

    # -- invariants -------------------------------------------------------------------------

    @invariant()
    def no_grant_takes_a_share_above_its_units(self) -> None:
        ids = self.holders()
        for lid in self.granted:
            for p, f in self.shares.items():
                if p >= priority_of(lid):
                    held = sum(weight_of(i) for i in ids if priority_of(i) <= p)
                    assert held <= share_cap(f, LIMIT), (lid, p, f, ids)

    @invariant()
    def counters_match_the_holders(self) -> None:
        ids = self.holders()
        tok = int(self.r.hget(self.keys.adm, "tok") or 0)
        extra = int(self.r.hget(self.keys.adm, "extra") or 0)
        assert tok == sum(tokens_of(i) for i in ids), (tok, ids)
        assert len(ids) + extra == sum(weight_of(i) for i in ids)
        assert self.r.hget(self.keys.adm, "held") == held_field(ids)

    @invariant()
    def both_caps_hold_after_a_grant(self) -> None:
        if self.granted_now:
            units, tokens = self.held()
            assert units <= LIMIT and tokens <= self.budget, (units, tokens, self.holders())

    @invariant()
    def the_drain_counters_are_well_formed(self) -> None:
        """Each band's drain (adm dr:<R> = '<s>,<w>,<at>') counts no more grants than the
        hand-offs made, over non-negative time, last moved no later than now; the refused
        callers' return count (rj) is non-negative."""
        now = self.r.time()
        now_ms = now[0] * 1000 + now[1] // 1000
        handed = int(self.r.hget(self.keys.stats, "handed_off") or 0)
        for key, v in self.r.hgetall(self.keys.adm).items():
            if key.startswith("dr:"):
                grants, over, at = (float(x) for x in v.split(","))
                assert 0 <= grants <= handed + 1e-6 and over >= 0 and at <= now_ms, (key, v)
            elif key == "rj":
                assert float(v.split(",")[0]) >= 0, v

    @invariant()
    def every_lane_is_scheduled_once(self) -> None:
        lanes = {m.rsplit("}", 2)[0] for m in self.lanes()}
        entries = self.r.zrange(self.keys.fair, 0, -1)
        fair = {f"{f.split('}')[2]}}}{f.split('}')[0]}" for f in entries}
        big = set(self.r.zrange(self.keys.big, 0, -1))
        assert lanes == fair | big and not (fair & big), (lanes, fair, big)
        self.members = {k: v for k, v in self.members.items() if v in set(self.lanes())}

    @invariant()
    def tags_and_reservations_match_the_fair_order(self) -> None:
        """Each lane's tag in adm is its entry's in the fair order (settlements move both);
        a band's reservation names a waiter of a lane in the fair order."""
        adm = self.r.hgetall(self.keys.adm)
        entries = self.r.zrange(self.keys.fair, 0, -1)
        tags = {f"{e.split('}')[2]}}}{e.split('}')[0]}": e.split("}")[1] for e in entries}
        assert {k[2:]: v for k, v in adm.items() if k.startswith("f:")} == tags, (adm, entries)
        waiting = set(self.lanes())
        for key, member in adm.items():
            if key.startswith("rsv:"):
                assert member in waiting and member.rsplit("}", 2)[0] in tags, (key, member)

    def teardown(self) -> None:
        self.r.close()  # the gate's keys stay under this example's own prefix


@pytest.mark.timeout(600)
def test_random_transitions_keep_both_budgets(rut: RedisUnderTest) -> None:
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(
        lambda: TokenGateMachine(rut.url),
        settings=settings(
            max_examples=max(50, EXAMPLES // 2),
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
