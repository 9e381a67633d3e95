"""Checking a Redis URL before any connection: scheme, query parameters the installed redis-py
takes, TLS options and files, fleetgate's ``cluster=1`` flag; messages never show the password."""

from __future__ import annotations

import difflib
import functools
import os
from inspect import Parameter, signature
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis.asyncio as aredis
from redis.asyncio.connection import parse_url

from fleetgate._redis.redaction import redact, scrub
from fleetgate._redis.sentinel_url import is_sentinel_url
from fleetgate._redis.sentinel_url import parse as parse_sentinel_url
from fleetgate.errors import ConfigError

__all__ = ["split_cluster_flag", "validate_redis_url"]

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def split_cluster_flag(url: str) -> tuple[str, bool]:
    """``url`` without fleetgate's ``cluster=1`` query flag, and whether it was set.

    ``redis://node-1:6379/0?cluster=1`` (or ``rediss://…``) selects Redis Cluster: the gates'
    keys carry hash tags, so each gate lives in one slot and every script runs on one node.
    """
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    flag = [v for k, v in query if k == "cluster"]
    if not flag:
        return url, False
    rest = urlencode([(k, v) for k, v in query if k != "cluster"])
    return urlunsplit(parts._replace(query=rest)), flag[-1].lower() in _TRUE


# Query parameters fleetgate accepts in a Redis URL (redis-py turns them into connection
# options). A misspelt one would otherwise surface only at the first command, as a TypeError
# or (a missing CA file) an OSError that reads as "Redis unreachable".
_URL_PARAMS = frozenset(
    {
        "db",
        "username",
        "password",
        "client_name",
        "protocol",
        "socket_timeout",
        "socket_connect_timeout",
        "socket_keepalive",
        "health_check_interval",
        "max_connections",
        # not "timeout" (the blocking pool's wait): the dedicated clients' pool passes it on to
        # the connection, which refuses it
    }
)
_TLS_PARAMS = frozenset(
    {
        "ssl_ca_certs",
        "ssl_ca_path",
        "ssl_ca_data",
        "ssl_certfile",
        "ssl_keyfile",
        "ssl_password",
        "ssl_cert_reqs",
        "ssl_check_hostname",
        "ssl_min_version",
        "ssl_ciphers",
    }
)
_TLS_FILES = ("ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile")
_CERT_REQS = frozenset({"none", "optional", "required"})


def _init_params(cls: type) -> frozenset[str]:
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        for p in signature(init).parameters.values():
            if p.kind in (Parameter.POSITIONAL_OR_KEYWORD, Parameter.KEYWORD_ONLY):
                names.add(p.name)
    return frozenset(names)


@functools.cache
def _accepted(scheme: str, cluster: bool) -> frozenset[str]:
    """The URL parameters the installed redis-py accepts for this kind of connection."""
    if cluster:
        supported = _init_params(aredis.RedisCluster)
    else:
        conn = {
            "unix": aredis.UnixDomainSocketConnection,
            "rediss": aredis.SSLConnection,
        }.get(scheme, aredis.Connection)
        supported = _init_params(conn) | _init_params(aredis.BlockingConnectionPool)
    wanted = _URL_PARAMS | (_TLS_PARAMS if scheme == "rediss" else frozenset())
    return frozenset(wanted & supported) | {"cluster"}


def validate_redis_url(url: object, *, check_files: bool = False) -> str:
    """Return ``url`` if it is a usable Redis URL, else raise :class:`ConfigError` saying why.

    Accepted: ``redis://``, ``rediss://`` (TLS) and ``unix://`` URLs; query parameters are
    redis-py connection options (``db``, ``socket_timeout``, the ``ssl_*`` options of
    ``rediss://``, ...) plus fleetgate's ``cluster=1``. ``check_files`` also checks that the TLS
    files named by ``ssl_ca_certs``/``ssl_ca_path``/``ssl_certfile``/``ssl_keyfile`` exist.
    Messages never contain the password.
    """
    if not isinstance(url, str) or not url.strip():
        raise ConfigError("the Redis URL must be a non-empty string")
    shown = redact(url)
    if any(ch.isspace() or ord(ch) < 0x20 or ord(ch) == 0x7F for ch in url):
        raise ConfigError(f"Redis URL {shown!r} contains whitespace or control characters")
    if is_sentinel_url(url):
        return _validate_sentinel_url(url, shown, check_files)
    scheme, query = _split_url(url, shown)
    cluster_flags = [v for k, v in query if k == "cluster"]
    cluster = bool(cluster_flags) and cluster_flags[-1].lower() in _TRUE
    if cluster_flags and cluster_flags[-1].lower() not in _TRUE | _FALSE:
        raise ConfigError(f"Redis URL {shown!r}: cluster= takes 1/0, true/false, yes/no, on/off")
    if cluster and scheme == "unix":
        raise ConfigError(f"Redis URL {shown!r}: a Redis Cluster cannot be reached by unix://")
    _check_query_keys(query, scheme, cluster, shown)
    try:
        parse_url(url if not cluster_flags else split_cluster_flag(url)[0])
    except ValueError as exc:  # e.g. "Invalid value for 'db' in connection URL."
        raise ConfigError(f"Redis URL {shown!r}: {scrub(str(exc), url)}") from None
    _check_tls_options(dict(query), shown, check_files)
    return url


def _validate_sentinel_url(url: str, shown: str, check_files: bool) -> str:
    try:
        target = parse_sentinel_url(url)
    except ValueError as exc:
        raise ConfigError(f"Redis URL {shown!r}: {scrub(str(exc), url)}") from None
    query = [*target.options]
    if any(k == "cluster" for k, _ in query):
        raise ConfigError(f"Redis URL {shown!r}: cluster= does not apply to a Sentinel URL")
    _check_query_keys(query, "rediss" if target.tls else "redis", False, shown)
    _check_tls_options(dict(query), shown, check_files)
    return url


def _split_url(url: str, shown: str) -> tuple[str, list[tuple[str, str]]]:
    """The scheme (lower case) and the query pairs of ``url``; ConfigError if malformed."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a malformed port
    except ValueError:
        # urllib's message would quote the bad port, which is part of the password when the
        # password holds an unescaped '/', '?' or '#'.
        raise ConfigError(
            f"Redis URL {shown!r} is malformed (bad port?); percent-encode any '@', '/', '?', "
            "'#' or ':' in the user name or password"
        ) from None
    scheme = parts.scheme.lower()
    if scheme not in ("redis", "rediss", "unix"):
        raise ConfigError(
            "expected a redis://, rediss://, unix:// or redis+sentinel:// URL, got scheme "
            f"{parts.scheme!r}"
        )
    if scheme == "unix" and not parts.path:
        raise ConfigError(f"Redis URL {shown!r} has no socket path")
    return scheme, parse_qsl(parts.query, keep_blank_values=True)


def _check_query_keys(query: list[tuple[str, str]], scheme: str, cluster: bool, shown: str) -> None:
    """Every query parameter is one the installed redis-py takes for this connection."""
    accepted = _accepted(scheme, cluster)
    for key, _ in query:
        if key in accepted:
            continue
        if key in _TLS_PARAMS and scheme != "rediss":
            raise ConfigError(
                f"Redis URL {shown!r}: {key} needs a rediss:// (TLS) URL, not {scheme}://"
            )
        if key in _TLS_PARAMS | _URL_PARAMS:
            kind = "Redis Cluster" if cluster else "this connection"
            raise ConfigError(
                f"Redis URL {shown!r}: {key} is not supported for {kind} by the installed redis-py"
            )
        close = difflib.get_close_matches(key, sorted(accepted), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"Redis URL {shown!r}: unknown query parameter {key!r}{hint}")


def _check_tls_options(options: dict[str, str], shown: str, check_files: bool) -> None:
    reqs = options.get("ssl_cert_reqs")
    if reqs is not None and reqs.lower() not in _CERT_REQS:
        raise ConfigError(
            f"Redis URL {shown!r}: ssl_cert_reqs must be none, optional or required, got {reqs!r}"
        )
    if check_files:
        for key in _TLS_FILES:
            path = options.get(key)
            if path is not None and not os.path.exists(path):
                raise ConfigError(f"Redis URL {shown!r}: {key} file {path!r} does not exist")
