"""A wiped gate and the work that still runs: the recovery fence (``lua/lib_fence.lua`` gate_birth).

Limit 4; pods A and B (worker processes) each run 2 calls at a time at the simulator. Redis
loses every key while they run -- it is SIGKILLed and restarted empty, or FLUSHALL'd under
them -- and a third process C, which never used the gate, opens its ``Fleet`` the instant Redis
answers again and asks for 4 permits. Inside Redis the wiped gate looks new, so without a
fence C would be granted all 4 while A's and B's calls ran uncounted: 8 at the simulator (6 with
a pod whose probe was late). The first script that finds the state missing fences the gate
for one registration period (3 x heartbeat interval): no grant until the pods whose work the
lost state counted have counted it again (adopted after the fallback, or by their heartbeat).

Bound checked: from Redis answering again on, at most the limit runs at the simulator (no pod
is frozen past its lease TTL here, so the frozen-holder allowance is 0).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import redis

from fleetgate.tools.redisproc import RedisProcess

from ._harness import Control, Sim, Workers, figure, poll

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

LIMIT = 4
HB = 0.5  # heartbeat interval of every pod: the fence lasts 3 x 0.5 s
CALL_PASSAGES = 300  # 320 ms calls (20 ms + 1 ms per passage)


def _pool(url: str, sim: Sim, workers: Callable[..., Workers], gate: str) -> Workers:
    return workers(
        url=url, prefix="fg", gate=gate, limit=LIMIT, lease_ms=3000, waiter_ms=2000,
        sim=sim.url, passages=CALL_PASSAGES,
    )  # fmt: skip


def _errors(status: dict[str, str]) -> dict[str, int]:
    return {k: int(v) for k, v in status.items() if k.startswith(("err:", "http:"))}


def _answers(url: str) -> bool:
    try:
        with redis.Redis.from_url(url, socket_timeout=0.2, socket_connect_timeout=0.2) as r:
            return bool(r.ping())
    except redis.RedisError:
        return False


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["restart", "flushall", "late-probe"])
def test_a_fresh_pod_is_not_granted_the_work_a_wipe_forgot(
    kind: str,
    own_redis: RedisProcess,
    control: Control,
    sim: Sim,
    workers: Callable[..., Workers],
    record_property: Callable[[str, object], None],
) -> None:
    """A and B busy, the wipe (``kind``), C opens as Redis answers; peak from then on."""
    opened = f"{control.run}:open-c"
    pool = _pool(own_redis.url, sim, workers, f"wipe-{kind}")
    a, b = (pool.spawn(role="load", loops=2, hb=HB) for _ in range(2))
    c = pool.spawn(role="load", loops=LIMIT, hb=HB, open_key=opened)
    pool.wait_ready()
    poll(lambda: sim.running >= LIMIT, 10, 0.01, "A and B busy")
    time.sleep(2 * HB)  # A and B have counted their live peers (each other)
    if kind == "flushall":
        with redis.Redis.from_url(own_redis.url) as r:
            r.flushall()
        t_up = time.monotonic()
    else:
        own_redis.kill()
        pods = [a.pod, b.pod]
        poll(
            lambda: all(s.get("fallback") == "1" for s in control.statuses(pods).values()),
            10, 0.02, "A and B in fallback",
        )  # fmt: skip
        if kind == "late-probe":
            a.pause()  # A will miss the heal: its probe runs late
        own_redis.start()
        poll(lambda: _answers(own_redis.url), 10, 0.005, "Redis answers")
        t_up = time.monotonic()
    control.r.set(opened, 1)  # C opens its fleet with fresh connections, asks for 4
    if kind == "late-probe":
        time.sleep(1.0)
        a.resume()
    time.sleep(4.0)
    peak = sim.max_between(t_up, time.monotonic())
    finals = {w.pod: control.statuses([w.pod])[w.pod] for w in (a, b, c)}
    pool.stop_all()
    figure(record_property, f"wipe.{kind}.max_running_after_redis_answered", peak)
    figure(record_property, f"wipe.{kind}.c_fleet_grants", finals[c.pod].get("fleet_grants"))
    assert peak <= LIMIT, (peak, finals)
    assert int(finals[c.pod].get("fleet_grants", 0)) > 0, finals  # C was served in the end
    assert all(not _errors(s) for s in finals.values()), finals
