"""The proxy's configuration: one TOML file (or the one-route CLI flags), decoded into frozen
msgspec structs.

Shape (``example.toml`` next to this module shows every key with its default)::

    [redis]      url, prefix
    [proxy]      listen, workers, max_request_bytes, max_buffered_bytes, max_response_bytes,
                 max_header_bytes, head_timeout_s, body_timeout_s, trusted_proxies,
                 drain_seconds, access_log, access_log_sample, metrics_path,
                 health_path
    [[routes]]   path, strip_path, models, upstream, gate, deadline_ms, max_deadline_ms, priority,
                 min_priority, max_priority, tenant, tenants, weight, max_weight,
                 stream_uploads, stream_timeout_s, connect_timeout_s, retry_after_s,
                 max_retry_after_s, tokens, tokenizer, output_tokens, stream_usage,
                 gate_defaults

A request goes to the first route whose ``path`` is a prefix of its path (on a ``/`` boundary)
and, when the route lists ``models``, whose JSON body names one of them in ``model``. Every
problem is a :class:`~fleetgate.errors.ConfigError` naming the field, e.g.
``routes[1].upstream: expected an http:// or https:// URL without credentials, got 'ftp://x'``.
Environment: ``FLEETGATE_REDIS_URL`` and ``FLEETGATE_PREFIX`` override ``[redis]`` (the CLI's
``--redis``/``--prefix`` win over both): flags, environment, file, defaults, as for every command.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import msgspec
from msgspec import Meta

from fleetgate.admission import MAX_PRIORITY, MIN_PRIORITY, validate_tenant
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
from fleetgate.settings import GateSettings

__all__ = [
    "MAX_WORKERS",
    "ProxyConfig",
    "ProxySettings",
    "RedisSettings",
    "RouteConfig",
    "load_config",
    "one_route",
    "parse_listen",
]

Priority = Annotated[int, Meta(ge=MIN_PRIORITY, le=MAX_PRIORITY)]
Millis = Annotated[int, Meta(ge=1, le=86_400_000)]
Seconds = Annotated[float, Meta(gt=0, le=86_400)]
MiB = 1024 * 1024
#: the most worker processes one proxy runs (``[proxy] workers``, ``--workers``)
MAX_WORKERS = 256


def validate_upstream(url: object) -> str:
    """An ``http(s)://host[:port][/base]`` URL with no credentials, query or fragment; returned
    without a trailing slash."""
    shown = url if isinstance(url, str) else type(url).__name__
    problem = "expected an http:// or https:// URL without credentials, query or fragment"
    if not isinstance(url, str):
        raise ConfigError(f"{problem}, got {shown!r}")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        raise ConfigError(f"{problem}, got an unparsable URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{problem}, got {url!r}")
    if parts.username is not None or parts.password is not None:
        # never echo it: the user part may hold a token
        raise ConfigError(f"{problem}: credentials in the URL are refused (set them as headers)")
    if parts.query or parts.fragment or any(c.isspace() for c in url):
        raise ConfigError(f"{problem}, got {url!r}")
    return url.rstrip("/")


class ProxySettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The listener and the limits every route shares."""

    listen: str = "127.0.0.1:8080"
    #: worker processes behind the listening port, one Fleet each (1: the proxy is one
    #: process; more: a parent supervises them, docs/proxy.md "Workers")
    workers: Annotated[int, Meta(ge=1, le=MAX_WORKERS)] = 1
    #: a larger request body gets 413 (before a permit is taken when Content-Length says so)
    max_request_bytes: Annotated[int, Meta(ge=1, le=1024 * MiB)] = 16 * MiB
    #: request body bytes buffered across all connections at once (a body is read whole
    #: before its request joins the gate's queue); a body that would pass it gets 503 with
    #: Retry-After and the connection is closed. At least max_request_bytes
    max_buffered_bytes: Annotated[int, Meta(ge=1, le=64 * 1024 * MiB)] = 256 * MiB
    #: a larger upstream response is cut: 502 before its headers were sent, else the connection
    #: is closed (the permit is freed either way)
    max_response_bytes: Annotated[int, Meta(ge=1, le=16 * 1024 * MiB)] = 256 * MiB
    #: request line and headers together; more gets 431
    max_header_bytes: Annotated[int, Meta(ge=1024, le=MiB)] = 32 * 1024
    #: a request's head must be complete this long after the connection opened or its previous
    #: answer ended (408 and closed; a connection that sent nothing is closed without answer)
    head_timeout_s: Annotated[float, Meta(gt=0, le=3600)] = 30.0
    #: a request body that goes this long without a byte before its end gets 408 (closed)
    body_timeout_s: Annotated[float, Meta(gt=0, le=3600)] = 30.0
    #: peers (IP addresses or networks) whose Forwarded / X-Forwarded-* / X-Real-IP headers are
    #: passed on (X-Forwarded-For: the peer appended); from any other peer they are dropped and
    #: X-Forwarded-For is the peer's address alone
    trusted_proxies: tuple[str, ...] = ()
    #: on SIGTERM: stop accepting, then wait this long for requests in flight
    drain_seconds: Annotated[float, Meta(ge=0, le=3600)] = 30.0
    access_log: bool = True
    #: one access log line in this many exchanges answered below 400 (every other exchange --
    #: 4xx, 5xx, cut -- has its line): at saturation a line is ~3.5 % of the proxy's CPU
    access_log_sample: Annotated[int, Meta(ge=1, le=1_000_000)] = 1
    #: the proxy's own endpoints; never forwarded
    metrics_path: str = "/metrics"
    health_path: str = "/healthz"

    def __post_init__(self) -> None:
        checked("listen", parse_listen, self.listen)
        if self.max_buffered_bytes < self.max_request_bytes:
            raise ConfigError(
                f"max_buffered_bytes: {self.max_buffered_bytes} is below max_request_bytes "
                f"{self.max_request_bytes} (a body of the largest size could never be buffered)"
            )
        for i, network in enumerate(self.trusted_proxies):
            try:
                ipaddress.ip_network(network, strict=False)
            except ValueError:
                raise ConfigError(
                    f"trusted_proxies[{i}]: expected an IP address or network (10.0.0.0/8), "
                    f"got {network!r}"
                ) from None
        for name in ("metrics_path", "health_path"):
            value = getattr(self, name)
            if not value.startswith("/") or any(c.isspace() or c == "?" for c in value):
                raise ConfigError(f"{name}: expected a path starting with '/', got {value!r}")

    @property
    def address(self) -> tuple[str, int]:
        return parse_listen(self.listen)

    def trusted_networks(self) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
        return tuple(ipaddress.ip_network(n, strict=False) for n in self.trusted_proxies)


class RouteConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One route: which requests (path prefix, models) go to which upstream through which gate,
    and what a caller may ask for in the ``X-Fleetgate-*`` headers."""

    upstream: str
    gate: str
    path: str = "/"
    #: forward the path without the route's ``path`` prefix (``/rerank/ranking`` ->
    #: upstream base + ``/ranking``); default: the caller's whole path
    strip_path: bool = False
    #: the ``route`` label of the proxy's metrics and the access log; default: path (+ models)
    name: str = ""
    #: the JSON body's ``model`` must be one of these; empty = any body
    models: tuple[str, ...] = ()
    #: X-Fleetgate-Deadline-Ms when absent; a larger asked value is clamped to max_deadline_ms
    deadline_ms: Millis = 30_000
    max_deadline_ms: Millis | None = None
    #: X-Fleetgate-Priority when absent; asked values are clamped to [min_priority, max_priority]
    priority: Priority = 0
    min_priority: Priority | None = None
    max_priority: Priority | None = None
    #: the tenant when the header is absent ("" = the default tenant) or names no allowed one
    tenant: str = ""
    #: tenants a caller may pick with X-Fleetgate-Tenant; ["*"] = any valid name
    tenants: tuple[str, ...] = ()
    #: X-Fleetgate-Weight when absent; asked values are clamped to [1, max_weight]
    weight: Annotated[int, Meta(ge=1)] = 1
    max_weight: Annotated[int, Meta(ge=1)] | None = None
    #: take the permit first and stream the request body to the upstream as it arrives (for
    #: uploads too large to buffer: a slow sender then holds the permit); default: the body is
    #: read whole, within the deadline, before the request joins the gate's queue
    stream_uploads: bool = False
    #: a streamed (or any) response body must be complete this long after its headers
    stream_timeout_s: Seconds = 600.0
    connect_timeout_s: Seconds = 10.0
    #: Retry-After of a 429 (integer seconds, at least 1) when the gate gave no estimate
    retry_after_s: Annotated[int, Meta(ge=1, le=3600)] = 1
    #: the most a Retry-After computed from the gate's estimate may say (a call refused for its
    #: deadline: when the queue ahead is expected to have drained enough)
    max_retry_after_s: Annotated[int, Meta(ge=1, le=3600)] = 60
    #: "openai": a POST to /v1/chat/completions, /v1/completions or /v1/embeddings asks the
    #: gate for the tokens its JSON body estimates (prompt + output) and reports what the
    #: answer's usage says it used (docs/proxy.md "Token budgets through the proxy"); "off":
    #: no tokens but what an X-Fleetgate-Tokens header asks
    tokens: Literal["off", "openai"] = "off"
    #: how prompt text is counted: "" (characters / 4, rounded up), "tiktoken:<encoding>" or
    #: "module:function" (a callable taking the text, returning its token count)
    tokenizer: str = ""
    #: the output tokens of a request that names no max_tokens, until the tenant's use is learnt
    output_tokens: Annotated[int, Meta(ge=0, le=10_000_000)] = 512
    #: add stream_options.include_usage to a streamed request that did not ask for it (the
    #: usage chunk it adds is taken out of the caller's stream); off for an upstream that
    #: refuses the option (its streams then settle nothing)
    stream_usage: bool = True
    #: the gate's settings registered only if Redis has none (as Fleet.gate's keyword arguments)
    gate_defaults: dict[str, Any] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        upstream = checked("upstream", validate_upstream, self.upstream)
        checked("gate", validate_gate_name, self.gate)
        checked("path", _check_path, self.path)
        checked("tenant", validate_tenant, self.tenant or None)
        checked("name", _check_name, self.name)
        for i, t in enumerate(self.tenants):
            if t != "*":
                checked(f"tenants[{i}]", validate_tenant, t)
        try:
            defaults = self.gate_defaults
            checked("gate_defaults", lambda d: GateSettings.for_gate(self.gate, **d), defaults)
        except TypeError as exc:  # an unknown keyword of gate_defaults
            raise ConfigError(f"gate_defaults: {exc}") from None
        msgspec.structs.force_setattr(self, "upstream", upstream)
        if self.stream_uploads and self.models:
            raise ConfigError(
                "stream_uploads: a route that names models reads the body whole to route it"
            )
        if self.tokens != "off" and self.stream_uploads:
            raise ConfigError(
                "stream_uploads: a route that estimates tokens reads the body whole to count them"
            )
        if self.tokenizer:
            from ._tokens import load_tokenizer  # only when a route names one

            try:
                load_tokenizer(self.tokenizer)
            except (ImportError, ValueError, AttributeError) as exc:
                raise ConfigError(
                    f"tokenizer: {self.tokenizer!r} cannot be loaded: {exc}"
                ) from None
        lo, hi = self.priority_range
        if not lo <= self.priority <= hi:
            raise ConfigError(
                f"priority: {self.priority} is outside [min_priority, max_priority] = [{lo}, {hi}]"
            )
        if self.weight > self.weight_cap:
            raise ConfigError(f"weight: {self.weight} is above max_weight {self.weight_cap}")
        if self.deadline_ms > self.deadline_cap_ms:
            raise ConfigError(
                f"deadline_ms: {self.deadline_ms} is above max_deadline_ms {self.deadline_cap_ms}"
            )

    @property
    def priority_range(self) -> tuple[int, int]:
        """[min, max] a caller may ask for (both default to ``priority``: the header is
        ignored unless the route opens a range)."""
        lo = self.priority if self.min_priority is None else self.min_priority
        hi = self.priority if self.max_priority is None else self.max_priority
        return lo, hi

    @property
    def weight_cap(self) -> int:
        return self.weight if self.max_weight is None else self.max_weight

    @property
    def deadline_cap_ms(self) -> int:
        return self.deadline_ms if self.max_deadline_ms is None else self.max_deadline_ms

    @property
    def any_tenant(self) -> bool:
        return "*" in self.tenants

    def matches_path(self, path: str) -> bool:
        """Whether ``path`` is under this route's prefix (``/v1`` matches ``/v1`` and
        ``/v1/x``, not ``/v10``)."""
        p = self.path
        return p == "/" or path == p or path.startswith(p if p.endswith("/") else p + "/")

    def upstream_path(self, raw_path: bytes) -> bytes | None:
        """The path to forward for a caller's ``raw_path`` (as sent, percent-encoded): itself,
        or with ``strip_path`` the rest after the prefix (``/`` at least). None when the prefix
        is not literally there (the caller percent-encoded part of it: the route matched the
        decoded path, but there is no unambiguous rest to forward)."""
        if not self.strip_path or self.path == "/":
            return raw_path
        prefix = self.path.rstrip("/").encode("ascii")
        if not raw_path.startswith(prefix):
            return None
        rest = raw_path[len(prefix) :]
        if rest and not rest.startswith(b"/"):
            return None
        return rest or b"/"

    @property
    def label(self) -> str:
        """The route's name in metrics and logs."""
        if self.name:
            return self.name
        return f"{self.path} {','.join(self.models)}" if self.models else self.path

    def describe(self) -> str:
        models = f" models={list(self.models)}" if self.models else ""
        return f"{self.path}{models} -> {self.upstream} via gate {self.gate!r}"


def _check_name(name: str) -> None:
    if len(name) > 100 or not name.isprintable():
        raise ConfigError(f"expected at most 100 printable characters, got {name[:40]!r}")


_PATH = re.compile(r"^/[!-~]*$")  # printable ASCII, no spaces


def _check_path(path: str) -> None:
    if not _PATH.match(path) or "?" in path or "#" in path:
        raise ConfigError(f"expected a path prefix starting with '/', got {path!r}")


class ProxyConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The whole configuration; see the module docstring."""

    routes: tuple[RouteConfig, ...]
    redis: RedisSettings = msgspec.field(default_factory=RedisSettings)
    proxy: ProxySettings = msgspec.field(default_factory=ProxySettings)

    def __post_init__(self) -> None:
        if not self.routes:
            raise ConfigError("routes: at least one [[routes]] entry is needed")
        own = {self.proxy.metrics_path, self.proxy.health_path}
        for i, r in enumerate(self.routes):
            if r.path in own:
                raise ConfigError(f"routes[{i}].path: {r.path!r} is the proxy's own endpoint")

    @classmethod
    def from_mapping(
        cls, raw: Mapping[str, Any], env: Mapping[str, str] | None = None
    ) -> ProxyConfig:
        """Validate a decoded mapping; ``FLEETGATE_REDIS_URL``/``FLEETGATE_PREFIX`` from ``env``
        override its ``[redis]`` keys."""
        data = dict(raw)
        env = os.environ if env is None else env
        redis = data.get("redis", {})
        if isinstance(redis, dict):
            redis = dict(redis)
            for var, key in REDIS_ENV:
                if env.get(var):
                    redis[key] = env[var]
            data["redis"] = redis
        return convert(cls, data)

    @classmethod
    def from_toml_text(
        cls, text: str | bytes, *, source: str = "<config>", env: Mapping[str, str] | None = None
    ) -> ProxyConfig:
        """Decode TOML ``text`` and validate it (:meth:`from_mapping`)."""
        return cls.from_mapping(decode_toml(text, source), env)

    def with_overrides(
        self,
        *,
        listen: str | None = None,
        redis: str | None = None,
        prefix: str | None = None,
        workers: int | None = None,
    ) -> ProxyConfig:
        """The CLI's ``--listen``, ``--redis``, ``--prefix`` and ``--workers`` over the file's
        values."""
        proxy, rs = self.proxy, self.redis
        given = {k: v for k, v in (("listen", listen), ("workers", workers)) if v is not None}
        try:
            if given:
                proxy = convert(ProxySettings, {**msgspec.structs.asdict(proxy), **given})
        except ConfigError as exc:
            raise ConfigError(f"proxy.{exc}") from None
        try:
            if redis is not None or prefix is not None:
                rs = RedisSettings(url=redis or rs.url, prefix=prefix or rs.prefix)
        except ConfigError as exc:
            raise ConfigError(f"redis.{exc}") from None
        return msgspec.structs.replace(self, proxy=proxy, redis=rs)


def load_config(path: str | os.PathLike[str], env: Mapping[str, str] | None = None) -> ProxyConfig:
    """Read and validate the TOML file at ``path``."""
    return ProxyConfig.from_mapping(read_toml(path), env)


def one_route(
    *,
    upstream: str,
    gate: str,
    listen: str | None = None,
    redis: str | None = None,
    prefix: str | None = None,
    workers: int | None = None,
    gate_defaults: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> ProxyConfig:
    """The configuration of ``fleetgate proxy --upstream URL --gate NAME`` (every path);
    ``gate_defaults`` as a route's (``--floor``, ``--ceiling``, ``--max-queued``)."""
    route: dict[str, Any] = {"upstream": upstream, "gate": gate}
    if gate_defaults:
        route["gate_defaults"] = dict(gate_defaults)
    raw: dict[str, Any] = {"routes": [route]}
    proxy_table = {k: v for k, v in (("listen", listen), ("workers", workers)) if v is not None}
    if proxy_table:
        raw["proxy"] = proxy_table
    redis_table = {k: v for k, v in (("url", redis), ("prefix", prefix)) if v is not None}
    if redis_table:
        raw["redis"] = redis_table
    return ProxyConfig.from_mapping(raw, env)
