"""The Sentinel URL form: ``redis+sentinel://[user:password@]h1:26379,h2:26379/<service>[/<db>]``.

Credentials are the master's; ``?sentinel_password=`` (and ``sentinel_username=``) authenticate
to the sentinels; a host without a port means 26379; ``rediss+sentinel://`` is TLS to both. Other
query parameters are connection options of the master's connections, as in a ``redis://`` URL.

Only parsing lives here (no redis-py): :mod:`fleetgate._redis.urls` checks the options and
:mod:`fleetgate._redis.sentinel_pool` builds the client. Errors are ``ValueError`` whose messages
never contain the password.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import parse_qsl, unquote

__all__ = ["SENTINEL_PORT", "SENTINEL_SCHEMES", "SentinelTarget", "is_sentinel_url", "parse"]

SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
SENTINEL_PORT = 26379
#: query parameters that are about the sentinels, not the master's connections
SENTINEL_PARAMS = ("sentinel_password", "sentinel_username")


@dataclass(frozen=True)
class SentinelTarget:
    """Where a Sentinel URL points: the sentinels, the service name and the master's options."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    tls: bool = False
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None
    #: the remaining query parameters, connection options of the master's connections
    options: tuple[tuple[str, str], ...] = field(default=())


def is_sentinel_url(url: str) -> bool:
    """Whether ``url`` uses one of the Sentinel schemes."""
    return url.partition("://")[0].lower() in SENTINEL_SCHEMES


def parse(url: str) -> SentinelTarget:
    """Split a Sentinel URL into a :class:`SentinelTarget`; ``ValueError`` says what is wrong."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in SENTINEL_SCHEMES:
        raise ValueError("expected redis+sentinel:// or rediss+sentinel://")
    rest, _, query = rest.partition("?")
    rest = rest.partition("#")[0]
    netloc, _, path = rest.partition("/")
    # The LAST '@' ends the credentials: a password may hold an unescaped '@'.
    auth, at, hostlist = netloc.rpartition("@")
    username, password = _credentials(auth) if at else (None, None)
    sentinels = tuple(_host(h) for h in hostlist.split(","))
    service, _, db_text = path.strip("/").partition("/")
    if not service:
        raise ValueError("no service name: expected /<service>[/<db>] after the sentinel hosts")
    db = 0
    if db_text:
        if not (db_text.isascii() and db_text.isdigit()):
            raise ValueError(f"db: expected a number after the service name, got {db_text!r}")
        db = int(db_text)
    pairs = parse_qsl(query, keep_blank_values=True)
    own = {k: v for k, v in pairs if k in SENTINEL_PARAMS}
    if "db" in dict(pairs):
        raise ValueError("db: give it in the path (/<service>/<db>), not as ?db=")
    return SentinelTarget(
        sentinels=sentinels,
        service=unquote(service),
        db=db,
        tls=scheme.lower() == "rediss+sentinel",
        username=username,
        password=password,
        sentinel_username=own.get("sentinel_username"),
        sentinel_password=own.get("sentinel_password"),
        options=tuple((k, v) for k, v in pairs if k not in SENTINEL_PARAMS),
    )


def _credentials(auth: str) -> tuple[str | None, str | None]:
    user, colon, password = auth.partition(":")
    if not colon:  # redis://secret@host: a password alone, as redis-py reads it
        return None, unquote(user) or None
    return unquote(user) or None, unquote(password) or None


def _host(text: str) -> tuple[str, int]:
    """``host[:port]`` or ``[v6]:port``; the port defaults to 26379."""
    if not text:
        raise ValueError("a sentinel host is empty (expected h1:26379,h2:26379)")
    if text.startswith("["):
        host, bracket, tail = text[1:].partition("]")
        if not bracket or (tail and not tail.startswith(":")):
            raise ValueError(f"sentinel host {text!r}: expected [ipv6]:port")
        port_text = tail[1:]
    else:
        host, _, port_text = text.partition(":")
    if not host:
        raise ValueError(f"sentinel host {text!r} has no host name")
    if not port_text:
        return host, SENTINEL_PORT
    if not (port_text.isascii() and port_text.isdigit()) or not 0 < int(port_text) < 65536:
        raise ValueError(f"sentinel host {text!r}: port must be 1-65535")
    return host, int(port_text)
