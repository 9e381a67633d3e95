"""The gate scripts: one Redis Functions library built from ``fleetgate.lua``, replies typed.

Each state transition of a gate is one Lua file under ``lua/`` with a header stating its KEYS,
ARGV and reply. The shared library (``lua/lib_*.lua``, joined in the order :data:`LIB_PARTS`
declares: time, limit, reaping, hand-off) holds the rules they share, once.

The gate scripts are loaded as one Redis Functions library (:func:`gate_library`): the shared
library, ``heartbeat_lib.lua`` and every script wrapped as a function, loaded once per server by
``FUNCTION LOAD`` and called by ``FCALL``, so the library's ~45 closures are created once at load
instead of at every call (an EVALSHA of the shared library + a script re-ran its top level: 5 µs
of server time per call, docs/design.md). The library and its functions are named after a hash
of its source, so two fleetgate versions in one fleet (a rolling upgrade) never replace each
other's code. A call that finds its function missing (Redis restarted empty, a new Cluster
primary, ``FUNCTION FLUSH``) loads the library and is sent again, once.

:func:`script_source` still gives each script as one EVAL-able source (the shared library
prepended), for tests and benchmarks; the leader scripts stay plain EVALSHA scripts.

The modules, one job each: ``_library`` (sources, assembly, loading), ``_argv`` (every script's
ARGV), ``_replies`` (status codes, reply types, decoders), ``_calls`` (calls as values, for
batches), ``_gate_scripts`` (:class:`GateScripts`, the call surface), ``_leader``
(:class:`LeaderScripts`).
"""

from __future__ import annotations

from ._argv import (
    HEARTBEAT_UNITS_PER_CALL,
    IDS_PER_CALL,
    MAX_BATCH,
    AcquireRequest,
    HeartbeatRequest,
)
from ._calls import ScriptCall
from ._gate_scripts import GateScripts
from ._leader import LeaderScripts
from ._library import (
    FUNCTION_FLAGS,
    LEADER_SCRIPT_NAMES,
    LIB_PARTS,
    SCHEMA,
    SCRIPT_NAMES,
    GateLibrary,
    Loader,
    function_missing,
    gate_library,
    lib_source,
    script_source,
)
from ._replies import (
    GRANTED,
    IDLE,
    IN_USE,
    OVER_SHARE,
    PARKED,
    PRUNE_REFUSED,
    PRUNED,
    REJECTED,
    REJECTED_TENANT,
    RESIZE_LOST,
    RESIZE_REFUSED,
    RESIZE_TOO_MANY,
    RESIZED,
    SHED,
    TOO_HEAVY,
    TOO_LATE,
    TOO_MANY_TOKENS,
    AcquireReply,
    AdoptReply,
    HeartbeatReply,
    Holder,
    Lane,
    ResizeReply,
    Snapshot,
    Waiter,
)

__all__ = [
    "FUNCTION_FLAGS",
    "GRANTED",
    "HEARTBEAT_UNITS_PER_CALL",
    "IDLE",
    "IDS_PER_CALL",
    "IN_USE",
    "LEADER_SCRIPT_NAMES",
    "LIB_PARTS",
    "MAX_BATCH",
    "OVER_SHARE",
    "PARKED",
    "PRUNED",
    "PRUNE_REFUSED",
    "REJECTED",
    "REJECTED_TENANT",
    "RESIZED",
    "RESIZE_LOST",
    "RESIZE_REFUSED",
    "RESIZE_TOO_MANY",
    "SCHEMA",
    "SCRIPT_NAMES",
    "SHED",
    "TOO_HEAVY",
    "TOO_LATE",
    "TOO_MANY_TOKENS",
    "AcquireReply",
    "AcquireRequest",
    "AdoptReply",
    "GateLibrary",
    "GateScripts",
    "HeartbeatReply",
    "HeartbeatRequest",
    "Holder",
    "Lane",
    "LeaderScripts",
    "Loader",
    "ResizeReply",
    "ScriptCall",
    "Snapshot",
    "Waiter",
    "function_missing",
    "gate_library",
    "lib_source",
    "script_source",
]
