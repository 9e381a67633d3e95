"""Keeping passwords out of logs, errors and status output."""

from __future__ import annotations

import re
from urllib.parse import unquote

__all__ = ["redact", "scrub"]

# A scheme, then everything up to the LAST '@' before whitespace: a password may hold an
# unescaped '@' or '/', and cutting at the first one would print the rest. When in doubt this
# hides too much (an '@' in a query value), never too little.
_CREDENTIALS = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<auth>[^\s'\"]*@)", re.IGNORECASE)
# Query parameters that carry secrets: ?password=..., ?ssl_password=...
_SECRET_PARAM = re.compile(
    r"(?P<key>[?&][a-z_]*(?:password|secret|token)[a-z_]*=)(?P<value>[^&#\s'\"]*)",
    re.IGNORECASE,
)


def redact(url: str) -> str:
    """``url`` with any user:password part and password query values replaced by ``***``.

    For logs, errors and status output. ``redis://u:p@h:6379/0`` -> ``redis://***@h:6379/0``.
    """
    url = _CREDENTIALS.sub(lambda m: f"{m.group('scheme')}***@", url)
    return _SECRET_PARAM.sub(lambda m: f"{m.group('key')}***", url)


def _secrets_of(url: str) -> list[str]:
    secrets: list[str] = []
    scheme_end = url.find("://")
    if scheme_end >= 0:
        rest = url[scheme_end + 3 :]
        auth = rest.rpartition("@")[0] if "@" in rest else ""
        if auth:
            password = auth.partition(":")[2] if ":" in auth else auth
            secrets += [password, unquote(password)]
    for m in _SECRET_PARAM.finditer(url):
        secrets += [m.group("value"), unquote(m.group("value"))]
    # Longest first, so a secret that contains another is replaced whole.
    return sorted({s for s in secrets if len(s) >= 3}, key=len, reverse=True)


def scrub(text: str, url: str) -> str:
    """``text`` (an error message, say) with ``url``'s password, and any credentials of URLs in
    it, replaced by ``***``: belt and braces for messages of third-party code."""
    for secret in _secrets_of(url):
        text = text.replace(secret, "***")
    return redact(text)
