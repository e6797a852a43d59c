"""Throwaway certificates for the TLS tests, made with the ``openssl`` command: two CAs, a
server certificate for 127.0.0.1/localhost and client certificates (valid two days)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

HAVE_OPENSSL = shutil.which("openssl") is not None


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(d: Path, name: str) -> None:
    openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
        "-keyout", f"{name}.key", "-out", f"{name}.pem", "-subj", f"/CN={name}",
        cwd=d,
    )  # fmt: skip


def make_leaf(d: Path, name: str, ca: str, san: str | None) -> None:
    openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key",
        "-out", f"{name}.csr", "-subj", f"/CN={name}",
        cwd=d,
    )  # fmt: skip
    ext = d / f"{name}.ext"
    ext.write_text(f"subjectAltName={san}\n" if san else "basicConstraints=CA:FALSE\n")
    openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
        "-CAcreateserial", "-days", "2", "-out", f"{name}.pem", "-extfile", ext.name,
        cwd=d,
    )  # fmt: skip


def make_pki(d: Path) -> Path:
    """``ca`` and ``other-ca``; ``server`` (127.0.0.1, localhost) and ``client``/``client2``
    of ``ca``; ``stranger`` and ``server2`` (the rotated one) of ``other-ca``."""
    make_ca(d, "ca")
    make_ca(d, "other-ca")
    make_leaf(d, "server", "ca", "IP:127.0.0.1,DNS:localhost")
    make_leaf(d, "client", "ca", None)
    make_leaf(d, "stranger", "other-ca", None)
    make_leaf(d, "server2", "other-ca", "IP:127.0.0.1,DNS:localhost")
    make_leaf(d, "client2", "ca", None)  # the same CA, another subject
    return d


def tls_args(pki: Path, *, client_ca: bool = False) -> list[str]:
    """``serve`` flags for the server certificate (and client certificates of ``ca``)."""
    args = ["--tls-cert-file", str(pki / "server.pem"), "--tls-key-file", str(pki / "server.key")]
    if client_ca:
        args += ["--tls-client-ca-file", str(pki / "ca.pem")]
    return args
