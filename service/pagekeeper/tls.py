"""TLS for the service's two listeners, loaded and checked once at start-up.

``server.tls_cert_file`` + ``server.tls_key_file`` serve gRPC and HTTP over TLS with one
certificate; ``server.tls_client_ca_file`` also makes gRPC clients present a certificate
signed by one of its CAs (mutual TLS). HTTP never asks for a client certificate: probes and
Prometheus scrapers have none, and its mutations keep their bearer tokens.

Every file is read and checked here, before the service binds anything or touches its data
directory: a missing file, a key that is not the certificate's, or a CA file with no
certificate is a :class:`~pagekeeper.core.errors.ConfigError` naming the field, which
``pagekeeper serve`` prints as one line.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Any

import grpc

from pagekeeper.core.errors import ConfigError
from pagekeeper.settings import Settings


@dataclass(frozen=True, slots=True)
class ServerTLS:
    """The PEM bytes of a checked certificate, key and (optional) client CA bundle."""

    cert_file: str
    key_file: str
    client_ca_file: str | None
    cert_chain: bytes
    private_key: bytes
    client_ca: bytes | None

    @property
    def requires_client_certificates(self) -> bool:
        return self.client_ca is not None

    def grpc_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)],
            root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None,
        )

    def uvicorn_options(self) -> dict[str, Any]:
        """``uvicorn.Config`` arguments: the same certificate, no client certificate."""
        return {"ssl_certfile": self.cert_file, "ssl_keyfile": self.key_file}


def _read(field: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(field, f"cannot read {path}: {exc.strerror or exc}") from None


def load_server_tls(settings: Settings) -> ServerTLS | None:
    """The TLS material ``settings`` names, checked (None when TLS is off)."""
    if settings.tls_cert_file is None or settings.tls_key_file is None:
        return None
    cert = _read("server.tls_cert_file", settings.tls_cert_file)
    key = _read("server.tls_key_file", settings.tls_key_file)
    if b"-----BEGIN CERTIFICATE-----" not in cert:
        raise ConfigError(
            "server.tls_cert_file", f"{settings.tls_cert_file} holds no PEM certificate"
        )
    if b"PRIVATE KEY-----" not in key:
        raise ConfigError(
            "server.tls_key_file", f"{settings.tls_key_file} holds no PEM private key"
        )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(settings.tls_cert_file, settings.tls_key_file)
    except ssl.SSLError as exc:
        raise ConfigError(
            "server.tls_key_file",
            f"{settings.tls_key_file} is not the private key of {settings.tls_cert_file} "
            f"({exc.reason or exc})",
        ) from None
    client_ca = None
    if settings.tls_client_ca_file is not None:
        client_ca = _read("server.tls_client_ca_file", settings.tls_client_ca_file)
        try:
            context.load_verify_locations(cadata=client_ca.decode("ascii"))
        except (ssl.SSLError, UnicodeDecodeError, ValueError) as exc:
            raise ConfigError(
                "server.tls_client_ca_file",
                f"{settings.tls_client_ca_file} holds no readable PEM CA certificate ({exc})",
            ) from None
    return ServerTLS(
        settings.tls_cert_file,
        settings.tls_key_file,
        settings.tls_client_ca_file,
        cert,
        key,
        client_ca,
    )


__all__ = ["ServerTLS", "load_server_tls"]
