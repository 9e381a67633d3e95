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
(weight 1, priority 0, no tenant), where a plain FIFO semaphore's rules (one lane, exact FIFO, no
idle unit while anyone waits) must still hold.

The pieces: ``_model_library.py`` (the library in Python: state, grant checks, reaping,
hand-off), ``_model_scripts.py`` (the scripts over it), ``_model_machine.py`` (the machines,
their rules and invariants).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from ..conftest import RedisUnderTest
from ._model_machine import DefaultGateMachine, GateMachine

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


# ~10 s alone; a loaded full run can take it past the suite's 120 s (why is not known: no
# discrepancy is behind it), so it gets 600 s; a real failure still fails, with its example
@pytest.mark.timeout(600)
def test_random_transitions_match_the_model(rut: RedisUnderTest) -> None:
    run_state_machine_as_test(lambda: GateMachine(rut.url), settings=SETTINGS)


@pytest.mark.timeout(600)
def test_default_requests_keep_the_fifo_rules(rut: RedisUnderTest) -> None:
    run_state_machine_as_test(
        lambda: DefaultGateMachine(rut.url),
        settings=settings(SETTINGS, max_examples=max(1, EXAMPLES * 3 // 10)),
    )
