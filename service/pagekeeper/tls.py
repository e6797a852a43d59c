"""TLS for the service's two listeners: loaded and checked at start-up, reloaded in place.

``server.tls_cert_file`` + ``server.tls_key_file`` serve gRPC and HTTP over TLS with one
certificate; ``server.tls_client_ca_file`` also makes gRPC clients present a certificate
signed by one of its CAs (mutual TLS). HTTP never asks for a client certificate: probes and
Prometheus scrapers have none, and its mutations keep their bearer tokens.

Every file is read and checked before the service binds anything or touches its data
directory: a missing file, a key that is not the certificate's, or a CA file with no
certificate is a :class:`~pagekeeper.core.errors.ConfigError` naming the field, which
``pagekeeper serve`` prints as one line.

Rotation: :meth:`ServerTLS.reload_if_changed` (the server calls it every
:data:`RELOAD_INTERVAL_S` and on SIGHUP) re-reads the files when one changed (its size,
modification time or inode: a rename into place or a Kubernetes secret's symlink swap
count) and, once they pass the same checks, new connections get the new certificate and CA
on both listeners. Connections already open keep theirs. Files that do not pass (a
rotation caught between writing the certificate and its key) leave the old ones serving
and are tried again once they change.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import grpc

from pagekeeper.core.errors import ConfigError
from pagekeeper.files import FileStamp, file_stamp
from pagekeeper.settings import Settings

RELOAD_INTERVAL_S = 10.0
"""How often the server looks for rotated certificate files (SIGHUP: at once)."""

_Stamp = tuple[FileStamp | None, ...]


def _stamp(paths: tuple[str | None, ...]) -> _Stamp:
    """Each file's :func:`~pagekeeper.files.file_stamp` (None where it is not configured or
    cannot be stat'ed)."""
    return tuple(None if path is None else file_stamp(path) for path in paths)


def _der_item(der: bytes, at: int) -> tuple[int, int, int]:
    """(tag, start of its content, end of its content) of the DER item at ``at``."""
    if at + 2 > len(der):
        raise ValueError("DER item cut short")
    tag, first = der[at], der[at + 1]
    at += 2
    if first < 0x80:
        length = first
    else:
        size = first & 0x7F
        if not 1 <= size <= 4:
            raise ValueError("unsupported DER length")
        length = int.from_bytes(der[at : at + size], "big")
        at += size
    if at + length > len(der):
        raise ValueError("DER item runs past the end")
    return tag, at, at + length


def certificate_not_after(pem: bytes) -> float:
    """When the first certificate of ``pem`` expires (a Unix timestamp): its X.509
    validity's notAfter. Raises ValueError when it cannot be read."""
    der = ssl.PEM_cert_to_DER_cert(pem.decode("ascii"))
    _, start, _ = _der_item(der, 0)  # Certificate ::= SEQUENCE
    tag, at, _ = _der_item(der, start)  # tbsCertificate ::= SEQUENCE
    if tag != 0x30:
        raise ValueError("not an X.509 certificate")
    fields = []
    while len(fields) < 5:
        tag, content, end = _der_item(der, at)
        if not fields and tag == 0xA0:  # [0] version: optional
            at = end
            continue
        fields.append((tag, content, end))
        at = end
    # serialNumber, signature, issuer, validity, ...: validity is the fourth.
    tag, content, _ = fields[3]
    _, begin, end = _der_item(der, content)  # notBefore
    tag, begin, end = _der_item(der, end)  # notAfter
    text = der[begin:end].decode("ascii")
    if tag == 0x17:  # UTCTime YYMMDDHHMMSSZ (years 1950-2049)
        year = int(text[:2])
        text = f"{1900 + year if year >= 50 else 2000 + year}{text[2:]}"
    elif tag != 0x18:  # GeneralizedTime YYYYMMDDHHMMSSZ
        raise ValueError("unknown time type in the certificate's validity")
    when = datetime.strptime(text, "%Y%m%d%H%M%SZ").replace(tzinfo=UTC)
    return when.timestamp()


def _read(field: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(field, f"cannot read {path}: {exc.strerror or exc}") from None


@dataclass(frozen=True, slots=True)
class _Material:
    cert_chain: bytes
    private_key: bytes
    client_ca: bytes | None
    stamp: _Stamp
    http: ssl.SSLContext
    """The HTTP listener's context for this pair (the one that checked it)."""
    not_after: float | None
    """When the certificate expires (Unix time; None if it cannot be read)."""


def _load(cert_file: str, key_file: str, client_ca_file: str | None) -> _Material:
    """Read and check the files (ConfigError naming the field when one does not pass)."""
    stamp = _stamp((cert_file, key_file, client_ca_file))
    cert = _read("server.tls_cert_file", cert_file)
    key = _read("server.tls_key_file", key_file)
    if b"-----BEGIN CERTIFICATE-----" not in cert:
        raise ConfigError("server.tls_cert_file", f"{cert_file} holds no PEM certificate")
    if b"PRIVATE KEY-----" not in key:
        raise ConfigError("server.tls_key_file", f"{key_file} holds no PEM private key")
    http = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)  # asks for no client certificate
    try:
        http.load_cert_chain(cert_file, key_file)  # checks the pair
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(
            "server.tls_key_file",
            f"{key_file} is not the private key of {cert_file} "
            f"({getattr(exc, 'reason', None) or exc})",
        ) from None
    client_ca = None
    if client_ca_file is not None:
        client_ca = _read("server.tls_client_ca_file", client_ca_file)
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_verify_locations(
                cadata=client_ca.decode("ascii")
            )
        except (ssl.SSLError, UnicodeDecodeError, ValueError) as exc:
            raise ConfigError(
                "server.tls_client_ca_file",
                f"{client_ca_file} holds no readable PEM CA certificate ({exc})",
            ) from None
    try:
        not_after: float | None = certificate_not_after(cert)
    except ValueError:
        not_after = None
    return _Material(cert, key, client_ca, stamp, http, not_after)


def _grpc_configuration(material: _Material) -> Any:
    return grpc.ssl_server_certificate_configuration(
        [(material.private_key, material.cert_chain)], root_certificates=material.client_ca
    )


class ServerTLS:
    """The certificate, key and (optional) client CA bundle both listeners serve; see the
    module docstring for rotation."""

    def __init__(self, cert_file: str, key_file: str, client_ca_file: str | None = None) -> None:
        self.cert_file = cert_file
        self.key_file = key_file
        self.client_ca_file = client_ca_file
        self._material = _load(cert_file, key_file, client_ca_file)
        self._failed_stamp: _Stamp | None = None
        # A new gRPC configuration waiting for the next connection's handshake.
        self._pending_grpc: Any = None
        # The context uvicorn holds: the first pair's, switching each handshake to the
        # current pair's.
        self._front_http: ssl.SSLContext | None = None
        self.num_reloads = 0

    @property
    def requires_client_certificates(self) -> bool:
        return self.client_ca_file is not None

    @property
    def cert_chain(self) -> bytes:
        return self._material.cert_chain

    @property
    def not_after(self) -> float | None:
        """When the served certificate expires (Unix time; None if it cannot be read)."""
        return self._material.not_after

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """Credentials whose certificate follows :meth:`reload_if_changed` (gRPC asks for a
        replacement before each new connection's handshake: an attribute read)."""
        return grpc.dynamic_ssl_server_credentials(
            _grpc_configuration(self._material),
            self._take_pending_grpc,
            require_client_authentication=self.requires_client_certificates,
        )

    def _take_pending_grpc(self) -> Any:
        pending, self._pending_grpc = self._pending_grpc, None
        return pending

    def http_context(self) -> ssl.SSLContext:
        """The HTTP listener's context (no client certificate asked). Each handshake
        switches to the newest loaded context in its server-name callback (which OpenSSL
        runs whether or not the client sent a name), so a reload swaps whole contexts: a
        certificate never meets another's key."""
        if self._front_http is None:
            front = self._material.http
            front.sni_callback = self._pick_http_context
            self._front_http = front
        return self._front_http

    def _pick_http_context(
        self, connection: Any, server_name: str | None, context: ssl.SSLContext
    ) -> None:
        current = self._material.http
        if current is not context:
            connection.context = current

    def uvicorn_options(self) -> dict[str, Any]:
        """``uvicorn.Config`` arguments: :meth:`http_context` as its SSL context."""
        return {"ssl_context_factory": lambda config, default_factory: self.http_context()}

    def reload_if_changed(self) -> bool:
        """Re-read the files if one changed since they were loaded; True when new
        certificates now serve new connections. Raises ConfigError (the old ones keep
        serving) when changed files do not pass, once per change."""
        paths = (self.cert_file, self.key_file, self.client_ca_file)
        stamp = _stamp(paths)
        if stamp == self._material.stamp or stamp == self._failed_stamp:
            return False
        try:
            material = _load(self.cert_file, self.key_file, self.client_ca_file)
        except ConfigError:
            self._failed_stamp = stamp
            raise
        self._material = material
        self._failed_stamp = None
        self._pending_grpc = _grpc_configuration(material)
        self.num_reloads += 1
        return True


def load_server_tls(settings: Settings) -> ServerTLS | None:
    """The TLS material ``settings`` names, checked (None when TLS is off)."""
    if settings.tls_cert_file is None or settings.tls_key_file is None:
        return None
    return ServerTLS(settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file)


__all__ = ["RELOAD_INTERVAL_S", "ServerTLS", "certificate_not_after", "load_server_tls"]
