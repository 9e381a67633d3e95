"""One source for a gate's settings, through the scripts on a real redis-server: once a gate has
a stored configuration (fg:{G}:cfg, published by the coordinator or registered by the first
client), every script reads it -- the arrival (acquire), the hand-offs inside release, cancel
and resize, the heartbeat and the snapshot alike. A caller's defaults never fill a field the
stored configuration lacks (the default of the field applies, as for a script that takes no
defaults); they count only for a gate with no configuration at all, where acquire (and a pod's
heartbeat) registers them.
"""

from __future__ import annotations

import json

import pytest
import redis

from fleetgate.admission import weighted_id
from fleetgate.settings import GateSettings

from .test_token_budget import GRANTED, LONG_MS, TokenGate

# the scripts against each server of the matrix (tests/_servers.py)
pytestmark = pytest.mark.servers


def _publish(g: TokenGate, cfg: dict[str, int | str]) -> None:
    """Store ``cfg`` as the coordinator's publish does (a value '' deletes the field)."""
    flat = [x for kv in cfg.items() for x in kv]
    assert g.call("publish", 1, LONG_MS, "", len(cfg), *flat)[0] == 1


def _inspect(g: TokenGate, *defaults: object) -> dict[str, object]:
    snap: dict[str, object] = json.loads(g.call("inspect", 0, *defaults))
    return snap


def test_arrival_and_hand_off_follow_the_stored_configuration_not_the_callers_defaults(
    r: redis.Redis,
) -> None:
    # the client's defaults carry a token budget of 100 ...
    g = TokenGate(r, floor=4, token_limit=100)
    # ... the configuration stored for the gate has none (the coordinator's config sets none)
    stored = GateSettings(floor=4, ceiling=64, max_queued=100, lease_ms=LONG_MS, waiter_ms=LONG_MS)
    _publish(g, stored.as_cfg())
    assert "token_limit" not in r.hgetall(g.keys.cfg)

    assert g.acquire(("p:0", 0), ("p:1", 60)) == [GRANTED, GRANTED]
    # 60 more tokens with 60 held: the arrival decides by the gate's budget ...
    arrival = g.acquire(("p:2", 60))
    # ... and so does the hand-off of a release (any waiter fits the units: 3 of 4)
    assert g.release("p:0") == 1
    after_release = g.held()[1:]
    # one answer: no budget is stored, so the arrival is granted at once, as a hand-off grants
    assert (arrival, after_release) == ([GRANTED], (2, 120))
    # the heartbeat and the snapshot report the budget in force: none
    assert g.heartbeat("pod", [("p:1t60", 0)]).token_limit is None
    assert "token_limit" not in _inspect(g, *g.defaults)


def test_a_budget_only_the_callers_defaults_have_is_never_enforced_by_anyone(
    r: redis.Redis,
) -> None:
    g = TokenGate(r, floor=4, token_limit=100, token_ceiling=100)
    _publish(g, GateSettings(floor=4, lease_ms=LONG_MS, waiter_ms=LONG_MS).as_cfg())
    # above the caller's token ceiling, but the stored configuration has none: not refused
    reply = g.call("acquire", *g.defaults, 0, 0, 0, weighted_id("p:1", 1, 150), LONG_MS, "")
    assert int(reply[5]) == GRANTED
    assert g.resize("p:1t150", 300)[0] == 1  # growing is not bounded either


def test_every_field_the_stored_configuration_lacks_takes_its_default_not_the_callers(
    r: redis.Redis,
) -> None:
    """A gate configured with the first schema's fields only (fleetgate 0.1, or by hand), and a
    caller whose defaults set every other field: the snapshot shows what the scripts apply --
    the same with the caller's defaults as without them."""
    g = TokenGate(r, floor=4, token_limit=100)
    r.hset(
        g.keys.cfg,
        mapping={"floor": 2, "ceiling": 8, "max_queued": 10, "lease_ms": 20_000, "waiter_ms": 900},
    )
    caller = GateSettings(
        floor=6,
        ceiling=32,
        max_queued=50,
        lease_ms=60_000,
        waiter_ms=3_000,
        max_queued_per_tenant=3,
        shed_below=5,
        token_limit=100,
        token_ceiling=200,
        deadline_admission=False,
        band_share={0: 0.5},
        tenant_weights={"a": 3},
    ).argv()
    with_defaults, without = _inspect(g, *caller), _inspect(g)
    shown = ("floor", "ceiling", "max_queued", "lease_ms", "waiter_ms", "max_queued_per_tenant",
             "shed_below", "token_limit", "token_ceiling", "deadline_admission", "band_share",
             "limit")  # fmt: skip
    assert {k: with_defaults.get(k) for k in shown} == {k: without.get(k) for k in shown}
    assert (without["floor"], without["max_queued_per_tenant"]) == (2, 10)
    assert (without["shed_below"], without["deadline_admission"]) == (0, True)
    # an acquire on it registers nothing and is answered by the stored TTLs
    reply = g.call("acquire", *caller, 0, 0, 0, "p:1", LONG_MS, "")
    assert (int(reply[1]), int(reply[2])) == (20_000, 900)
    assert r.hgetall(g.keys.cfg).get("token_limit") is None


def test_a_gate_without_configuration_registers_the_callers_defaults_for_every_script(
    r: redis.Redis,
) -> None:
    g = TokenGate(r, floor=4, token_limit=100)
    assert g.acquire(("p:0", 0), ("p:1", 60)) == [GRANTED, GRANTED]
    assert r.hget(g.keys.cfg, "token_limit") == "100"
    # now stored: the arrival parks 60 more and the release's hand-off waits for the tokens too
    assert g.acquire(("p:2", 60)) == [2]
    assert g.release("p:0") == 1
    assert g.held()[1:] == (1, 60) and g.waiting() == ["p:2t60"]
    assert g.release("p:1t60") == 1
    assert g.held()[1:] == (1, 60) and g.waiting() == []


def test_a_heartbeat_registers_the_pods_defaults_as_an_acquire_would(r: redis.Redis) -> None:
    """An idle pod's gate -- never called yet, or wiped by an empty restart -- gets its settings
    stored by the pod's heartbeat, exactly as its first acquire would store them (every field,
    the tenant weights too), so the snapshot and ``fleetgate status`` show them rather than the
    defaults of a gate nobody configured (limit 1). Over stored settings a heartbeat writes
    nothing; the coordinator's sweep (no pod, no defaults) registers nothing. Before: the
    heartbeat only read the defaults."""
    caller = GateSettings(
        floor=6,
        ceiling=32,
        max_queued=50,
        lease_ms=LONG_MS,
        waiter_ms=3_000,
        max_queued_per_tenant=3,
        shed_below=5,
        token_limit=100,
        token_ceiling=200,
        band_share={0: 0.5},
        revoke_after=2.0,
        tenant_weights={"a": 3},
    ).argv()
    beaten, acquired = TokenGate(r, floor=1, token_limit=0), TokenGate(r, floor=1, token_limit=0)
    beaten.defaults = acquired.defaults = list(caller)

    beaten.call("heartbeat", "", 1000, 0, 0)  # the coordinator's sweep
    assert not set(r.hgetall(beaten.keys.cfg)) - {"fence"}
    assert _inspect(beaten)["limit"] == 1  # nobody configured it: the defaults of a gate

    reply = beaten.heartbeat("pod", [])
    assert acquired.acquire(("p:0", 0)) == [GRANTED]
    stored = {k: v for k, v in r.hgetall(beaten.keys.cfg).items() if k != "fence"}
    assert stored == {k: v for k, v in r.hgetall(acquired.keys.cfg).items() if k != "fence"}
    assert stored["floor"] == "6" and stored["shed_below"] == "5"
    weights = [r.hgetall(g.keys.tenant_weights) for g in (beaten, acquired)]
    assert weights == [{"a": "3"}, {"a": "3"}]
    assert reply.limit == 6 and _inspect(beaten)["limit"] == 6  # seen without the defaults

    # stored settings win: another pod's heartbeat with other defaults writes nothing
    beaten.defaults = GateSettings(floor=9, ceiling=9).argv()
    beaten.heartbeat("other-pod", [])
    assert r.hget(beaten.keys.cfg, "floor") == "6" and r.hget(beaten.keys.cfg, "ceiling") == "32"
