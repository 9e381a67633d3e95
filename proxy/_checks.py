"""The checks of a request's head before anything else is done for it (pure: no I/O).

:func:`refusal` says why a request is refused -- status, error type and message -- or None:

* 431: request line and headers above ``max_header_bytes``;
* 400: a target that is not a path (it is appended to the upstream's URL: ``GET @evil:80/x``
  named another host); ``.``/``..`` segments, with a path parameter too (``..;``: Tomcat and
  Spring resolve ``/v1/chat/..;/admin`` to ``/v1/admin``, so the proxy must not route it as
  ``/v1/chat``; the path is forwarded raw); a malformed or repeated ``Content-Length``, or one
  beside ``Transfer-Encoding`` (RFC 9112 6.3: the request-smuggling shape);
* 501: a transfer coding other than ``chunked`` alone (RFC 9112 6.1: the parser framed the body
  by its chunks and the other coding would be dropped, as httptools did with ``gzip, chunked``);
* 413: a declared ``Content-Length`` above ``max_request_bytes``;
* 508: a ``Via`` naming this proxy (``via_name``): the request has come back to it (an upstream
  URL pointing at the proxy, or at a load balancer in front of it), and would go round until a
  deadline or the file descriptors ran out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from .config import ProxySettings

__all__ = ["Refusal", "content_length", "refusal"]

Headers = Sequence[tuple[bytes, bytes]]


class Refusal(NamedTuple):
    status: int
    kind: str
    message: str
    close: bool = False  # the body's framing is not to be trusted: end the connection after


def refusal(scope: dict[str, Any], settings: ProxySettings, via_name: bytes) -> Refusal | None:
    headers: Headers = scope["headers"]
    path: str = scope["path"]
    raw_path: bytes = scope.get("raw_path") or path.encode()
    head = len(raw_path) + len(scope.get("query_string") or b"")
    head += sum(len(k) + len(v) + 4 for k, v in headers)
    if head > settings.max_header_bytes:
        msg = f"request line and headers exceed {settings.max_header_bytes} bytes"
        return Refusal(431, "headers_too_large", msg)
    if not raw_path.startswith(b"/") or not path.startswith("/"):
        return Refusal(400, "bad_request", "the request target must be a path starting with '/'")
    if has_dot_segment(path):
        return Refusal(400, "bad_request", "the path has '.' or '..' segments")
    codings = [
        c.strip().lower() for k, v in headers if k == b"transfer-encoding" for c in v.split(b",")
    ]
    try:
        declared = content_length(headers)
        if declared is not None and codings:
            raise ValueError("both Content-Length and Transfer-Encoding are given")
    except ValueError as exc:
        return Refusal(400, "bad_request", str(exc))
    if codings and codings != [b"chunked"]:
        shown = b", ".join(codings).decode("latin-1")[:100]
        msg = f"Transfer-Encoding {shown!r} is not supported: only 'chunked'"
        return Refusal(501, "not_implemented", msg, close=True)
    if declared is not None and declared > settings.max_request_bytes:
        return Refusal(413, "body_too_large", too_large_message(settings))
    if _names(headers, via_name):
        msg = "the request has come back to this proxy (its Via names it): a forwarding loop"
        return Refusal(508, "loop_detected", msg)
    return None


def too_large_message(settings: ProxySettings) -> str:
    return f"the request body exceeds {settings.max_request_bytes} bytes"


def has_dot_segment(path: str) -> bool:
    """``.`` or ``..`` as a segment, or before a segment's path parameter (``..;x``)."""
    return any(seg.partition(";")[0] in (".", "..") for seg in path.split("/"))


def content_length(headers: Headers) -> int | None:
    """The declared body length; ValueError when it is malformed or given with conflicting
    values (a request-smuggling shape)."""
    values = {v.strip() for k, v in headers if k == b"content-length"}
    if not values:
        return None
    if len(values) > 1:
        raise ValueError("conflicting Content-Length headers")
    (text,) = values
    if not text or len(text) > 18 or not text.isdigit():
        raise ValueError("Content-Length is not a number")
    return int(text)


def _names(headers: Headers, via_name: bytes) -> bool:
    """Whether a ``Via`` entry's received-by is ``via_name`` (RFC 9110 7.6.3:
    ``protocol received-by [comment]``)."""
    for k, v in headers:
        if k == b"via":
            for entry in v.split(b","):
                parts = entry.split()
                if len(parts) >= 2 and parts[1] == via_name:
                    return True
    return False
