"""fleetgate client: fleet-wide permits for calls to model servers.

::

    from fleetgate.client import Fleet

    async with Fleet("redis://redis:6379/0") as fleet:
        gate = fleet.gate("bge-m3", floor=4)
        async with gate.permit(deadline=30.0) as lease:
            ...  # at most `limit` of these run at once across every pod
"""

from fleetgate.ask import Ask
from fleetgate.errors import (
    ConfigError,
    DeadlineExceeded,
    DeadlineUnreachable,
    FleetgateError,
    GateStateError,
    LeaseLost,
    LeaseRevoked,
    Overloaded,
    RedisUnavailable,
)

from ._fleet import Fleet
from ._gate import Gate
from ._lease import Lease
from ._map import DEFAULT_RETRY, FleetgateWarning, is_transient
from ._sync import SyncFleet, SyncGate
from ._utilization import GateUtilization
from .compat import (
    get_utilization,
    map_concurrent,
    map_concurrent_sync,
    reset_controllers,
    resolve_capacity,
)

__all__ = [
    "DEFAULT_RETRY",
    "Ask",
    "ConfigError",
    "DeadlineExceeded",
    "DeadlineUnreachable",
    "Fleet",
    "FleetgateError",
    "FleetgateWarning",
    "Gate",
    "GateStateError",
    "GateUtilization",
    "Lease",
    "LeaseLost",
    "LeaseRevoked",
    "Overloaded",
    "RedisUnavailable",
    "SyncFleet",
    "SyncGate",
    "get_utilization",
    "is_transient",
    "map_concurrent",
    "map_concurrent_sync",
    "reset_controllers",
    "resolve_capacity",
]
