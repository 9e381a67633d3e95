"""The scripts (acquire, release, cancel, heartbeat) in plain Python, over the library model."""

from __future__ import annotations

from collections import Counter
from typing import Any

from ._model_library import (
    GRANTED,
    MAX_QUEUED,
    MAX_QUEUED_PER_TENANT,
    PARKED,
    REJECTED,
    REJECTED_TENANT,
    SHED,
    TOO_HEAVY,
    LibraryModel,
    Request,
    Waiter,
    band,
    lane_tenant,
    pad20,
)


class GateModel(LibraryModel):
    """The Lua library and the scripts in Python, on the same integers."""

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
