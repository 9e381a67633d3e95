"""The Lua library (lua/lib_*.lua) in plain Python, on the same integers: the gate's state, the
rules every grant must keep, reaping, hand-off, refusals and settling.

:class:`LibraryModel` is the half of the model that the scripts share;
``_model_scripts.GateModel`` adds the scripts on top of it, and ``_model_machine`` runs both
in lockstep with the real scripts (``test_transitions_model.py``).
"""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

from fleetgate import admission

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


def priority_of(lease_id: str) -> int:
    """The priority a lease id's band tag says ('b<100 - priority>'; none: 0)."""
    m = re.search(r":[0-9]+b([0-9]{3})", lease_id)
    return 100 - int(m.group(1)) if m else 0


def held_field(holders: list[str]) -> str | None:
    """What adm 'held' says of these holders: '<R>=<units>,...' for each band other than 100
    (its tag 'b<R>' in the id), sorted; None when there is none (lib_units.lua adm_bands)."""
    held: Counter[str] = Counter()
    for lid in holders:
        m = re.search(r":[0-9]+b([0-9]{3})", lid)
        if m:
            held[m.group(1)] += admission.weight_of(lid)
    return ",".join(f"{b}={u}" for b, u in sorted(held.items()) if u) or None


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


class LibraryModel:
    """The gate's state and the Lua library's functions. The strict-band, FIFO and token rules
    are asserted at each grant (independently of how the grant was chosen)."""

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
