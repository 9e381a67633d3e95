"""What ``fleetgate proxy`` reports of each forwarded call with its permit's release: the
outcome (``ok``, ``overloaded``, ``timeout``, ``error``) in the gate's observed counters, a
latency for ``ok`` only, and the release even when the report fails."""

from __future__ import annotations

import httpx
import pytest
import redis

from fleetgate.keys import GateKeys
from fleetgate.observed import Reading
from fleetgate.tools.sim._server import Served

from ..conftest import RedisUnderTest
from ._proxy import serve_proxy, wait_idle, wait_until


def test_outcomes_land_in_the_gates_observed_counters(
    rut: RedisUnderTest, upstream: Served
) -> None:
    """Each forwarded call's outcome leaves with its permit's release (``lease.report``), as
    ``gate.map``'s do: a 200 counts ``ok`` with its latency, the upstream's own 429 counts
    ``overloaded`` and a 500 ``error``, neither with a latency."""

    def observed() -> Reading:
        with redis.Redis.from_url(rut.url) as r:
            return Reading.parse(r.hgetall(GateKeys.of(rut.prefix, "g").obs))

    with serve_proxy(rut, upstream) as url, httpx.Client(base_url=url, timeout=10) as http:
        for _ in range(3):
            assert http.post("/work?ms=40", content=b"{}").status_code == 200
        for _ in range(2):
            assert http.get("/status/429").status_code == 429
        assert http.get("/status/500").status_code == 500
        wait_until(lambda: observed().ok + observed().overloaded + observed().error == 6, 10)
    got = observed()
    assert (got.ok, got.overloaded, got.timeout, got.error) == (3, 2, 0, 1), got
    assert got.lat_n == 3 and 3 * 40_000 <= got.lat_us < 3 * 1_000_000, got
    wait_idle(rut.url, rut.prefix, "g")


async def test_a_latency_is_reported_for_ok_only() -> None:
    """The proxy's permit reports like ``gate.map``: the latency it measured for ``ok``, none
    for a failure (its time says nothing of the server's speed), and releases even when the
    report fails."""
    from fleetgate.proxy._exchange import Permit as _Permit

    class FakeLease:
        def __init__(self, fail: bool = False) -> None:
            self.reports: list[tuple[str, float | None]] = []
            self.released = 0
            self.fail = fail

        def report(self, outcome: str, latency: float | None = None) -> None:
            self.reports.append((outcome, latency))
            if self.fail:
                raise RuntimeError("report failed")

        async def release(self) -> None:
            self.released += 1

    seen = []
    for outcome in ("ok", "overloaded", "timeout", "error"):
        lease = FakeLease()
        permit = _Permit(lease)  # type: ignore[arg-type]
        await permit.release(outcome, 0.25)
        await permit.release(outcome, 0.25)  # once only
        assert lease.released == 1
        seen += lease.reports
    assert seen == [("ok", 0.25), ("overloaded", None), ("timeout", None), ("error", None)]
    lease = FakeLease(fail=True)
    with pytest.raises(RuntimeError):
        await _Permit(lease).release("ok", 0.1)  # type: ignore[arg-type]
    assert lease.released == 1
