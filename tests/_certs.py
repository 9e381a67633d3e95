"""Test certificates made by the ``openssl`` CLI (the ``cryptography`` package is not a fleetgate
dependency): for TLS to Redis (tests/core/test_tls.py) and to a metrics server
(tests/coordinator/scrape/test_httpget.py)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote


@dataclass(frozen=True)
class Certs:
    """Paths of the test certificates; :meth:`query` is the ``rediss://`` query naming them."""

    dir: Path
    ca: Path
    server_crt: Path
    server_key: Path
    client_crt: Path
    client_key: Path
    other_ca: Path  # a CA that signed nothing of ours

    def query(self, *, client_cert: bool = False, ca: Path | None = None) -> str:
        parts = [f"ssl_ca_certs={quote(str(ca or self.ca))}"]
        if client_cert:
            parts += [
                f"ssl_certfile={quote(str(self.client_crt))}",
                f"ssl_keyfile={quote(str(self.client_key))}",
            ]
        return "&".join(parts)


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def make_certs(d: Path) -> Certs:
    """A CA, a server certificate for 127.0.0.1/localhost signed by it, a client certificate,
    and a second CA that signed nothing, made in ``d`` by the ``openssl`` CLI."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for ca in ("ca", "other-ca"):
        _openssl("req", "-x509", *ec, "-keyout", f"{ca}.key", "-out", f"{ca}.crt", "-days", "2",
                 "-subj", f"/CN=fleetgate-test-{ca}", cwd=d)  # fmt: skip
    (d / "server.ext").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"
    )
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for who in ("server", "client"):
        _openssl("req", *ec, "-keyout", f"{who}.key", "-out", f"{who}.csr",
                 "-subj", f"/CN=fleetgate-test-{who}", cwd=d)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{who}.crt", "-days", "2",
                 "-extfile", f"{who}.ext", cwd=d)  # fmt: skip
    return Certs(
        d, d / "ca.crt", d / "server.crt", d / "server.key",
        d / "client.crt", d / "client.key", d / "other-ca.crt",
    )  # fmt: skip
