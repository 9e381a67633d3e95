"""fleetgate client: fleet-wide permits for calls to model servers.

::

    from fleetgate.client import Fleet

    async with Fleet("redis://redis:6379/0") as fleet:
        gate = fleet.gate("bge-m3", floor=4)
        async with gate.permit(deadline=30.0) as lease:
            ...  # at most `limit` of these run at once across every pod
"""

from fleetgate.errors import (
    ConfigError,
    DeadlineExceeded,
    FleetgateError,
    LeaseLost,
    Overloaded,
    RedisUnavailable,
)

from ._fleet import Fleet, GateUtilization
from ._gate import Gate, Lease
from ._sync import SyncFleet, SyncGate

__all__ = [
    "ConfigError",
    "DeadlineExceeded",
    "Fleet",
    "FleetgateError",
    "Gate",
    "GateUtilization",
    "Lease",
    "LeaseLost",
    "Overloaded",
    "RedisUnavailable",
    "SyncFleet",
    "SyncGate",
]
