"""The gate scripts' sources, assembled from ``fleetgate.lua``, and their loading into Redis.

One Redis Functions library (:func:`gate_library`) holds the shared library (the
:data:`LIB_PARTS`), ``heartbeat_lib.lua`` and every gate script wrapped as a function. A
:class:`Loader` loads it on every primary behind a client; a :class:`GateFunction` calls one of
its functions by ``FCALL``, loading the library again when the server does not have it.
:func:`script_source` gives each script as one EVAL-able source instead (tests, benchmarks, the
leader scripts).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio.client import Pipeline
from redis.asyncio.cluster import ClusterPipeline
from redis.exceptions import ResponseError

from fleetgate._redis import RedisMode

SCRIPT_NAMES = (
    "acquire",
    "release",
    "cancel",
    "heartbeat",
    "heartbeat_many",
    "set_target",
    "inspect",
    "adopt",
    "prune",
    "publish",
    "resize",
)
# Scripts that also get heartbeat_lib.lua (the heartbeat transition of one gate).
_HEARTBEAT_SCRIPTS = ("heartbeat", "heartbeat_many")
# Scripts on the fleet keys (not a gate's): self-contained, without the shared library.
LEADER_SCRIPT_NAMES = ("leader_renew", "leader_release")
# The gate state's schema these scripts implement (lua/lib_cfg.lua SCHEMA).
SCHEMA = 2

#: The shared library's parts (``lua/lib_*.lua``), in the order they are joined: each uses only
#: what the parts before it define (their locals are one chunk's), ``lib_gate`` first (the keys).
LIB_PARTS = (
    "lib_gate",
    "lib_cfg",
    "lib_fence",
    "lib_order",
    "lib_units",
    "lib_share",
    "lib_lanes",
    "lib_drain",
    "lib_reap",
    "lib_wakes",
    "lib_tokens",
    "lib_revoke",
    "lib_handoff",
)

# Function flags (FUNCTION LOAD): a function without flags is refused before it starts while
# Redis is out of memory (maxmemory reached). Out of memory is one outage: every script that
# writes is refused -- acquire, adopt, the heartbeats, and release and cancel too -- so every pod
# falls back at its next call or renewal and no pod is granted anything meanwhile. A pod that
# only renewed stayed in fleet mode while a pod whose acquire was refused served under its
# fallback, and was handed the units that pod's releases freed: 6 running under a limit of 4,
# bound 4 (tests/chaos/test_refusals.py::test_out_of_memory_is_one_outage). Releases and
# cancels that ran under OOM still handed units to waiters of pods not yet fallen back (the
# soak with --refusals: 10 running, allowance 8): refused now, they are retried until Redis
# serves writes (their units stay held meanwhile: under the limit, never over). inspect only
# reads (it writes only when converting a schema-1 gate, which is small): allow-oom, so
# ``fleetgate status`` works during the incident.
FUNCTION_FLAGS: dict[str, tuple[str, ...]] = {
    "inspect": ("allow-oom",),
}
# The shared library's top level points the gate keys at KEYS[1] (the EVAL form); each library
# function does it at its start instead (a library's top level runs once, at load, without KEYS).
_USE_GATE = "use_gate(KEYS[1])\n"
_HASH = "@HASH@"


def _read(name: str) -> str:
    return importlib.resources.files("fleetgate.lua").joinpath(f"{name}.lua").read_text("utf-8")


@functools.cache
def lib_source() -> str:
    """The shared library: the :data:`LIB_PARTS` joined in order, as EVAL runs it (its top level
    points the gate keys at ``KEYS[1]``)."""
    return "\n".join(_read(part) for part in LIB_PARTS)


@functools.cache
def script_source(name: str) -> str:
    """The full source of script ``name``: the shared library followed by the script."""
    if name not in SCRIPT_NAMES + LEADER_SCRIPT_NAMES:
        raise ValueError(f"unknown script {name!r}")
    body = _read(name)
    if name in LEADER_SCRIPT_NAMES:
        return body
    lib = lib_source()
    if name in _HEARTBEAT_SCRIPTS:
        lib += "\n" + _read("heartbeat_lib")
    return f"{lib}\n{body}"


@dataclass(frozen=True)
class GateLibrary:
    """The gate scripts as one Redis Functions library (see :mod:`fleetgate.scripts`)."""

    name: str  # fleetgate_<12 hex of the sha1 of the source>
    source: str  # FUNCTION LOAD's argument
    functions: Mapping[str, str]  # script name -> function name


@functools.cache
def gate_library() -> GateLibrary:
    """The library: the shared library and ``heartbeat_lib.lua`` once, then each gate script as
    ``local function <name>_body(KEYS, ARGV)`` (which first points the gate keys at KEYS[1]),
    registered as ``fg_<hash>_<name>`` with its :data:`FUNCTION_FLAGS`. The hash is the first
    12 hex digits of the sha1 of the source (with the hash left out)."""
    lib = lib_source()
    if lib.count(_USE_GATE) != 1:
        raise RuntimeError("the shared library: expected one top-level use_gate(KEYS[1])")
    parts = [f"#!lua name=fleetgate_{_HASH}", lib.replace(_USE_GATE, "", 1), _read("heartbeat_lib")]
    for name in SCRIPT_NAMES:
        body = _read(name)
        parts.append(f"local function {name}_body(KEYS, ARGV)\nuse_gate(KEYS[1])\n{body}\nend")
    for name in SCRIPT_NAMES:
        flags = ", ".join(f"'{f}'" for f in FUNCTION_FLAGS.get(name, ()))
        parts.append(
            f"redis.register_function{{function_name = 'fg_{_HASH}_{name}', "
            f"callback = {name}_body, flags = {{{flags}}}}}"
        )
    template = "\n".join(parts) + "\n"
    digest = hashlib.sha1(template.encode()).hexdigest()[:12]
    return GateLibrary(
        name=f"fleetgate_{digest}",
        source=template.replace(_HASH, digest),
        functions={name: f"fg_{digest}_{name}" for name in SCRIPT_NAMES},
    )


def function_missing(reply: object) -> bool:
    """Whether ``reply`` is the error of an FCALL whose function the server does not have."""
    return isinstance(reply, ResponseError) and "Function not found" in str(reply)


class Loader:
    """Loads :func:`gate_library` on every primary behind one client: before its first call,
    and again when a call finds its function missing."""

    __slots__ = ("library", "loaded", "redis")

    def __init__(self, redis: RedisMode) -> None:
        self.redis = redis
        self.library = gate_library()
        self.loaded = False

    async def ensure(self) -> None:
        """Load the library unless this loader has already."""
        if not self.loaded:
            await self.load()

    async def load(self) -> None:
        """FUNCTION LOAD (no REPLACE: a library of this name holds this very code) on each
        primary; "already exists" is success. A refusal (OOM, NOPERM, ...) raises."""
        client, source = self.redis.client, self.library.source

        async def load_one(**target: Any) -> None:
            try:
                await client.execute_command("FUNCTION LOAD", source, **target)
            except ResponseError as exc:
                if "already exists" not in str(exc):
                    raise

        await self.redis.each_primary(load_one)
        self.loaded = True


class GateFunction:
    """One gate script as a library function, called like a redis-py ``Script``:
    ``await f(keys=..., args=..., client=...)``; on a pipeline that only queues the FCALL (the
    caller retries a missing function: :meth:`GateScripts._redis_batch`)."""

    __slots__ = ("loader", "name")

    def __init__(self, loader: Loader, name: str) -> None:
        self.loader = loader
        self.name = name

    async def __call__(self, keys: Sequence[str], args: Sequence[Any], client: Any) -> Any:
        await self.loader.ensure()
        if isinstance(client, (Pipeline, ClusterPipeline)):
            return client.fcall(self.name, len(keys), *keys, *args)
        try:
            return await client.fcall(self.name, len(keys), *keys, *args)
        except ResponseError as exc:
            if not function_missing(exc):
                raise
        await self.loader.load()
        return await client.fcall(self.name, len(keys), *keys, *args)
