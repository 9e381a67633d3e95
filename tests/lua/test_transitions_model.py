"""Property-based test: random sequences of transitions against the real scripts.

A plain-Python model of the schema-2 semantics (docs/admission.md, lua/lib_*.lua) runs in
lockstep with the real scripts on a real redis-server: weighted leases, lanes per (tenant, band),
self-clocked fair queuing per band with the exact integer tags of the Lua library, reservations,
lanes too heavy for the limit ("big"), eviction, shedding, the per-tenant bound and the bounded,
lazy reaping of each script. After every step the whole gate state in Redis (holders, lanes,
waiters, fair, big, adm, stats, wake lists, evictions, replies and fencing tokens) must equal the
model's.

Independently of how the model (and the library) pick the next grant, these invariants are
checked against Redis or at each grant:
  * units held = sum of the holders' weights = ZCARD holders + adm extra; units <= limit after
    any step that granted;
  * every non-empty lane is in exactly one of fair/big, fair tags = adm f: fields, big scores =
    head weights, nothing left of an empty lane;
  * strict bands: no grant while a higher band has a lane whose head fits under the limit;
  * FIFO inside a lane (no grant passes an older waiter of its lane; no at-once grant while its
    lane has waiters);
  * work conservation: after a step that handed off, the top band's heads either do not fit in
    the free units or the free units are reserved for a head of that band that does not fit;
  * fencing tokens strictly increase in grant order;
  * a request below shed_below never parks; no tenant holds more than max_queued_per_tenant
    waiters; the wait list never exceeds max_queued.

Two machines: one drawing weights, priorities and tenants, and one of default requests only
(weight 1, priority 0, no tenant), where the old FIFO rules (one lane, exact FIFO, no idle unit
while anyone waits) must still hold.
"""

from __future__ import annotations

import itertools
import os
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from fleetgate.admission import lane_class, weighted_id
from fleetgate.keys import GateKeys
from fleetgate.scripts import SCRIPT_NAMES, script_source

from ..conftest import RedisUnderTest

FLOOR, CEILING, MAX_QUEUED, MAX_QUEUED_PER_TENANT = 1, 6, 5, 3
PODS = ("pa", "pb", "pc")
TENANTS = (None, "a", "b")
PRIORITIES = (-1, 0, 0, 1, 2)
WEIGHTS = (1, 1, 1, 1, 2, 2, 3, 3, 5, 5, 6, 7)  # 6 = CEILING (above most limits), 7 never grantable
TENANT_WEIGHTS = ("a}2", "", "a}2}b}3")  # the first is the gate's initial configuration
LONG_MS = 600_000  # nothing expires by itself during a run; expiry is a rule
# The gate's token counter at the start, so every token is predictable: ahead of server ms x
# 1000 (the floor tokens never go below, lib_tokens.lua next_tokens; tested in
# tests/lua/test_fencing_tokens.py) until about 2096, and exact in a Lua double.
SEQ0 = 4_000_000_000_000_000
# the library's per-call bounds
REAP_MAX, HANDOFF_MAX, READMIT_MAX = 64, 256, 16
DROP_MAX = 2 * REAP_MAX
REFUSE_LANES, REFUSE_HEADS = 16, 16
CEILINGS = (CEILING, CEILING, 4, 3)  # what the coordinator's publish sets (lowered: refusals)

# FLEETGATE_MODEL_MIRROR=0 checks the rules alone (not the exact state): to see that a mutation
# of the library breaks a rule, not only the mirror.
MIRROR = os.environ.get("FLEETGATE_MODEL_MIRROR", "1") != "0"

GRANTED, PARKED, REJECTED, REJECTED_TENANT, SHED, TOO_HEAVY = 1, 2, 0, 3, 4, 5


def pad20(n: int) -> str:
    return f"{n:020d}"


def lane_of(priority: int, tenant: str | None) -> str:
    return f"{tenant or ''}}}{100 - priority:03d}"


def band(lane: str) -> str:
    return lane[-3:]


def lane_tenant(lane: str) -> str:
    return lane[:-4]


def member_lane(member: str) -> str:
    return member.split("}")[0] + "}" + member.split("}")[1]


def fair_key(lane: str, f: int) -> tuple[str, str, str]:
    """A lane's place in fg:{G}:fair ('<R>}<F20>}<tenant>', ordered by bytes)."""
    return band(lane), pad20(f), lane_tenant(lane)


def weight_of(lease_id: str) -> int:
    tail = lease_id.rpartition(":")[2]
    return int(tail.partition("w")[2]) if "w" in tail else 1


def pod_of(lease_id: str) -> str:
    return lease_id.rpartition(":")[0]


@dataclass(frozen=True)
class Waiter:
    member: str
    id: str
    seq: int

    @property
    def w(self) -> int:
        return weight_of(self.id)

    @property
    def lane(self) -> str:
        return member_lane(self.member)


@dataclass(frozen=True)
class Request:
    id: str
    priority: int
    tenant: str | None

    @property
    def w(self) -> int:
        return weight_of(self.id)

    @property
    def lane(self) -> str:
        return lane_of(self.priority, self.tenant)


class GateModel:
    """The Lua library and the scripts in Python, on the same integers. The strict-band, FIFO and
    token rules are asserted at each grant (independently of how the grant was chosen)."""

    def __init__(self) -> None:
        self.holders: dict[str, bool] = {}  # id -> expired
        self.lanes: dict[str, list[Waiter]] = {}  # lane -> waiters in seq order
        self.expired: set[str] = set()  # waiter members whose entry expired
        self.fair: dict[str, int] = {}  # lane -> tag
        self.big: dict[str, int] = {}  # lane -> head weight
        self.vt: dict[str, int] = {}  # band -> virtual time
        self.rsv: dict[str, str] = {}  # band -> reserved waiter member
        self.tw: dict[str, int] = {"a": 2}
        self.shed_below = 0
        self.target: dict[str, Any] = {"value": None, "epoch": None, "expired": False}
        self.seq = SEQ0
        self.stats: Counter[str] = Counter()
        self.wakes: dict[str, list[str]] = {}
        self.evicted: set[str] = set()  # ids (evicted), '<id>=c' (refused: above the ceiling)
        self.ceiling = CEILING
        self.tokens: list[int] = []  # fencing tokens in grant order
        self.granted_seq: dict[str, int] = {}  # lane -> seq of its last waiter granted
        # this acquire call's parks (not yet in Redis: the library adds them at the end)
        self.pending: dict[str, list[Request]] = {}

    # -- derived ------------------------------------------------------------------------------

    def limit(self) -> int:
        lim = FLOOR
        if self.target["value"] is not None and not self.target["expired"]:
            lim = self.target["value"]
        return max(FLOOR, min(self.ceiling, lim))

    def units(self) -> int:
        return sum(weight_of(h) for h in self.holders)

    def n_waiters(self) -> int:
        return sum(len(ws) for ws in self.lanes.values())

    def waiting(self) -> dict[str, Waiter]:
        return {w.member: w for ws in self.lanes.values() for w in ws}

    def tenant_weight(self, t: str) -> int:
        return 1 if t == "" else max(1, min(1000, self.tw.get(t, 1)))

    def cost(self, w: int, t: str) -> int:
        return -(-w * 1000 // self.tenant_weight(t))

    def fair_order(self) -> list[str]:
        return sorted(self.fair, key=lambda lane: fair_key(lane, self.fair[lane]))

    def next_tokens(self, k: int) -> int:
        first = self.seq + 1
        self.seq += k
        return first

    # -- grant checks (the rules, not the mechanism) --------------------------------------------

    def check_grant(self, lane: str, token: int, lim: int, waiter: Waiter | None) -> None:
        """A grant in `lane` (of a parked waiter, or at once): no higher band has a lane whose
        head fits under the limit; FIFO in the lane; tokens increase."""
        if not MIRROR:
            return  # the model is not Redis's state then
        for other, ws in self.lanes.items():
            if band(other) < band(lane) and ws:
                assert ws[0].w > lim, f"strict bands: {lane} granted while {ws[0].member} waits"
        for other, reqs in self.pending.items():
            if band(other) < band(lane) and not self.lanes.get(other):
                assert reqs[0].w > lim, f"strict bands: {lane} granted while {reqs[0].id} parks"
        if waiter is None:
            assert not self.lanes.get(lane) and lane not in self.pending, f"barging in {lane}"
        else:
            assert self.lanes[lane][0] == waiter, f"FIFO: {waiter.member} is not its lane's head"
            assert waiter.seq > self.granted_seq.get(lane, -1)
            self.granted_seq[lane] = waiter.seq
        assert not self.tokens or token > self.tokens[-1], "tokens must increase"
        self.tokens.append(token)

    # -- the library ------------------------------------------------------------------------

    def wake(self, lease_id: str, value: str) -> None:
        self.wakes.setdefault(pod_of(lease_id), []).append(value)

    def remove_leases(self, ids: list[str]) -> int:
        n = 0
        for lid in dict.fromkeys(ids):
            if self.holders.pop(lid, None) is not None:
                n += 1
        return n

    def lane_enter(self, lane: str, w_head: int, lim: int) -> None:
        if w_head > lim:
            self.big[lane] = w_head
            return
        self.fair[lane] = self.vt.get(band(lane), 0) + self.cost(w_head, lane_tenant(lane))

    def left_fair(self, lane: str) -> None:
        """A lane leaves fair; its band's virtual time goes with the band's last fair lane."""
        del self.fair[lane]
        if not any(band(other) == band(lane) for other in self.fair):
            self.vt.pop(band(lane), None)

    def lanes_touched(self, touched: set[str]) -> None:
        for lane in touched:
            ws = self.lanes.get(lane)
            if not ws:
                self.lanes.pop(lane, None)
                if lane in self.fair:
                    self.left_fair(lane)
                else:
                    self.big.pop(lane, None)
            elif lane not in self.fair:
                self.big[lane] = ws[0].w

    def remove_waiters(self, members: list[str]) -> None:
        touched = set()
        for m in members:
            lane = member_lane(m)
            self.lanes[lane] = [w for w in self.lanes[lane] if w.member != m]
            self.expired.discard(m)
            touched.add(lane)
            if self.rsv.get(band(lane)) == m:
                del self.rsv[band(lane)]  # its reservation goes with it
        self.lanes_touched(touched)

    def readmit(self, lim: int) -> None:
        lanes = sorted((s, lane) for lane, s in self.big.items() if s <= lim)[:READMIT_MAX]
        for _, lane in lanes:
            del self.big[lane]
            if self.lanes.get(lane):
                self.lane_enter(lane, self.lanes[lane][0].w, lim)

    def reap_leases(self) -> int:
        gone = [h for h, exp in self.holders.items() if exp][:REAP_MAX]
        for h in gone:
            del self.holders[h]
        self.stats["expired_leases"] += len(gone)
        return sum(weight_of(h) for h in gone)

    def reap_waiters(self) -> int:
        gone = [m for m in self.waiting() if m in self.expired][:REAP_MAX]
        if gone:
            self.remove_waiters(gone)
            self.stats["abandoned_waiters"] += len(gone)
        return len(gone)

    def reap(self) -> None:
        self.reap_leases()
        self.reap_waiters()

    def handoff(self, lim: int, units: int | None = None) -> tuple[int, int, int]:
        """lib_handoff.lua's handoff, turn by turn (the turns decide which dead heads are
        dropped)."""
        free = lim - (self.units() if units is None else units)
        if free <= 0:
            return 0, 0, 0
        grants: list[str] = []
        refused: list[str] = []  # heads heavier than the ceiling, dead or not (in dropped too)
        gone = dropped = granted_units = 0
        stop, turns = False, 0
        while not stop and len(grants) < HANDOFF_MAX and dropped < DROP_MAX:
            if turns >= 2 * HANDOFF_MAX:
                break
            turns += 1
            order = self.fair_order()
            if not order:
                break
            lane = order[0]
            f, r = self.fair[lane], band(lane)
            bound = None
            if len(order) > 1 and band(order[1]) == r:
                bound = self.fair[order[1]]
            rsv = self.rsv.get(r)
            if rsv is not None:
                rlane = member_lane(rsv)
                if rlane not in self.fair:
                    del self.rsv[r]
                    rsv = None
                elif rlane != lane:
                    lane, f, bound = rlane, self.fair[rlane], f
            old_f, t = f, lane_tenant(lane)
            want = min(free, HANDOFF_MAX - len(grants))
            if bound is not None and want > 8:
                want = 8
            heads = self.lanes.get(lane, [])[: want + 1]
            if (
                rsv is not None
                and member_lane(rsv) == lane
                and (not heads or heads[0].member != rsv)
            ):
                del self.rsv[r]
                continue
            vt0 = self.vt.get(r, 0)
            vt = vt0
            last = min(len(heads), want)
            state = "open"
            i = 0
            while i < last:
                m = heads[i]
                if m.member in self.expired or m.w > self.ceiling:
                    if m.w > self.ceiling:
                        refused.append(m.id)
                    self.lanes[lane].remove(m)
                    self.expired.discard(m.member)
                    gone += 1
                    dropped += 1
                    if rsv == m.member:
                        del self.rsv[r]
                        rsv = None
                    if i + 1 < len(heads):
                        f = max(0, f - self.cost(m.w, t)) + self.cost(heads[i + 1].w, t)
                    i += 1
                    if dropped >= DROP_MAX:
                        break
                elif m.w > lim:
                    state = "big"
                    break
                elif bound is not None and f > bound and rsv != m.member:
                    break
                elif m.w > free:
                    self.rsv[r] = m.member
                    stop = True
                    break
                else:
                    token = self.seq + len(grants) + 1
                    self.check_grant(lane, token, lim, m)
                    self.lanes[lane].remove(m)
                    gone += 1
                    grants.append(m.id)
                    free -= m.w
                    granted_units += m.w
                    if rsv == m.member:
                        del self.rsv[r]
                        rsv = None
                    if bound is None:  # alone in its band: neither vt nor its start moves
                        if i + 1 < len(heads):
                            f = max(0, f - self.cost(m.w, t)) + self.cost(heads[i + 1].w, t)
                    else:
                        vt = max(vt, f)
                        if i + 1 < len(heads):
                            f = vt + self.cost(heads[i + 1].w, t)
                    i += 1
                    if free <= 0 or len(grants) >= HANDOFF_MAX:
                        stop = True
                        break
            if i >= len(heads):
                state = "empty"
            if vt != vt0:
                self.vt[r] = vt
            if state != "open":
                self.left_fair(lane)
                if state == "big":
                    if rsv is not None and member_lane(rsv) == lane:
                        del self.rsv[r]
                    self.big[lane] = heads[i].w
            elif f != old_f:
                self.fair[lane] = f
            if not self.lanes.get(lane):
                self.lanes.pop(lane, None)
        if grants:
            first = self.next_tokens(len(grants))
            for k, lid in enumerate(grants):
                self.holders[lid] = False
                self.wake(lid, f"{lid}={first + k}")
            self.stats["granted"] += len(grants)
            self.stats["handed_off"] += len(grants)
        self.stats["abandoned_waiters"] += dropped - len(refused)
        self.refuse_heads(refused)
        return len(grants), gone, granted_units

    def refuse_heads(self, ids: list[str]) -> None:
        for lid in ids:
            self.evicted.add(f"{lid}=c")
            self.wake(lid, f"{lid}=c{self.ceiling}")
        self.stats["too_heavy"] += len(ids)

    def refuse_big(self) -> None:
        """lib_handoff.lua's refuse_big: the heads of big heavier than the ceiling are refused."""
        lanes = sorted((s, lane) for lane, s in self.big.items() if s > self.ceiling)
        members, ids = [], []
        for _, lane in lanes[:REFUSE_LANES]:
            for w in self.lanes.get(lane, [])[:REFUSE_HEADS]:
                if w.w <= self.ceiling:
                    break
                members.append(w.member)
                ids.append(w.id)
        if members:
            self.remove_waiters(members)
        self.refuse_heads(ids)

    def settle(self) -> int:
        self.reap()
        self.refuse_big()
        lim = self.limit()
        self.readmit(lim)
        self.handoff(lim)
        return lim

    # -- the scripts ----------------------------------------------------------------------------

    def acquire(
        self, reqs: list[Request], releases: list[str]
    ) -> tuple[int, list[tuple[int, ...]]]:
        released = self.remove_leases(releases)
        self.stats["released"] += released
        lim = self.limit()
        units = self.units()
        queued = self.n_waiters()
        leases_reaped = waiters_reaped = False
        loop_reaped = False
        if units >= lim:
            units -= self.reap_leases()
            leases_reaped = True
        if queued > 0 and units < lim:
            _, removed, granted_units = self.handoff(lim, units)
            units, queued = units + granted_units, queued - removed

        # acquire.lua's band_on_top: the fair order's top band (read again after a reap or an
        # eviction) or this call's parks' highest, whichever is higher
        top: dict[str, Any] = {"fair": None, "known": False, "parked": None}

        def band_on_top() -> str | None:
            if not top["known"]:
                top["known"] = True
                order = self.fair_order()
                top["fair"] = band(order[0]) if order else None
            fair, parked = top["fair"], top["parked"]
            if parked is not None and (fair is None or parked < fair):
                return parked  # type: ignore[no-any-return]
            return fair  # type: ignore[no-any-return]

        def tenant_count(t: str) -> int:
            n = sum(len(ws) for lane, ws in self.lanes.items() if lane_tenant(lane) == t)
            return n + sum(len(rs) for lane, rs in self.pending.items() if lane_tenant(lane) == t)

        def evict(r: str) -> bool:
            order = self.fair_order()
            if not order or band(order[-1]) <= r:
                return False
            tail = self.lanes[order[-1]][-1]
            self.remove_waiters([tail.member])
            top["known"] = False
            self.evicted.add(tail.id)
            evictions.append(tail.id)
            return True

        evictions: list[str] = []
        self.pending = {}
        decided: list[tuple[int, int]] = []  # status, n
        grant_units: list[int] = []
        token_at = self.seq  # tokens of this call's grants and parks follow in request order
        for req in reqs:
            w, lane, r = req.w, req.lane, band(req.lane)
            if w > self.ceiling:
                decided.append((TOO_HEAVY, self.ceiling))
                continue
            blocked = False
            if queued > 0:
                top_band = band_on_top()
                blocked = (top_band is not None and top_band <= r) or bool(self.lanes.get(lane))
            blocked = blocked or lane in self.pending
            if not blocked and units + w > lim and not leases_reaped:
                leases_reaped = True
                freed = self.reap_leases()
                units -= freed
                loop_reaped = loop_reaped or freed > 0
            if not blocked and units + w <= lim:
                units += w
                self.check_grant(lane, token_at + 1, lim, None)
                decided.append((GRANTED, units))
                grant_units.append(w)
            elif req.priority < self.shed_below:
                decided.append((SHED, self.shed_below))
            elif (
                MAX_QUEUED_PER_TENANT < MAX_QUEUED
                and tenant_count(lane_tenant(lane)) >= MAX_QUEUED_PER_TENANT
            ):
                decided.append((REJECTED_TENANT, MAX_QUEUED_PER_TENANT))
            else:
                if queued >= MAX_QUEUED and not waiters_reaped:
                    waiters_reaped = True
                    reaped = self.reap_waiters()
                    if reaped > 0:
                        loop_reaped = True
                        queued -= reaped
                        self.readmit(lim)
                        top["known"] = False
                if queued >= MAX_QUEUED and not evict(r):
                    decided.append((REJECTED, MAX_QUEUED))
                else:
                    if queued >= MAX_QUEUED:
                        queued -= 1
                    queued += 1
                    decided.append((PARKED, queued))
                    self.pending.setdefault(lane, []).append(req)
                    if w <= lim and (top["parked"] is None or r < top["parked"]):
                        top["parked"] = r
            if decided[-1][0] in (GRANTED, PARKED):
                token_at += 1

        out: list[tuple[int, ...]] = []
        n_new = sum(1 for s, _ in decided if s in (GRANTED, PARKED))
        token = self.next_tokens(n_new) if n_new else 0
        parked: dict[str, list[Waiter]] = {}
        for req, (s, n) in zip(reqs, decided, strict=True):
            if s == GRANTED:
                self.holders[req.id] = False
                out.append((s, token, n))
                token += 1
            elif s == PARKED:
                member = f"{req.lane}}}{pad20(token)}}}{req.id}"
                parked.setdefault(req.lane, []).append(Waiter(member, req.id, token))
                out.append((s, token, n))
                token += 1
            else:
                out.append((s, 0, n))
        for lane, ws in parked.items():
            was_empty = not self.lanes.get(lane)
            self.lanes.setdefault(lane, []).extend(ws)
            if was_empty:
                self.lane_enter(lane, ws[0].w, lim)
        self.pending = {}
        if (parked or loop_reaped) and units < lim:
            # a park of this call may have put a fitting head first; a reap in the loop may
            # have freed units or removed a head
            self.handoff(lim, units)
        statuses = Counter(s for s, _ in decided)
        self.stats["granted"] += statuses[GRANTED]
        self.stats["parked"] += statuses[PARKED]
        self.stats["rejected"] += len(decided) - statuses[GRANTED] - statuses[PARKED]
        self.stats["rejected_tenant"] += statuses[REJECTED_TENANT]
        self.stats["shed"] += statuses[SHED]
        self.stats["too_heavy"] += statuses[TOO_HEAVY]
        self.stats["evicted"] += len(evictions)
        for lid in evictions:
            self.wake(lid, f"{lid}=x")
        return released, out

    def release(self, ids: list[str]) -> int:
        n = self.remove_leases(ids)
        self.stats["released"] += n
        if self.n_waiters() > 0:
            self.handoff(self.limit())
        return n

    def cancel(self, lease_id: str, member: str) -> int:
        outcome = 0
        if member and member in self.waiting():
            self.remove_waiters([member])
            self.stats["cancelled"] += 1
            outcome = 1
        elif self.remove_leases([lease_id]) == 1:
            self.stats["released"] += 1
            outcome = 2
        self.settle()
        return outcome

    def fenced(self, epoch: int) -> bool:
        stored = self.target["epoch"]
        return stored is not None and epoch < stored

    def heartbeat(self, leases: list[str], members: list[str]) -> dict[str, Any]:
        self.reap()
        self.refuse_big()
        lost, granted, lost_waiters, evicted, too_heavy = [], [], [], [], []
        for lid in leases:
            if lid not in self.holders:
                lost.append(lid)
        waiting = self.waiting()
        for m in members:
            lid = m.rpartition("}")[2]
            if m in waiting:
                continue
            if lid in self.holders:
                granted.append(lid)
            elif lid in self.evicted:
                evicted.append(lid)
            elif f"{lid}=c" in self.evicted:
                too_heavy.append(lid)
            else:
                lost_waiters.append(lid)
        tokens = []
        if granted:
            first = self.next_tokens(len(granted))
            tokens = [first + k for k in range(len(granted))]
        lim = self.limit()
        self.readmit(lim)
        self.handoff(lim)
        return {
            "lost": lost,
            "granted": granted,
            "lost_waiters": lost_waiters,
            "queued": self.n_waiters(),
            "units": self.units(),
            "tokens": tokens,
            "evicted": evicted,
            "too_heavy": too_heavy,
            "ceiling": self.ceiling,
        }


class GateMachine(RuleBasedStateMachine):
    default_only = False

    def __init__(self, url: str) -> None:
        super().__init__()
        self.r = redis.Redis.from_url(url, decode_responses=True)
        self.keys = GateKeys.of(f"h{uuid.uuid4().hex[:8]}", "model")
        self.scripts = {n: self.r.register_script(script_source(n)) for n in SCRIPT_NAMES}
        self.m = GateModel()
        self.ids = itertools.count(1)
        self.epoch = 0
        self.members: dict[str, str] = {}  # id -> its waiter member (parked at some point)
        self.believed: dict[str, set[str]] = {p: set() for p in PODS}  # pod -> members parked
        self.granted_seq: dict[str, int] = {}  # lane -> the largest seq seen granted (Redis)
        self.r.set(self.keys.seq, SEQ0)
        self.handed_off = True  # the last step ran a hand-off (work conservation applies)
        self.granted_now = False
        self.n_tokens = 0

    def call(self, name: str, *args: object) -> Any:
        return self.scripts[name](keys=self.keys.script_keys(), args=list(args))

    def defaults(self) -> list[object]:
        return [FLOOR, CEILING, MAX_QUEUED, LONG_MS, LONG_MS, MAX_QUEUED_PER_TENANT, 0, "a}2"]

    def step(self, *, handed_off: bool) -> None:
        """After a script: whether it handed off, and whether it granted anything."""
        self.handed_off = handed_off
        self.granted_now = len(self.m.tokens) > self.n_tokens
        self.n_tokens = len(self.m.tokens)

    @initialize(via_publish=st.booleans(), value=st.integers(1, CEILING))
    def configure(self, via_publish: bool, value: int) -> None:
        """The gate's configuration: published by the coordinator, or registered by the first
        acquire's defaults (one with no request); then a first target."""
        if via_publish:
            cfg = dict(
                zip(
                    ("floor", "ceiling", "max_queued", "lease_ms", "waiter_ms"),
                    self.defaults()[:5],
                    strict=True,
                )
            )
            cfg |= {
                "max_queued_per_tenant": MAX_QUEUED_PER_TENANT,
                "shed_below": 0,
                "tenant_weights": "a}2",
            }
            flat = [x for kv in cfg.items() for x in kv]
            assert self.call("publish", 0, LONG_MS, "", len(cfg), *flat)[0] == 1
            self.m.target["epoch"] = 0
        else:
            self.call("acquire", *self.defaults(), 0, 0, 0)
        assert self.call("set_target", value, 0, LONG_MS)[0] == 1
        self.m.target.update(value=value, epoch=0, expired=False)
        self.step(handed_off=True)

    def requests(self, data: st.DataObject, pods: list[str]) -> list[Request]:
        reqs = []
        for pod in pods:
            base = f"{pod}:{next(self.ids)}"
            if self.default_only:
                reqs.append(Request(base, 0, None))
                continue
            w = data.draw(st.sampled_from(WEIGHTS), label="weight")
            prio = data.draw(st.sampled_from(PRIORITIES), label="priority")
            tenant = data.draw(st.sampled_from(TENANTS), label="tenant")
            reqs.append(Request(weighted_id(base, w), prio, tenant))
        return reqs

    @rule(pods=st.lists(st.sampled_from(PODS), min_size=1, max_size=3), data=st.data())
    def acquire(self, pods: list[str], data: st.DataObject) -> None:
        """A batch: some leases released (maybe none, maybe unknown ids), then new requests."""
        choices = [*self.m.holders, "nobody:0"]
        releases = data.draw(st.lists(st.sampled_from(choices), max_size=2), label="releases")
        reqs = self.requests(data, pods)
        triples = [a for q in reqs for a in (q.id, LONG_MS, lane_class(q.priority, q.tenant))]
        reply = self.call("acquire", *self.defaults(), 0, len(releases), *releases, 0, *triples)
        got = [tuple(int(x) for x in reply[i : i + 3]) for i in range(5, len(reply), 4)]
        shed_below = self.m.shed_below
        released, expected = self.m.acquire(reqs, releases)
        if MIRROR:
            assert (int(reply[3]), got) == (released, expected)
        for q, (status, token, _) in zip(reqs, got, strict=True):
            if q.priority < shed_below:
                assert status != PARKED, "a sheddable request parked"
            if status == PARKED:
                member = f"{q.lane}}}{pad20(token)}}}{q.id}"
                self.members[q.id] = member
                self.believed[pod_of(q.id)].add(member)
        self.step(handed_off=True)

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        choices = [*self.m.holders, "nobody:0"]
        ids = data.draw(st.lists(st.sampled_from(choices), min_size=1, max_size=3))
        released = self.call("release", 0, *ids)
        released_model = self.m.release(ids)
        assert released == released_model or not MIRROR
        self.step(handed_off=True)

    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        """Leave the wait list (by member), or give back a permit a hand-off raced in with."""
        known = [*self.m.waiting().values()]
        choices = [(w.id, w.member) for w in known]
        choices += [(h, self.members.get(h, "")) for h in self.m.holders]
        choices += [(i, m) for i, m in self.members.items() if i in self.m.evicted]
        choices.append(("nobody:0", ""))
        lid, member = data.draw(st.sampled_from(choices))
        outcome = self.call("cancel", lid, member)[0]
        outcome_model = self.m.cancel(lid, member)
        assert outcome == outcome_model or not MIRROR
        self.step(handed_off=True)

    @rule(data=st.data())
    def expire_holder(self, data: st.DataObject) -> None:
        live = [h for h, exp in self.m.holders.items() if not exp]
        if live:
            lid = data.draw(st.sampled_from(live))
            self.r.zadd(self.keys.holders, {lid: 1}, xx=True)
            self.m.holders[lid] = True
        self.step(handed_off=False)

    @rule(data=st.data())
    def expire_waiter(self, data: st.DataObject) -> None:
        waiting = sorted(self.m.waiting())
        if waiting:
            member = data.draw(st.sampled_from(waiting))
            self.r.zadd(self.keys.waiters, {member: 1}, xx=True)
            self.m.expired.add(member)
        self.step(handed_off=False)

    @rule(value=st.integers(0, 8), step=st.integers(-1, 1))
    def set_target(self, value: int, step: int) -> None:
        epoch = self.epoch + step
        accepted = self.call("set_target", value, epoch, LONG_MS)[0]
        if self.m.fenced(epoch):
            assert accepted == 0
            return
        assert accepted == 1
        self.epoch = max(self.epoch, epoch)
        self.m.target.update(value=value, epoch=epoch, expired=False)
        self.m.settle()
        self.step(handed_off=True)

    @precondition(lambda self: not self.default_only)
    @rule(
        tw=st.sampled_from(TENANT_WEIGHTS),
        shed_below=st.sampled_from((-1, 0)),
        ceiling=st.sampled_from(CEILINGS),
    )
    def publish(self, tw: str, shed_below: int, ceiling: int) -> None:
        """The coordinator's poll: tenant weights, shed_below and the ceiling (the target left
        alone); a lowered ceiling refuses the waiters heavier than it."""
        cfg = ["tenant_weights", tw, "shed_below", shed_below, "ceiling", ceiling]
        assert self.call("publish", self.epoch, LONG_MS, "", 3, *cfg)[0] == 1
        parts = tw.split("}") if tw else []
        self.m.tw = {parts[i]: int(parts[i + 1]) for i in range(0, len(parts), 2)}
        self.m.shed_below = shed_below
        self.m.ceiling = ceiling
        self.m.target["epoch"] = self.epoch
        self.m.settle()
        self.step(handed_off=True)

    @rule()
    def expire_target(self) -> None:
        if self.m.target["value"] is not None:
            self.r.hset(self.keys.target, "expires_at", 1)
            self.m.target["expired"] = True
        self.step(handed_off=False)

    @rule()
    def sweep(self) -> None:
        self.call("heartbeat", "", 1000, 0, 0)
        self.m.heartbeat([], [])
        self.step(handed_off=True)

    @rule(pod=st.sampled_from(PODS))
    def heartbeat(self, pod: str) -> None:
        """A pod renews its leases and waiters and learns of grants, losses and evictions."""
        leases = [*sorted(h for h in self.m.holders if pod_of(h) == pod), f"{pod}:0"]
        members = sorted(self.believed[pod])
        args: list[object] = [pod, 1000, len(leases)]
        for lid in leases:
            args += [lid, 0]
        args.append(len(members))
        for m in members:
            args += [m, LONG_MS]
        args.append(0)
        reply = self.call("heartbeat", *args)
        want = self.m.heartbeat(leases, members)
        got = {
            "lost": reply[2],
            "granted": reply[3],
            "lost_waiters": reply[4],
            "queued": int(reply[5]),
            "units": int(reply[6]),
            "tokens": [int(x) for x in reply[12]],
            "evicted": reply[13],
            "too_heavy": reply[14],
            "ceiling": int(reply[15]),
        }
        assert got == want or not MIRROR
        for m in members:
            ended = want["granted"] + want["lost_waiters"] + want["evicted"] + want["too_heavy"]
            if m.rpartition("}")[2] not in ended:
                continue
            self.believed[pod].discard(m)
        self.step(handed_off=True)

    # -- invariants -----------------------------------------------------------------------------

    def read(self) -> dict[str, Any]:
        k = self.keys
        p = self.r.pipeline(transaction=True)
        p.zrange(k.holders, 0, -1)
        p.zrange(k.lanes, 0, -1)
        p.zrange(k.waiters, 0, -1)
        p.zrange(k.fair, 0, -1)
        p.zrange(k.big, 0, -1, withscores=True)
        p.hgetall(k.adm)
        p.hgetall(k.stats)
        p.zrange(k.evicted, 0, -1)
        for pod in PODS:
            p.lrange(k.wake(pod), 0, -1)
        names = ("holders", "lanes", "waiters", "fair", "big", "adm", "stats", "evicted")
        res = p.execute()
        out = dict(zip(names, res, strict=False))
        out["wakes"] = dict(zip(PODS, res[len(names) :], strict=True))
        return out

    @invariant()
    def check(self) -> None:
        """After every step, on one snapshot of Redis."""
        s = self.read()
        if MIRROR:
            self.redis_agrees_with_model(s)
        self.units_and_lanes_are_consistent(s)
        self.work_conserving(s)

    def redis_agrees_with_model(self, s: dict[str, Any]) -> None:
        m = self.m
        lanes = [w.member for lane in sorted(m.lanes) for w in m.lanes[lane]]
        adm = {k: v for k, v in s["adm"].items() if k != "extra"}
        want_adm = {f"f:{lane}": pad20(f) for lane, f in m.fair.items()}
        want_adm |= {f"vt:{r}": str(v) for r, v in m.vt.items()}
        want_adm |= {f"rsv:{r}": member for r, member in m.rsv.items()}
        pairs = {
            "holders": (set(s["holders"]), set(m.holders)),
            "lanes": (s["lanes"], sorted(lanes)),  # each lane in exact seq order
            "waiters": (set(s["waiters"]), set(lanes)),  # no lost waiter
            "fair": (s["fair"], sorted("}".join(fair_key(ln, f)) for ln, f in m.fair.items())),
            "big": ({lane: int(v) for lane, v in s["big"]}, m.big),
            "adm": (adm, want_adm),
            "stats": (
                {k: int(v) for k, v in s["stats"].items()},
                {k: v for k, v in m.stats.items() if v},
            ),
            "evicted": (set(s["evicted"]), m.evicted),
            "wakes": (s["wakes"], {pod: m.wakes.get(pod, []) for pod in PODS}),
        }
        for name, (got, want) in pairs.items():
            assert got == want, f"{name}: redis {got} != model {want}"

    def units_and_lanes_are_consistent(self, s: dict[str, Any]) -> None:
        """The rules, read from Redis alone."""
        lim = self.m.limit()
        weights = [weight_of(h) for h in s["holders"]]
        units = sum(weights)
        assert units == len(weights) + int(s["adm"].get("extra", 0))
        if self.granted_now:
            assert units <= lim, "units held above the limit after a grant"
        lanes: dict[str, list[str]] = {}
        for member in s["lanes"]:
            lanes.setdefault(member_lane(member), []).append(member)
        fair = {f"{f.split('}')[2]}}}{f.split('}')[0]}": int(f.split("}")[1]) for f in s["fair"]}
        big = {lane: int(v) for lane, v in s["big"]}
        assert len(fair) == len(s["fair"])
        for lane, members in lanes.items():
            assert (lane in fair) != (lane in big), f"{lane} must be in exactly one of fair/big"
            if lane in big:
                assert big[lane] == weight_of(members[0])
        assert set(fair) | set(big) <= set(lanes), "an empty lane left in fair/big"
        tags = {k[2:]: int(v) for k, v in s["adm"].items() if k.startswith("f:")}
        assert tags == fair
        # nothing left of an empty lane or band: a virtual time only while its band has a lane
        # in fair, a reservation only for the head of a lane of its band in fair, no extra of 0
        for k, v in s["adm"].items():
            if k.startswith("vt:"):
                assert any(band(lane) == k[3:] for lane in fair), f"{k} of an idle band"
            elif k.startswith("rsv:"):
                lane = member_lane(v)
                assert band(lane) == k[4:] and lane in fair and lanes[lane][0] == v, f"{k}={v}"
            else:
                assert (k == "extra" and v != "0") or k.startswith("f:"), f"adm field {k}={v}"
        assert len(s["waiters"]) <= MAX_QUEUED
        per_tenant = Counter(lane_tenant(lane) for lane, ms in lanes.items() for _ in ms)
        assert max(per_tenant.values(), default=0) <= MAX_QUEUED_PER_TENANT
        # FIFO: no waiter is older than a waiter of its lane that was granted
        for h in s["holders"]:
            if h in self.members:
                lane, seq = member_lane(self.members[h]), int(self.members[h].split("}")[2])
                self.granted_seq[lane] = max(seq, self.granted_seq.get(lane, -1))
        for lane, members in lanes.items():
            head = int(members[0].split("}")[2])
            assert head > self.granted_seq.get(lane, -1), f"FIFO: {lane} granted past {head}"
        if self.default_only:
            assert set(lanes) <= {"}100"}

    def work_conserving(self, s: dict[str, Any]) -> None:
        """After a hand-off (after every step for default requests): the top band's heads that
        fit under the limit do not fit in the free units, or those units are reserved for a head
        of that band that does not. Read from Redis."""
        if not self.handed_off and not self.default_only:
            return
        if self.m.expired:
            return  # a dead entry holds its place until something reaps it
        lim = self.m.limit()
        free = lim - sum(weight_of(h) for h in s["holders"])
        heads: dict[str, str] = {}
        for member in s["lanes"]:
            heads.setdefault(member_lane(member), member)
        heads = {lane: h for lane, h in heads.items() if weight_of(h) <= lim}
        if not heads:
            return
        top = min(band(lane) for lane in heads)
        fitting = [h for lane, h in heads.items() if band(lane) == top and weight_of(h) <= free]
        if not fitting:
            return
        rsv = s["adm"].get(f"rsv:{top}")
        reserved = rsv in heads.values() and weight_of(rsv) > free
        assert reserved, f"idle units ({free} free) while {fitting} could be granted"

    def teardown(self) -> None:
        self.r.close()


class DefaultGateMachine(GateMachine):
    """Only default requests: the gate behaves as the plain FIFO semaphore it was."""

    default_only = True


# FLEETGATE_MODEL_EXAMPLES=3000 for a long hunt (the default run takes about 30 s)
EXAMPLES = int(os.environ.get("FLEETGATE_MODEL_EXAMPLES", "400"))
SETTINGS = settings(
    max_examples=EXAMPLES,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    # FLEETGATE_MODEL_SHRINK=0: report the first failure unshrunk (shrinking a long run can take
    # minutes, past the suite's per-test timeout)
    phases=[
        p for p in Phase if os.environ.get("FLEETGATE_MODEL_SHRINK") != "0" or p != Phase.shrink
    ],
)


# ~10 s alone, but twice past the suite's 120 s in full runs (the cause is not found yet: not the
# chaos tests before it, and 12,000 more examples found no discrepancy); a real failure still
# fails, with its example
@pytest.mark.timeout(600)
def test_random_transitions_match_the_model(rut: RedisUnderTest) -> None:
    run_state_machine_as_test(lambda: GateMachine(rut.url), settings=SETTINGS)


@pytest.mark.timeout(600)
def test_default_requests_keep_the_fifo_rules(rut: RedisUnderTest) -> None:
    run_state_machine_as_test(
        lambda: DefaultGateMachine(rut.url),
        settings=settings(SETTINGS, max_examples=max(1, EXAMPLES * 3 // 10)),
    )
