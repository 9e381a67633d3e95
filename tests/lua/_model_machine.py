"""The state machine that drives the real scripts and the model in lockstep, and checks the
rules against Redis after every step (``test_transitions_model.py`` runs it)."""

from __future__ import annotations

import itertools
import uuid
from collections import Counter
from typing import Any

import redis
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from fleetgate.admission import lane_class, weighted_id
from fleetgate.keys import GateKeys
from fleetgate.scripts import SCRIPT_NAMES, script_source

from ._model_library import (
    CEILING,
    CEILINGS,
    FLOOR,
    LONG_MS,
    MAX_QUEUED,
    MAX_QUEUED_PER_TENANT,
    MIRROR,
    PARKED,
    PODS,
    PRIORITIES,
    SEQ0,
    TENANT_WEIGHTS,
    TENANTS,
    WEIGHTS,
    Request,
    band,
    fair_key,
    held_field,
    lane_tenant,
    member_lane,
    pad20,
    pod_of,
    weight_of,
)
from ._model_scripts import GateModel


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
        no_budget = ["", ""]  # token_limit, token_ceiling
        settings = [FLOOR, CEILING, MAX_QUEUED, LONG_MS, LONG_MS, MAX_QUEUED_PER_TENANT, 0]
        # deadline admission off (FIFO waits), no band shares
        return [*settings, *no_budget, 0, "", "", "a}2"]

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
                "deadline_admission": 0,  # FIFO waits: this model mirrors no drain
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
            reqs.append(Request(weighted_id(base, w, 0, prio), prio, tenant))
        return reqs

    @rule(pods=st.lists(st.sampled_from(PODS), min_size=1, max_size=3), data=st.data())
    def acquire(self, pods: list[str], data: st.DataObject) -> None:
        """A batch: some leases released (maybe none, maybe unknown ids), then new requests."""
        choices = [*self.m.holders, "nobody:0"]
        releases = data.draw(st.lists(st.sampled_from(choices), max_size=2), label="releases")
        reqs = self.requests(data, pods)
        triples = [a for q in reqs for a in (q.id, LONG_MS, lane_class(q.priority, q.tenant))]
        reply = self.call("acquire", *self.defaults(), 0, len(releases), *releases, 0, *triples)
        got = [tuple(int(x) for x in reply[i : i + 3]) for i in range(5, len(reply), 5)]
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
        adm = {k: v for k, v in s["adm"].items() if k not in ("extra", "held")}
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
        assert s["adm"].get("held") == held_field(s["holders"]), "held counts != the holders'"
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
                ok = k in ("extra", "held") and v != "0"
                assert ok or k.startswith("f:"), f"adm field {k}={v}"
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
    """Only default requests: the gate behaves as a plain FIFO semaphore."""

    default_only = True
