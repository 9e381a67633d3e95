"""Raw HTTP on a socket for the proxy tests: what a well-behaved client library would never
send (bad framing, trickled heads), and reading what the server answers or when it closes."""

from __future__ import annotations

import socket
import time


def send_raw(url: str, data: bytes, read: bool = True) -> bytes:
    """Send ``data`` on a fresh connection; the whole answer (the server closes or 2 s pass)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed before reading it all: read the answer
        if not read:
            return b""
        s.settimeout(2)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
                if b"\r\n\r\n" in out and is_complete(out):
                    break
        except TimeoutError:
            pass
        return out


def is_complete(response: bytes) -> bool:
    head, _, body = response.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return False


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def until_closed(s: socket.socket, within: float) -> tuple[bytes, float]:
    """What the server sends until it closes the connection (at most ``within`` s), and when it
    closed (seconds from now; ``within`` if it did not)."""
    t0 = time.monotonic()
    out = b""
    while (left := within - (time.monotonic() - t0)) > 0:
        s.settimeout(left)
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            break
        except ConnectionResetError:
            return out, time.monotonic() - t0
        if not chunk:
            return out, time.monotonic() - t0
        out += chunk
    return out, within
