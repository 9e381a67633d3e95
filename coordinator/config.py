"""The coordinator's configuration: one TOML file, decoded into frozen msgspec structs.

Shape (see ``example.toml`` next to this module for every key with its default)::

    [redis]        url, prefix
    [coordinator]  poll_interval, poll_jitter, leader_ttl, metrics_listen, target_ttl_polls,
                   scrape_timeout, max_body_bytes, adaptive, prune_idle_after
    [[gates]]      name, floor, ceiling, max_queued, lease_ms, waiter_ms,
                   max_queued_per_tenant, shed_below, tenant_weights (a table name -> int),
                   token_limit, token_ceiling, deadline_admission (true, false, "start"
                   or "finish"), band_share (a table priority -> fraction of the limit),
                   revoke_after (seconds), tune_tokens,
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
``auto``: detected from the exposition); see ``docs/servers.md``. A gate with a ``token_limit``
and a metrics source has its token budget tuned from the KV cache its server states and its
preemptions (``tune_tokens``, default true), never above its ``token_ceiling`` (default: the
``token_limit``, so without a ceiling the budget is only ever cut; ``docs/aimd.md``, "The token
budget").

Environment overrides, applied on top of the file (an empty value counts as unset):

=============================  ===========================================================
``FLEETGATE_REDIS_URL``        ``redis.url``
``FLEETGATE_PREFIX``           ``redis.prefix``
``FLEETGATE_POLL_INTERVAL``    ``coordinator.poll_interval`` (seconds)
``FLEETGATE_METRICS_LISTEN``   ``coordinator.metrics_listen`` (``host:port``)
``FLEETGATE_ADAPTIVE``         ``coordinator.adaptive`` (``0/false/no/off`` or ``1/true/yes/on``)
``KG_ADAPTIVE_CONCURRENCY``    the switch of ``agent_utilities``' ``model_concurrency`` (the
                               per-process helpers :mod:`fleetgate.client.compat` replaces);
                               ``0`` turns adaptation off (off always wins)
``MODEL_MAX_CONCURRENCY``      default ``ceiling`` of gates that set none (default 512; a gate's
                               default ceiling is never below its floor)
=============================  ===========================================================

With adaptation off the coordinator takes exactly the static path: no targets are published and
every gate's limit is its floor. Every problem is a :class:`~fleetgate.errors.ConfigError` with
one line naming the field (or the environment variable) and the problem, e.g.
``gates[2].floor: expected int >= 1, got 0``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from fleetgate.admission import validate_tenant_weights
from fleetgate.bands import validate_band_share
from fleetgate.configfile import (
    REDIS_ENV,
    RedisSettings,
    checked,
    convert,
    decode_toml,
    parse_listen,
    read_toml,
)
from fleetgate.errors import ConfigError
from fleetgate.keys import validate_gate_name
from fleetgate.settings import (
    DEFAULT_CEILING,
    Floor,
    GateSettings,
    check_ceiling,
    check_tokens,
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

#: the values of a gate's ``signal``
SIGNALS = ("auto", "metrics", "latency", "fixed")
DEFAULT_POLL_INTERVAL = 2.0
#: the scrape timeout when the poll interval allows it (a healthy /metrics answers in ms)
DEFAULT_SCRAPE_TIMEOUT = 2.0
# The default of ``scrape_timeout``, meaning "unset": a decoded value must be > 0, so no file or
# environment can produce it; ``__post_init__`` replaces it with min(2 s, poll_interval).
_SCRAPE_TIMEOUT_UNSET = 0.0


def _metrics_listen(value: str) -> tuple[str, int]:
    return parse_listen(value, empty_host=True)  # ':9464' serves every interface


class CoordinatorSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How the coordinator polls, leads and publishes. Times are in seconds (at most an hour;
    ``prune_idle_after`` at most 30 days)."""

    #: 2 s: a ramp from the floor takes ~6 polls, so 12 s instead of 72 s at the 12 s poll of
    #: ``agent_utilities``' ``model_concurrency`` (a throttle: every pod scraped); one poll of
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
        checked("metrics_listen", _metrics_listen, self.metrics_listen)
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
        return _metrics_listen(self.metrics_listen)

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
        tests/coordinator/test_leader_failover.py) and the pods ran at the floor meanwhile. With the
        takeover added, targets outlive it by construction for every accepted configuration,
        and a real blackout (no coordinator left) still decays to the floor, one takeover later.
        A live leader that is blind to a server does not wait for that: its controller
        publishes the floor after ``target_ttl_polls`` unknown polls (docs/aimd.md)."""
        return self.target_ttl_polls * self.poll_interval + self.takeover


class GateConfig(GateSettings, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One gate: its settings, and where the signal that drives its target comes from.

    The settings are :class:`~fleetgate.settings.GateSettings`' own fields -- their types,
    bounds (checked when the file is decoded) and defaults -- inherited, not restated: a
    GateConfig *is* the gate's settings (``as_cfg()``, ``argv()``), plus the fields below. Only
    the ``floor`` (the static limit) is required here; ``ceiling`` bounds the adaptive target.
    """

    name: str
    floor: Floor
    base_url: str | None = None
    metrics_url: str | tuple[str, ...] | None = None
    model_name: str | None = None
    #: the model server's kind (``vllm``, ``sglang``, ``tgi``, ``tei``, ``llamacpp``, ``trtllm``,
    #: ``nim``) or ``auto``: detected from the exposition at each kind's metrics path
    server: str = AUTO
    #: what drives the target: ``auto`` | ``metrics`` | ``latency`` | ``fixed`` (module doc)
    signal: str = "auto"
    #: tune the token budget from the server's KV cache (a gate with ``token_limit`` and a
    #: metrics source; the configured ``token_limit`` is where tuning starts and what the budget
    #: lapses to without a leader)
    tune_tokens: bool = True

    def __post_init__(self) -> None:
        checked("name", validate_gate_name, self.name)
        check_ceiling(self.floor, self.ceiling)
        check_tokens(self.token_limit, self.token_ceiling)
        # The errors name the entry: tenant_weights['a b{']: tenant 'a b{' contains '{': ...
        msgspec.structs.force_setattr(
            self, "tenant_weights", validate_tenant_weights(self.tenant_weights)
        )
        # band_share[0]: expected a fraction of the limit in (0, 1], ...
        msgspec.structs.force_setattr(self, "band_share", validate_band_share(self.band_share))
        if self.base_url is not None and self.metrics_url is not None:
            raise ConfigError("metrics_url: set base_url or metrics_url, not both")
        if self.base_url is not None:
            checked("base_url", derive_metrics_url, self.base_url)
        if isinstance(self.metrics_url, str):
            checked("metrics_url", validate_metrics_url, self.metrics_url)
        elif self.metrics_url is not None:
            if not self.metrics_url:
                raise ConfigError("metrics_url: the list of replica URLs is empty")
            for i, url in enumerate(self.metrics_url):
                checked(f"metrics_url[{i}]", validate_metrics_url, url)
            if len(set(self.metrics_url)) != len(self.metrics_url):
                raise ConfigError("metrics_url: the same URL is listed twice")
        if self.model_name is not None and not self.model_name:
            raise ConfigError("model_name: must not be empty (leave it out to match every model)")
        checked("server", validate_server, self.server)
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
        """The gate's settings alone, as a plain :class:`~fleetgate.settings.GateSettings`
        (this config is one already; the scripts' arguments are ``as_cfg()``/``argv()``)."""
        return GateSettings(
            **{name: getattr(self, name) for name in GateSettings.__struct_fields__}
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
    def tokens_tuned(self) -> bool:
        """True when the coordinator may tune the gate's token budget (it has one, a metrics
        source, and ``tune_tokens``); the coordinator's ``adaptive`` switch applies on top."""
        return self.tune_tokens and self.token_limit is not None and self.has_metrics

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
        return cls.from_mapping(decode_toml(text, source), env=env)

    @classmethod
    def from_mapping(
        cls, raw: Mapping[str, Any], *, env: Mapping[str, str] | None = None
    ) -> Config:
        """Validate a decoded mapping (TOML's shape) after applying ``env`` overrides."""
        data: dict[str, Any] = _deep_copy(dict(raw))
        injected = _apply_env(data, os.environ if env is None else env)
        return convert(cls, data, injected=injected)


def load_config(
    path: str | os.PathLike[str],
    env: Mapping[str, str] = os.environ,
    *,
    redis: str | None = None,
    prefix: str | None = None,
) -> Config:
    """Read and validate the TOML file at ``path``; see the module docstring for ``env``.
    ``redis`` and ``prefix`` (``fleetgate coordinator --redis/--prefix``) win over both; a bad
    one is a :class:`ConfigError` naming the flag."""
    config = Config.from_mapping(read_toml(path), env=env)
    if redis is None and prefix is None:
        return config
    try:
        settings = RedisSettings(
            url=redis or config.redis.url, prefix=prefix or config.redis.prefix
        )
    except ConfigError as exc:
        text = str(exc).replace("url:", "--redis:", 1).replace("prefix:", "--prefix:", 1)
        raise ConfigError(text) from None
    return msgspec.structs.replace(config, redis=settings)


# ---------------------------------------------------------------------------------- environment

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
        *((var, "redis", key) for var, key in REDIS_ENV),
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
