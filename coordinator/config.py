"""The coordinator's configuration: one TOML file, decoded into frozen msgspec structs.

Shape (see ``example.toml`` next to this module for every key with its default)::

    [redis]        url, prefix
    [coordinator]  poll_interval, poll_jitter, leader_ttl, metrics_listen, target_ttl_polls,
                   scrape_timeout, max_body_bytes, adaptive, prune_idle_after
    [[gates]]      name, floor, ceiling, max_queued, lease_ms, waiter_ms,
                   max_queued_per_tenant, shed_below, tenant_weights (a table name -> int),
                   base_url | metrics_url (a string or a list, one per replica), model_name, server,
                   signal

``signal`` says what drives a gate's target: ``metrics`` (the AIMD controller on the server's
gauges: needs ``base_url`` or ``metrics_url``), ``latency`` (the latency-gradient controller on
what the callers report: ``lease.report``, ``gate.map``; docs/aimd.md), ``fixed`` (never adapted:
the limit is the ``floor``), or ``auto`` (default): ``metrics`` with a metrics source, else
``latency``. A latency gate that no caller reports for stays at its ``floor``, as a fixed gate;
its floor must be safe, because the cuts stop there. ``model_name`` filters the metrics by their
``model_name`` label; unset means the gate's own name when the endpoint exposes that label value,
else "every model on that endpoint" (logged once), because the served model name often differs
from the gate name and most servers serve one model. ``server`` names the server kind (default
``auto``: detected from the exposition); see ``docs/servers.md``.

Environment overrides, applied on top of the file (an empty value counts as unset):

=============================  ===========================================================
``FLEETGATE_REDIS_URL``        ``redis.url``
``FLEETGATE_PREFIX``           ``redis.prefix``
``FLEETGATE_POLL_INTERVAL``    ``coordinator.poll_interval`` (seconds)
``FLEETGATE_METRICS_LISTEN``   ``coordinator.metrics_listen`` (``host:port``)
``FLEETGATE_ADAPTIVE``         ``coordinator.adaptive`` (``0/false/no/off`` or ``1/true/yes/on``)
``KG_ADAPTIVE_CONCURRENCY``    the seed's switch; ``0`` turns adaptation off (off always wins)
``MODEL_MAX_CONCURRENCY``      default ``ceiling`` of gates that set none (default 512; a gate's
                               default ceiling is never below its floor)
=============================  ===========================================================

With adaptation off the coordinator takes exactly the static path: no targets are published and
every gate's limit is its floor. Every problem is a :class:`~fleetgate.errors.ConfigError` with
one line naming the field (or the environment variable) and the problem, e.g.
``gates[2].floor: expected int >= 1, got 0``.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import Meta

from fleetgate._redis import validate_redis_url
from fleetgate.admission import TenantWeights, validate_tenant_weights
from fleetgate.errors import ConfigError
from fleetgate.keys import validate_gate_name, validate_prefix
from fleetgate.settings import (
    DEFAULT_CEILING,
    Ceiling,
    Floor,
    GateSettings,
    LeaseMs,
    MaxQueued,
    MaxQueuedPerTenant,
    ShedBelow,
    WaiterMs,
    check_ceiling,
)

from .scrape.adapters import ADAPTERS, AUTO, validate_server
from .scrape.signals import derive_metrics_url, validate_metrics_url

__all__ = [
    "DEFAULT_CEILING",
    "Config",
    "CoordinatorSettings",
    "GateConfig",
    "RedisSettings",
    "load_config",
]

_DEFAULTS = GateSettings()
#: the values of a gate's ``signal``
SIGNALS = ("auto", "metrics", "latency", "fixed")
DEFAULT_POLL_INTERVAL = 2.0
#: the scrape timeout when the poll interval allows it (a healthy /metrics answers in ms)
DEFAULT_SCRAPE_TIMEOUT = 2.0
# The default of ``scrape_timeout``, meaning "unset": a decoded value must be > 0, so no file or
# environment can produce it; ``__post_init__`` replaces it with min(2 s, poll_interval).
_SCRAPE_TIMEOUT_UNSET = 0.0

_T = TypeVar("_T")


def _check(field: str, validate: Callable[[_T], object], value: _T) -> None:
    """Run ``validate(value)``; re-raise its ConfigError as ``field: problem`` for ``_explain``."""
    try:
        validate(value)
    except ConfigError as exc:
        raise ConfigError(f"{field}: {exc}") from None


def _parse_listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"expected 'host:port' with a port 0-65535, got {value!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


class RedisSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where the gates live: the Redis URL and the key prefix."""

    url: str = "redis://127.0.0.1:6379/0"
    prefix: str = "fg"

    def __post_init__(self) -> None:
        # Scheme, port and query parameters (a TLS option misspelt is caught here, not at the
        # first command); messages never echo the password. See docs/security.md for TLS.
        _check("url", validate_redis_url, self.url)
        _check("prefix", validate_prefix, self.prefix)


class CoordinatorSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How the coordinator polls, leads and publishes. Times are in seconds (at most an hour;
    ``prune_idle_after`` at most 30 days)."""

    #: 2 s: a ramp from the floor takes ~6 polls, so 12 s instead of the seed's 72 s; one poll of
    #: 1,000 gates costs ~0.8 s of coordinator CPU (docs/aimd.md, "Why these constants")
    poll_interval: Annotated[float, Meta(gt=0, le=3600)] = DEFAULT_POLL_INTERVAL
    #: each poll waits poll_interval * (1 ± poll_jitter), so standbys and replicas do not align
    poll_jitter: Annotated[float, Meta(ge=0, le=0.5)] = 0.1
    #: the leader's lease (whole milliseconds in Redis: at least 0.01 s)
    leader_ttl: Annotated[float, Meta(ge=0.01, le=3600)] = 10.0
    metrics_listen: str = "127.0.0.1:9464"
    #: a published target expires after this many poll intervals without a fresh poll, plus one
    #: leader takeover (``target_ttl``): a dead leader's targets outlive its successor's election
    target_ttl_polls: Annotated[int, Meta(ge=1)] = 3
    #: total seconds per /metrics scrape; unset = min(2 s, poll_interval), so it always fits the
    #: poll (an explicit value above poll_interval is refused)
    scrape_timeout: Annotated[float, Meta(gt=0, le=600)] = _SCRAPE_TIMEOUT_UNSET
    max_body_bytes: Annotated[int, Meta(ge=1024)] = 2 * 1024 * 1024
    adaptive: bool = True
    #: seconds a registered gate that is not in this config must stay idle (no holders, waiters,
    #: live pods nor acquires) before it is deleted and dropped from the registry; 0 = never
    prune_idle_after: Annotated[float, Meta(ge=0, le=30 * 86400)] = 3600.0

    def __post_init__(self) -> None:
        _check("metrics_listen", _parse_listen, self.metrics_listen)
        if self.scrape_timeout == _SCRAPE_TIMEOUT_UNSET:  # unset (0 itself is refused on decode)
            timeout = min(DEFAULT_SCRAPE_TIMEOUT, self.poll_interval)
            msgspec.structs.force_setattr(self, "scrape_timeout", timeout)
        if self.scrape_timeout > self.poll_interval:
            raise ConfigError(
                f"scrape_timeout: must be <= poll_interval ({self.poll_interval:g} s), "
                f"got {self.scrape_timeout:g}"
            )

    @property
    def metrics_address(self) -> tuple[str, int]:
        """``metrics_listen`` as ``(host, port)``; IPv6 brackets removed."""
        return _parse_listen(self.metrics_listen)

    @property
    def campaign_interval(self) -> float:
        """Seconds between a standby's tries of the leader lease (at most 1 s, ttl/3 below)."""
        return min(1.0, self.leader_ttl / 3)

    @property
    def takeover(self) -> float:
        """The longest a SIGKILLed leader's gates go without a new target, beyond the poll gap:
        its lease lapses at most ``leader_ttl`` after its death (it renewed at most then), a
        standby tries it ``campaign_interval`` later at most, and its first poll (at once on
        winning) publishes after one scrape, at most ``scrape_timeout``."""
        return self.leader_ttl + self.campaign_interval + self.scrape_timeout

    @property
    def target_ttl(self) -> float:
        """Lifetime of a published target in seconds: ``target_ttl_polls`` poll intervals plus
        one :attr:`takeover` (6 + 13 = 19 s with the defaults).

        Why the takeover is in it: a new leader resumes a gate's stored controller state only
        while the gate's target is live (one that ran out restarts from the floor: every
        coordinator was gone). With 3 polls alone (6 s) every target ran out during a takeover
        (~10 s), so a SIGKILLed leader restarted every adaptive gate from its floor (64 -> 8 in
        tests/test_leader_failover.py) and the pods ran at the floor meanwhile. With the
        takeover added, targets outlive it by construction for every accepted configuration,
        and a real blackout (no coordinator left) still decays to the floor, one takeover later.
        A live leader that is blind to a server does not wait for that: its controller
        publishes the floor after ``target_ttl_polls`` unknown polls (docs/aimd.md)."""
        return self.target_ttl_polls * self.poll_interval + self.takeover


class GateConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One gate. ``floor`` is its static limit; ``ceiling`` bounds the adaptive target."""

    name: str
    # The settings' types, bounds and defaults are fleetgate.settings.GateSettings'; only the
    # floor is required here.
    floor: Floor
    ceiling: Ceiling = DEFAULT_CEILING
    max_queued: MaxQueued = _DEFAULTS.max_queued
    lease_ms: LeaseMs = _DEFAULTS.lease_ms
    waiter_ms: WaiterMs = _DEFAULTS.waiter_ms
    #: one tenant's bound of waiters (all bands); unset = the same as max_queued
    max_queued_per_tenant: MaxQueuedPerTenant | None = None
    #: priorities below it never park (granted at once or Overloaded)
    shed_below: ShedBelow = _DEFAULTS.shed_below
    #: ``[gates.tenant_weights]``: tenant name -> share weight (1..1000; unlisted tenants weigh
    #: 1); held as a hashable :class:`~fleetgate.admission.TenantWeights` once decoded
    tenant_weights: Mapping[str, int] = msgspec.field(default_factory=TenantWeights)
    base_url: str | None = None
    metrics_url: str | tuple[str, ...] | None = None
    model_name: str | None = None
    #: the model server's kind (``vllm``, ``sglang``, ``tgi``, ``tei``, ``llamacpp``, ``trtllm``,
    #: ``nim``) or ``auto``: detected from the exposition at each kind's metrics path
    server: str = AUTO
    #: what drives the target: ``auto`` | ``metrics`` | ``latency`` | ``fixed`` (module doc)
    signal: str = "auto"

    def __post_init__(self) -> None:
        _check("name", validate_gate_name, self.name)
        check_ceiling(self.floor, self.ceiling)
        # The errors name the entry: tenant_weights['a b{']: tenant 'a b{' contains '{': ...
        msgspec.structs.force_setattr(
            self, "tenant_weights", validate_tenant_weights(self.tenant_weights)
        )
        if self.base_url is not None and self.metrics_url is not None:
            raise ConfigError("metrics_url: set base_url or metrics_url, not both")
        if self.base_url is not None:
            _check("base_url", derive_metrics_url, self.base_url)
        if isinstance(self.metrics_url, str):
            _check("metrics_url", validate_metrics_url, self.metrics_url)
        elif self.metrics_url is not None:
            if not self.metrics_url:
                raise ConfigError("metrics_url: the list of replica URLs is empty")
            for i, url in enumerate(self.metrics_url):
                _check(f"metrics_url[{i}]", validate_metrics_url, url)
            if len(set(self.metrics_url)) != len(self.metrics_url):
                raise ConfigError("metrics_url: the same URL is listed twice")
        if self.model_name is not None and not self.model_name:
            raise ConfigError("model_name: must not be empty (leave it out to match every model)")
        _check("server", validate_server, self.server)
        if self.signal not in SIGNALS:
            raise ConfigError(f"signal: expected one of {', '.join(SIGNALS)}, got {self.signal!r}")
        if self.signal == "metrics" and not self.has_metrics:
            raise ConfigError("signal: 'metrics' needs base_url or metrics_url")
        if self.signal in ("latency", "fixed") and self.has_metrics:
            raise ConfigError(
                f"signal: {self.signal!r} reads no metrics; remove base_url/metrics_url, or use "
                "signal = 'auto' (metrics, with overload cuts from what the callers report)"
            )

    @property
    def settings(self) -> GateSettings:
        """The gate's settings, as the scripts take them."""
        return GateSettings(
            self.floor,
            self.ceiling,
            self.max_queued,
            self.lease_ms,
            self.waiter_ms,
            self.max_queued_per_tenant,
            self.shed_below,
            self.tenant_weights,
        )

    @property
    def metrics_urls(self) -> tuple[str, ...]:
        """The metrics URLs to scrape (one per replica); empty for a fixed gate.

        From ``base_url`` the path is the named server kind's (``/v1/metrics`` for NIM, ...); with
        ``server = "auto"`` it is ``/metrics``, the first path detection probes.
        """
        if self.base_url is not None:
            path = ADAPTERS[self.server].metrics_path if self.server in ADAPTERS else "/metrics"
            return (derive_metrics_url(self.base_url, path),)
        if isinstance(self.metrics_url, str):
            return (self.metrics_url,)
        return self.metrics_url or ()

    @property
    def latency_driven(self) -> bool:
        """True when the client-observed latency drives the gate (``signal``)."""
        return self.signal == "latency" or (self.signal == "auto" and not self.has_metrics)

    @property
    def has_metrics(self) -> bool:
        """True when the gate has a metrics source, i.e. can be adaptive."""
        return self.base_url is not None or self.metrics_url is not None


class Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The whole coordinator configuration. Build it with :func:`load_config`."""

    redis: RedisSettings = msgspec.field(default_factory=RedisSettings)
    coordinator: CoordinatorSettings = msgspec.field(default_factory=CoordinatorSettings)
    gates: tuple[GateConfig, ...] = ()

    def __post_init__(self) -> None:
        first: dict[str, int] = {}
        for i, gate in enumerate(self.gates):
            if gate.name in first:
                raise ConfigError(
                    f"gates[{i}].name: duplicate gate name {gate.name!r} "
                    f"(first defined at gates[{first[gate.name]}])"
                )
            first[gate.name] = i

    def gate(self, name: str) -> GateConfig:
        """The gate called ``name``; KeyError if there is none."""
        for gate in self.gates:
            if gate.name == name:
                return gate
        raise KeyError(name)

    def is_adaptive(self, gate: GateConfig) -> bool:
        """True when the coordinator adapts ``gate``: adaptation on and a metrics source set."""
        return self.coordinator.adaptive and gate.has_metrics

    @classmethod
    def from_toml_text(
        cls, text: str | bytes, *, env: Mapping[str, str] | None = None, source: str = "<config>"
    ) -> Config:
        """Decode TOML ``text``, apply ``env`` overrides (None = ``os.environ``), validate."""
        try:
            raw = msgspec.toml.decode(text)
        except msgspec.DecodeError as exc:
            raise ConfigError(_one_line(f"{source}: invalid TOML: {exc}")) from None
        return cls.from_mapping(raw, env=env)

    @classmethod
    def from_mapping(
        cls, raw: Mapping[str, Any], *, env: Mapping[str, str] | None = None
    ) -> Config:
        """Validate a decoded mapping (TOML's shape) after applying ``env`` overrides."""
        data: dict[str, Any] = _deep_copy(dict(raw))
        injected = _apply_env(data, os.environ if env is None else env)
        try:
            return msgspec.convert(data, type=cls)
        except msgspec.ValidationError as exc:
            raise ConfigError(_explain(str(exc), data, injected)) from None


def load_config(path: str | os.PathLike[str], env: Mapping[str, str] = os.environ) -> Config:
    """Read and validate the TOML file at ``path``; see the module docstring for ``env``."""
    try:
        text = Path(path).read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{os.fspath(path)}: config file not found") from None
    except OSError as exc:
        raise ConfigError(f"{os.fspath(path)}: cannot read config file: {exc.strerror}") from None
    return Config.from_toml_text(text, env=env, source=os.fspath(path))


# ------------------------------------------------------------------------- env and error text

_OFF = frozenset({"0", "false", "no", "off"})
_ON = frozenset({"1", "true", "yes", "on"})


def _deep_copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value


def _env_flag(env: Mapping[str, str], var: str) -> bool | None:
    value = env.get(var, "").strip().lower()
    if not value:
        return None
    if value in _OFF:
        return False
    if value in _ON:
        return True
    raise ConfigError(f"{var}: expected 0/1, true/false, yes/no or on/off, got {env[var]!r}")


def _section(data: dict[str, Any], name: str) -> dict[str, Any] | None:
    section = data.setdefault(name, {})
    return section if isinstance(section, dict) else None  # a non-table fails validation later


def _apply_env(data: dict[str, Any], env: Mapping[str, str]) -> dict[str, str]:
    """Write env overrides into ``data``; return {display path: variable} of what was written."""
    injected: dict[str, str] = {}

    def put(section: str, key: str, var: str, value: object) -> None:
        table = _section(data, section)
        if table is not None:
            table[key] = value
            injected[f"{section}.{key}"] = var

    for var, section, key in (
        ("FLEETGATE_REDIS_URL", "redis", "url"),
        ("FLEETGATE_PREFIX", "redis", "prefix"),
        ("FLEETGATE_METRICS_LISTEN", "coordinator", "metrics_listen"),
    ):
        if env.get(var):
            put(section, key, var, env[var])
    if env.get("FLEETGATE_POLL_INTERVAL"):
        text = env["FLEETGATE_POLL_INTERVAL"]
        try:
            seconds = float(text)
        except ValueError:
            raise ConfigError(f"FLEETGATE_POLL_INTERVAL: expected seconds, got {text!r}") from None
        put("coordinator", "poll_interval", "FLEETGATE_POLL_INTERVAL", seconds)
    flags = [_env_flag(env, "FLEETGATE_ADAPTIVE"), _env_flag(env, "KG_ADAPTIVE_CONCURRENCY")]
    if False in flags:
        put("coordinator", "adaptive", "FLEETGATE_ADAPTIVE/KG_ADAPTIVE_CONCURRENCY", False)
    elif flags[0]:
        put("coordinator", "adaptive", "FLEETGATE_ADAPTIVE", True)

    default_ceiling = DEFAULT_CEILING
    if env.get("MODEL_MAX_CONCURRENCY"):
        text = env["MODEL_MAX_CONCURRENCY"].strip()
        # isascii: str.isdigit() is also true of '²' and other digits int() refuses.
        if not (text.isascii() and text.isdigit()) or int(text) < 1:
            raise ConfigError(f"MODEL_MAX_CONCURRENCY: expected an int >= 1, got {text!r}")
        default_ceiling = int(text)
    gates = data.get("gates")
    if isinstance(gates, list):
        for i, gate in enumerate(gates):
            if isinstance(gate, dict) and "ceiling" not in gate:
                floor = gate.get("floor")
                if isinstance(floor, int) and not isinstance(floor, bool):
                    gate["ceiling"] = max(floor, default_ceiling)
                else:
                    gate["ceiling"] = default_ceiling
                injected[f"gates[{i}].ceiling"] = "MODEL_MAX_CONCURRENCY"
    return injected


_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_STEP = re.compile(r"\.([^.\[]+)|\[(\d+)\]")
# A field, optionally subscripted by an index or a quoted key: floor, metrics_url[1],
# tenant_weights['a b{'] (a repr: quotes inside are escaped or of the other kind).
_FIELD_PREFIX = re.compile(
    r"^([A-Za-z_]\w*(?:\[(?:\d+|'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")\])?): (.*)$", re.DOTALL
)
_FIELD_NAMED = re.compile(r"^Object (missing required|contains unknown) field `([^`]+)`$")


def _lookup(data: Any, path: str) -> tuple[bool, Any]:
    for key, index in _STEP.findall(path):
        try:
            data = data[int(index)] if index else data[key]
        except (KeyError, IndexError, TypeError):
            return False, None
    return True, data


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _fields_at(path: str) -> tuple[str, ...]:
    head = _STEP.match(path)
    kinds: dict[str, type[msgspec.Struct]] = {
        "redis": RedisSettings,
        "coordinator": CoordinatorSettings,
        "gates": GateConfig,
    }
    return kinds.get(head.group(1) if head else "", Config).__struct_fields__


# msgspec's name of a decoded value's type (in "got `str`") -> the Python types it covers.
_GOT = re.compile(r", got `(\w+)`")
_KINDS: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "bool": (bool,),
    "float": (float,),
    "array": (list, tuple),
    "object": (dict,),
    "null": (type(None),),
}


def _name_key(path: str, msg: str, data: Any) -> str:
    """msgspec shows a table's key as ``[...]`` (``$.gates[0].tenant_weights[...]``): name the
    first entry of that table whose value is of the type the error says it got."""
    head, sep, tail = path.rpartition("[...]")
    got = _GOT.search(msg)
    if not sep or tail or "[...]" in head or not got or got.group(1) not in _KINDS:
        return path
    found, table = _lookup(data, head)
    if not found or not isinstance(table, dict):
        return path
    kinds = _KINDS[got.group(1)]
    for key, value in table.items():
        if isinstance(value, kinds):
            return f"{head}[{key!r}]"
    return path


def _explain(message: str, data: dict[str, Any], injected: Mapping[str, str]) -> str:
    """Turn msgspec's ``Expected `int` >= 1 - at `$.gates[2].floor``` into one readable line."""
    match = _AT.match(message)
    msg, path = (match.group("msg"), match.group("path") or "") if match else (message, "")
    named = _FIELD_NAMED.match(msg)
    own = _FIELD_PREFIX.match(msg)
    if named:
        missing = named.group(1) == "missing required"
        field = named.group(2)
        hint = ""
        if not missing:
            close = difflib.get_close_matches(field, _fields_at(path), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
        path, msg = f"{path}.{field}", ("missing required field" if missing else "unknown field")
        msg += hint
    elif own:  # our own "field: problem" raised from a __post_init__
        path, msg = f"{path}.{own.group(1)}", own.group(2)
    else:
        path = _name_key(path, msg, data)
        msg = msg.replace("`object`", "table").replace("`", "")
        msg = msg[:1].lower() + msg[1:]
        found, value = _lookup(data, path)
        if found and path and ", got " not in msg:
            msg += f", got {_show(value)}"
    shown = path.lstrip(".")
    if shown in injected:
        shown = injected[shown]
    return _one_line(f"{shown}: {msg}" if shown else msg)


def _one_line(text: str) -> str:
    """``text`` with non-printable characters escaped: a key like ``"a\\nb"`` in the file must
    not split the error into several lines (or forge log lines)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
