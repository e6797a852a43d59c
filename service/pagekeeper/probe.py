"""The service's own health probe: ``python -m pagekeeper.probe``.

What the image's ``HEALTHCHECK``, docker-compose health checks and Kubernetes exec probes
run. It checks, each within ``--timeout`` seconds:

1. gRPC: ``grpc.health.v1.Health/Check`` of ``pagekeeper.v1.PagekeeperService`` answers
   ``SERVING`` (health checks need no token: the server exempts them);
2. the same-node socket, when the service has one (``server.local_socket``): a connection
   opens (with the token, if one is set) and answers ``GetPoolInfo`` (``--no-local`` skips it;
   a worker's container, which does not mount the socket, has nothing configured to check);
3. HTTP: ``GET /readyz`` answers 200 (the pool exists and both servers listen);
4. optionally, ``GET /v1/clients`` lists a live client named ``NAME`` (``--expect-client``,
   repeatable) or at least one client of a role (``--expect-role``): how a worker's
   container tells that *its* worker registered.

The addresses default to the service's own configuration, read exactly as ``pagekeeper
serve`` reads it (``--config`` / ``$PAGEKEEPER_CONFIG`` < ``PAGEKEEPER_*`` env < flags), with
wildcard listen hosts turned into loopback (``0.0.0.0:50051`` is probed at
``127.0.0.1:50051``), so inside the service's container the probe needs no argument.

Over TLS (the service's ``server.tls_cert_file``) the probe speaks TLS too, trusting
``--tls-ca-file`` (default ``$PAGEKEEPER_TLS_CA_FILE``, else the service's own certificate
file: enough for a self-signed certificate or a chain file that holds its CA). A service
that asks for client certificates needs ``--tls-cert-file`` and ``--tls-key-file`` (default
``$PAGEKEEPER_TLS_CLIENT_CERT_FILE`` / ``_KEY_FILE``). ``--tls-server-name`` names the
certificate's host when it is not the probed address's.

Exit status: 0 healthy, 1 unhealthy or unusable (bad flags or configuration). Never 2:
Docker reserves it. One line per check goes to stdout (Docker keeps it in the container's
health log); ``--quiet`` prints failures only.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import ssl
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from pagekeeper_client.client import ClientTLS

EXIT_HEALTHY = 0
EXIT_UNHEALTHY = 1

DEFAULT_TIMEOUT_S = 2.0
GRPC_SERVICE = "pagekeeper.v1.PagekeeperService"
"""The service name the server reports health for (besides the overall ``""``)."""

_WILDCARD_TO_LOOPBACK = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


@dataclass(frozen=True, slots=True)
class CheckResult:
    """The outcome of one check: what was checked, whether it passed, and why not."""

    name: str
    is_ok: bool
    detail: str
    elapsed_s: float

    def line(self) -> str:
        verdict = "ok" if self.is_ok else "FAIL"
        return f"{verdict} {self.name}: {self.detail} ({1e3 * self.elapsed_s:.1f} ms)"


@dataclass(frozen=True, slots=True)
class ProbeTargets:
    """Where and what to probe."""

    grpc_address: str | None
    """``HOST:PORT`` or ``unix:PATH``; None skips the gRPC check."""
    http_address: str | None
    """``HOST:PORT`` or ``unix:PATH``; None skips the HTTP checks."""
    token: str | None = None
    local_socket: str | None = None
    """The same-node socket's path; None skips its check."""
    expect_clients: tuple[str, ...] = ()
    expect_roles: tuple[str, ...] = ()
    timeout_s: float = DEFAULT_TIMEOUT_S
    tls: ClientTLS | None = None
    """TLS for the gRPC and HTTP checks (None: plaintext)."""


def connect_address(address: str) -> str:
    """The address to connect to for a listen address: wildcards become loopback.

    >>> connect_address("0.0.0.0:50051"), connect_address("[::]:8000")
    ('127.0.0.1:50051', '[::1]:8000')
    """
    if address.startswith("unix:"):
        return address
    host, sep, port = address.rpartition(":")
    if not sep:
        raise ValueError(f"not HOST:PORT or unix:PATH: {address!r}")
    bare = host.strip("[]")
    if bare in _WILDCARD_TO_LOOPBACK:
        bare = _WILDCARD_TO_LOOPBACK[bare]
    return f"[{bare}]:{port}" if ":" in bare else f"{bare}:{port}"


# -- gRPC ---------------------------------------------------------------------------------


def check_grpc(
    address: str,
    timeout_s: float,
    service: str = GRPC_SERVICE,
    tls: ClientTLS | None = None,
) -> CheckResult:
    """``Health/Check(service)`` must answer SERVING within ``timeout_s``."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    name = f"grpc{'s' if tls else ''} {address} health({service or '<server>'})"
    started = time.monotonic()
    try:
        channel = (
            grpc.insecure_channel(address)
            if tls is None
            else grpc.secure_channel(address, tls.credentials(), options=tls.channel_options())
        )
    except OSError as exc:
        detail = f"cannot read the TLS files: {exc}"
        return CheckResult(name, False, detail, time.monotonic() - started)
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
        is_ok = response.status == health_pb2.HealthCheckResponse.SERVING
        return CheckResult(name, is_ok, status, time.monotonic() - started)
    except grpc.RpcError as exc:
        code = exc.code().name if exc.code() is not None else "UNKNOWN"
        detail = f"{code}: {exc.details() or 'no details'}"
        return CheckResult(name, False, detail, time.monotonic() - started)
    finally:
        channel.close()


# -- HTTP ---------------------------------------------------------------------------------


class _UnixHTTPConnection(http.client.HTTPConnection):
    """``http.client`` over a unix socket (``--http-address unix:PATH``)."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class _HTTPSConnection(http.client.HTTPSConnection):
    """HTTPS that checks the certificate against ``server_name`` (default: the host)."""

    def __init__(
        self, host: str, port: int, timeout: float, context: ssl.SSLContext, server_name: str
    ) -> None:
        super().__init__(host, port, timeout=timeout, context=context)
        self._tls_context = context
        self._server_name = server_name

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)
        self.sock = self._tls_context.wrap_socket(self.sock, server_hostname=self._server_name)


def _ssl_context(tls: ClientTLS) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=tls.ca_file)
    if tls.cert_file is not None and tls.key_file is not None:
        context.load_cert_chain(tls.cert_file, tls.key_file)
    return context


def http_get(
    address: str,
    path: str,
    timeout_s: float,
    headers: Mapping[str, str] | None = None,
    tls: ClientTLS | None = None,
) -> tuple[int, bytes]:
    """``GET path`` on ``address`` (HTTPS with ``tls``); returns (status, body). Raises
    OSError on no answer (ssl.SSLError included)."""
    if address.startswith("unix:"):
        conn: http.client.HTTPConnection = _UnixHTTPConnection(address[len("unix:") :], timeout_s)
    else:
        host, _, port = address.rpartition(":")
        host = host.strip("[]")
        if tls is None:
            conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
        else:
            conn = _HTTPSConnection(
                host, int(port), timeout_s, _ssl_context(tls), tls.server_name or host
            )
    try:
        conn.request("GET", path, headers=dict(headers or {}))
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def check_local(path: str, timeout_s: float, token: str | None) -> CheckResult:
    """The same-node socket accepts a connection and answers ``GetPoolInfo``."""
    from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2 as pb
    from pagekeeper_client.errors import PagekeeperError
    from pagekeeper_client.local import LocalChannel

    name = f"local socket {path}"
    started = time.perf_counter()
    try:
        channel = LocalChannel(path, token=token, timeout=timeout_s)
        try:
            info = channel.call(
                "GetPoolInfo", pb.GetPoolInfoRequest(), pb.GetPoolInfoResponse, timeout_s
            )
        finally:
            channel.close()
    except PagekeeperError as exc:
        return CheckResult(name, False, exc.reason, time.perf_counter() - started)
    detail = f"answers (server {info.server_version}, {info.counters.num_free_pages} free pages)"
    return CheckResult(name, True, detail, time.perf_counter() - started)


def check_ready(address: str, timeout_s: float, tls: ClientTLS | None = None) -> CheckResult:
    """``GET /readyz`` must answer 200."""
    name = f"http{'s' if tls else ''} {address} /readyz"
    started = time.monotonic()
    try:
        status, body = http_get(address, "/readyz", timeout_s, tls=tls)
    except (OSError, http.client.HTTPException) as exc:
        return CheckResult(name, False, f"no answer: {exc}", time.monotonic() - started)
    detail = f"{status}" if status == 200 else f"{status}: {body[:200].decode(errors='replace')}"
    return CheckResult(name, status == 200, detail, time.monotonic() - started)


def check_clients(
    address: str,
    timeout_s: float,
    *,
    names: Sequence[str],
    roles: Sequence[str],
    token: str | None = None,
    tls: ClientTLS | None = None,
) -> CheckResult:
    """``GET /v1/clients`` must list a live client (lease not run out) for every name in
    ``names`` and at least one live client of every role in ``roles``."""
    name = f"http{'s' if tls else ''} {address} /v1/clients"
    started = time.monotonic()
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        status, body = http_get(address, "/v1/clients", timeout_s, headers, tls)
        if status != 200:
            detail = f"{status}: {body[:200].decode(errors='replace')}"
            return CheckResult(name, False, detail, time.monotonic() - started)
        clients: list[dict[str, Any]] = json.loads(body)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return CheckResult(name, False, f"no usable answer: {exc}", time.monotonic() - started)
    live = [c for c in clients if float(c.get("lease_remaining_s", 0.0)) > 0]
    live_names = {str(c.get("name")) for c in live}
    live_roles = {str(c.get("role")) for c in live}
    missing = [f"client {n!r}" for n in names if n not in live_names]
    missing += [f"a {r}" for r in roles if r not in live_roles]
    elapsed = time.monotonic() - started
    if missing:
        return CheckResult(name, False, "not registered: " + ", ".join(missing), elapsed)
    found = [f"client {n!r}" for n in names] + [f"a {r}" for r in roles]
    return CheckResult(name, True, "registered: " + ", ".join(found), elapsed)


# -- the probe ----------------------------------------------------------------------------


def run_checks(targets: ProbeTargets) -> list[CheckResult]:
    """Run every configured check once, in order, stopping at the first failure (a dead
    gRPC server makes the HTTP answers moot, and each check costs up to the timeout)."""
    results: list[CheckResult] = []
    if targets.grpc_address is not None:
        results.append(
            check_grpc(connect_address(targets.grpc_address), targets.timeout_s, tls=targets.tls)
        )
        if not results[-1].is_ok:
            return results
    if targets.local_socket is not None:
        results.append(check_local(targets.local_socket, targets.timeout_s, targets.token))
        if not results[-1].is_ok:
            return results
    if targets.http_address is not None:
        http_address = connect_address(targets.http_address)
        results.append(check_ready(http_address, targets.timeout_s, targets.tls))
        if not results[-1].is_ok:
            return results
        if targets.expect_clients or targets.expect_roles:
            results.append(
                check_clients(
                    http_address,
                    targets.timeout_s,
                    names=targets.expect_clients,
                    roles=targets.expect_roles,
                    token=targets.token,
                    tls=targets.tls,
                )
            )
    return results


def probe(
    targets: ProbeTargets, *, wait_s: float = 0.0, interval_s: float = 0.5
) -> tuple[bool, list[CheckResult]]:
    """Run the checks, again every ``interval_s`` until they all pass or ``wait_s`` runs
    out; returns (healthy, the last round's results)."""
    deadline = time.monotonic() + max(wait_s, 0.0)
    while True:
        results = run_checks(targets)
        is_healthy = bool(results) and all(r.is_ok for r in results)
        if is_healthy or time.monotonic() + interval_s > deadline:
            return is_healthy, results
        time.sleep(interval_s)


class _Parser(argparse.ArgumentParser):
    """argparse exits 2 on bad usage; Docker reserves 2, so a usage error is unhealthy."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_UNHEALTHY, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m pagekeeper.probe",
        description="Health probe of a pagekeeper service: gRPC health + HTTP /readyz "
        "(+ registered clients). Exit 0 healthy, 1 unhealthy.",
    )
    parser.add_argument(
        "--config", metavar="FILE", help="the service's TOML file (default $PAGEKEEPER_CONFIG)"
    )
    parser.add_argument(
        "--grpc-address",
        metavar="ADDR",
        help="HOST:PORT or unix:PATH (default: the service's configured gRPC address)",
    )
    parser.add_argument(
        "--http-address",
        metavar="ADDR",
        help="HOST:PORT or unix:PATH (default: the service's configured HTTP address)",
    )
    parser.add_argument("--no-grpc", action="store_true", help="skip the gRPC health check")
    parser.add_argument("--no-http", action="store_true", help="skip the HTTP checks")
    parser.add_argument("--no-local", action="store_true", help="skip the same-node socket check")
    parser.add_argument(
        "--expect-client",
        action="append",
        default=[],
        metavar="NAME",
        help="also require a live registered client with this name (repeatable)",
    )
    parser.add_argument(
        "--expect-role",
        action="append",
        default=[],
        choices=("scheduler", "worker"),
        help="also require at least one live client of this role (repeatable)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        metavar="S",
        help=f"seconds per check (default {DEFAULT_TIMEOUT_S})",
    )
    parser.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="S",
        help="retry until healthy or S seconds have passed (default: one try)",
    )
    parser.add_argument(
        "--tls-ca-file",
        metavar="FILE",
        help="PEM CAs to trust over TLS (default $PAGEKEEPER_TLS_CA_FILE, else the "
        "service's certificate file)",
    )
    parser.add_argument(
        "--tls-cert-file",
        metavar="FILE",
        help="client certificate, for a service that asks for one "
        "(default $PAGEKEEPER_TLS_CLIENT_CERT_FILE)",
    )
    parser.add_argument(
        "--tls-key-file",
        metavar="FILE",
        help="its private key (default $PAGEKEEPER_TLS_CLIENT_KEY_FILE)",
    )
    parser.add_argument(
        "--tls-server-name",
        metavar="NAME",
        help="the name the service's certificate is for, when not the probed host",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="print failures only")
    return parser


def targets_from_args(
    ns: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> ProbeTargets:
    """Resolve addresses and token the way ``pagekeeper serve`` resolves its settings."""
    from pagekeeper.auth import first_token
    from pagekeeper.settings import load_settings

    flags = {"server.grpc_address": ns.grpc_address, "server.http_address": ns.http_address}
    settings = load_settings(
        config_path=ns.config, environ=os.environ if environ is None else environ, flags=flags
    )
    if ns.timeout <= 0:
        raise ValueError(f"--timeout must be positive, got {ns.timeout}")
    if ns.no_http and (ns.expect_client or ns.expect_role):
        raise ValueError("--expect-client/--expect-role need the HTTP checks (drop --no-http)")
    return ProbeTargets(
        tls=_probe_tls(ns, settings.tls_cert_file, os.environ if environ is None else environ),
        grpc_address=None if ns.no_grpc else settings.grpc_address,
        http_address=None if ns.no_http else settings.http_address,
        token=first_token(settings),
        local_socket=None if ns.no_local else settings.local_socket,
        expect_clients=tuple(ns.expect_client),
        expect_roles=tuple(ns.expect_role),
        timeout_s=ns.timeout,
    )


def _probe_tls(
    ns: argparse.Namespace, service_cert_file: str | None, environ: Mapping[str, str]
) -> ClientTLS | None:
    """TLS when the service serves it or a CA file is named; flags over env over the
    service's own certificate file."""
    from pagekeeper_client.client import (
        TLS_CA_FILE_ENV,
        TLS_CLIENT_CERT_FILE_ENV,
        TLS_CLIENT_KEY_FILE_ENV,
        ClientTLS,
    )

    ca_file = ns.tls_ca_file or environ.get(TLS_CA_FILE_ENV) or service_cert_file
    if ca_file is None:
        return None
    return ClientTLS(
        ca_file=ca_file,
        cert_file=ns.tls_cert_file or environ.get(TLS_CLIENT_CERT_FILE_ENV) or None,
        key_file=ns.tls_key_file or environ.get(TLS_CLIENT_KEY_FILE_ENV) or None,
        server_name=ns.tls_server_name,
    )


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    from pagekeeper.core.errors import ConfigError

    try:
        targets = targets_from_args(ns)
    except ConfigError as exc:
        print(f"FAIL configuration: {exc.field}: {exc.reason}", flush=True)
        return EXIT_UNHEALTHY
    except ValueError as exc:
        print(f"FAIL usage: {exc}", flush=True)
        return EXIT_UNHEALTHY
    if targets.grpc_address is None and targets.http_address is None:
        print("FAIL usage: --no-grpc and --no-http leave nothing to check", flush=True)
        return EXIT_UNHEALTHY

    is_healthy, results = probe(targets, wait_s=ns.wait)
    for result in results:
        if not (ns.quiet and result.is_ok):
            print(result.line(), flush=True)
    return EXIT_HEALTHY if is_healthy else EXIT_UNHEALTHY


if __name__ == "__main__":
    sys.exit(main())
