"""A small PKI for TLS tests, made with the openssl CLI: a CA, a server certificate for
127.0.0.1 and localhost, a client certificate, and one from another CA."""

from __future__ import annotations

import subprocess
from pathlib import Path


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def issue(pki: Path, ca: str, name: str, subject: str, extensions: str) -> None:
    """`name`.key and `name`.crt, signed by `ca`."""
    (pki / f"{name}.ext").write_text(extensions)
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject, cwd=pki)  # fmt: skip
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
            "-CAcreateserial", "-out", f"{name}.crt", "-days", "2",
            "-extfile", f"{name}.ext", cwd=pki)  # fmt: skip


def make_ca(pki: Path, name: str) -> None:
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2",
            "-subj", f"/CN={name}", cwd=pki)  # fmt: skip


def make(pki: Path) -> Path:
    """In `pki`: ca.crt/key; server.crt/key for 127.0.0.1 and localhost; client.crt/key
    from ca; other-ca.crt/key and rogue.crt/key, a client certificate from other-ca."""
    make_ca(pki, "ca")
    make_ca(pki, "other-ca")
    issue(pki, "ca", "server", "/CN=localhost",
          "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")  # fmt: skip
    issue(pki, "ca", "client", "/CN=scraper", "extendedKeyUsage=clientAuth\n")
    issue(pki, "other-ca", "rogue", "/CN=rogue", "extendedKeyUsage=clientAuth\n")
    return pki
