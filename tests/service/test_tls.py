"""TLS on both listeners, mutual TLS on gRPC, and the errors a bad TLS setting gets.

Certificates are made per session with the ``openssl`` command line (a CA, a server
certificate for 127.0.0.1 and localhost, a client certificate of that CA and one of another
CA); the real server runs as a subprocess on ephemeral loopback ports.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import signal
import sqlite3
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from pagekeeper.core.errors import ConfigError
from pagekeeper.probe import main as probe_main
from pagekeeper.settings import Settings, load_settings
from pagekeeper.tls import ServerTLS, certificate_not_after, load_server_tls
from pagekeeper_client import (
    AsyncPagekeeperClient,
    ClientTLS,
    PagekeeperClient,
    PermissionDeniedError,
    UnavailableError,
    register_worker,
)
from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2 as pb
from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2_grpc as pb_grpc
from pagekeeper_client.client import resolve_tls
from pagekeeper_client.local import LocalChannel
from tests.helpers.pki import HAVE_OPENSSL, make_pki, openssl, tls_args
from tests.helpers.server import ROOT, RunningServer, clean_env, launch

pytestmark = pytest.mark.skipif(not HAVE_OPENSSL, reason="needs openssl")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_server(pki: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    server = launch(tmp_path_factory.mktemp("tls"), *tls_args(pki), "--num-pages", "64")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def mtls_server(pki: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    server = launch(
        tmp_path_factory.mktemp("mtls"), *tls_args(pki, client_ca=True), "--num-pages", "64"
    )
    try:
        yield server
    finally:
        server.stop()


def _https_get(server: RunningServer, path: str, cafile: Path) -> tuple[int, dict]:
    context = ssl.create_default_context(cafile=str(cafile))
    with urllib.request.urlopen(
        f"https://{server.http_address}{path}", context=context, timeout=10
    ) as response:
        return response.status, json.loads(response.read())


def _step_once(client: PagekeeperClient) -> None:
    client.register("scheduler", name="tls-test")
    admitted = client.admit("r1", list(range(40)))
    assert admitted.num_cached_tokens == 0
    client.step()
    assert client.block_table("r1").page_ids.size == 3
    client.free_later("r1")
    client.step()


# -- TLS ----------------------------------------------------------------------------------


def test_a_tls_server_serves_grpc_and_https_to_clients_that_trust_its_ca(
    tls_server: RunningServer, pki: Path
) -> None:
    assert tls_server.info["tls"] is True
    with PagekeeperClient(
        tls_server.grpc_address, tls=ClientTLS(ca_file=str(pki / "ca.pem")), local_socket=None
    ) as client:
        _step_once(client)
    status, pool = _https_get(tls_server, "/v1/pool", pki / "ca.pem")
    assert status == 200
    assert pool["steps"]["num_steps"] >= 2
    expires = certificate_not_after((pki / "server.pem").read_bytes())
    assert pool["tls"] == {
        "enabled": True,
        "client_certificates": False,
        "cert_file": str(pki / "server.pem"),
        "expires_at": expires,
        "num_reloads": 0,
    }
    status, _ = _https_get(tls_server, "/readyz", pki / "ca.pem")
    assert status == 200
    assert "over TLS" in tls_server.logs()


def test_the_async_client_speaks_tls_too(tls_server: RunningServer, pki: Path) -> None:
    async def run() -> int:
        async with AsyncPagekeeperClient(
            tls_server.grpc_address, tls=ClientTLS(ca_file=str(pki / "ca.pem"))
        ) as client:
            info = await client.pool_info()
            return info.counters.num_free_pages

    assert asyncio.run(run()) > 0


def test_plaintext_and_untrusting_clients_are_not_served(
    tls_server: RunningServer, pki: Path
) -> None:
    plain = PagekeeperClient(tls_server.grpc_address, tls=False, timeout=3, retry_s=0)
    with plain, pytest.raises(UnavailableError):
        plain.pool_info()
    # A CA that did not sign the server's certificate: the handshake fails.
    untrusting = PagekeeperClient(
        tls_server.grpc_address,
        tls=ClientTLS(ca_file=str(pki / "other-ca.pem")),
        timeout=3,
        retry_s=0,
    )
    with untrusting, pytest.raises(UnavailableError):
        untrusting.pool_info()
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        urllib.request.urlopen(f"http://{tls_server.http_address}/readyz", timeout=5).read()


def test_a_certificate_for_another_name_is_checked_against_server_name(
    tls_server: RunningServer, pki: Path
) -> None:
    port = tls_server.grpc_address.rpartition(":")[2]
    # "localhost" is in the certificate: reached by that name, or by IP with the override.
    tls = ClientTLS(ca_file=str(pki / "ca.pem"), server_name="localhost")
    with PagekeeperClient(f"127.0.0.1:{port}", tls=tls, local_socket=None) as client:
        assert client.pool_info().counters.num_free_pages > 0
    wrong = ClientTLS(ca_file=str(pki / "ca.pem"), server_name="elsewhere.example")
    mismatched = PagekeeperClient(f"127.0.0.1:{port}", tls=wrong, timeout=3, retry_s=0)
    with mismatched, pytest.raises(UnavailableError):
        mismatched.pool_info()


def test_the_probe_speaks_tls(tls_server: RunningServer, pki: Path, capsys) -> None:
    args = ["--grpc-address", tls_server.grpc_address, "--http-address", tls_server.http_address]
    assert probe_main([*args, "--tls-ca-file", str(pki / "ca.pem")]) == 0
    out = capsys.readouterr().out
    assert "ok grpcs" in out and "ok https" in out
    # Trusting the wrong CA is unhealthy, with the reason on the line.
    assert probe_main([*args, "--tls-ca-file", str(pki / "other-ca.pem")]) == 1
    assert "FAIL grpcs" in capsys.readouterr().out


# -- mutual TLS ---------------------------------------------------------------------------


def test_mutual_tls_serves_only_clients_with_a_certificate_of_its_ca(
    mtls_server: RunningServer, pki: Path
) -> None:
    ca = str(pki / "ca.pem")
    with PagekeeperClient(
        mtls_server.grpc_address,
        tls=ClientTLS(ca, str(pki / "client.pem"), str(pki / "client.key")),
        local_socket=None,
    ) as client:
        _step_once(client)
    for tls in (
        ClientTLS(ca),  # no certificate
        ClientTLS(ca, str(pki / "stranger.pem"), str(pki / "stranger.key")),  # another CA's
    ):
        refused = PagekeeperClient(mtls_server.grpc_address, tls=tls, timeout=3, retry_s=0)
        with refused, pytest.raises(UnavailableError):
            refused.pool_info()
    # HTTP asks for no client certificate: probes and scrapers have none.
    status, _ = _https_get(mtls_server, "/readyz", pki / "ca.pem")
    assert status == 200
    assert "gRPC clients need a certificate" in mtls_server.logs()
    assert "valid until 20" in mtls_server.logs()


def test_the_probe_presents_a_client_certificate(
    mtls_server: RunningServer, pki: Path, capsys
) -> None:
    args = [
        "--grpc-address", mtls_server.grpc_address, "--http-address", mtls_server.http_address,
        "--tls-ca-file", str(pki / "ca.pem"),
    ]  # fmt: skip
    assert probe_main(args) == 1  # no client certificate
    capsys.readouterr()
    client_cert = ["--tls-cert-file", str(pki / "client.pem")]
    assert probe_main([*args, *client_cert, "--tls-key-file", str(pki / "client.key")]) == 0
    assert probe_main([*args, *client_cert]) == 1  # a certificate without its key
    assert "FAIL usage" in capsys.readouterr().out


def test_a_worker_reads_its_tables_over_the_mutual_tls_stream(
    mtls_server: RunningServer, pki: Path
) -> None:
    """The cross-host path: no ring, the WatchTables stream, both ends with certificates."""
    tls = ClientTLS(str(pki / "ca.pem"), str(pki / "client.pem"), str(pki / "client.key"))
    with (
        register_worker(mtls_server.grpc_address, "cpu", {0: [8]}, tls=tls) as worker,
        PagekeeperClient(mtls_server.grpc_address, tls=tls, local_socket=None) as scheduler,
    ):
        assert worker.view.kind == "stream"
        scheduler.register("scheduler", name="mtls-scheduler")
        scheduler.admit("w1", list(range(100, 140)))
        step = scheduler.step(batch=["w1"])
        tables = worker.view.wait(step.step_id, timeout=10)
        pages = scheduler.page_ids("w1").tolist()
        assert len(pages) == 3
        table = tables.table(0)
        assert table.kernel_block_size == 8
        # Page p is kernel blocks 2p, 2p+1 at kernel block size 8 (page size 16).
        want = [b for p in pages for b in (2 * p, 2 * p + 1)]
        assert table.block_table[0, : len(want)].tolist() == want
        assert table.slot_mapping.tolist() == [16 * pages[t // 16] + t % 16 for t in range(40)]
        scheduler.free_later("w1")
        scheduler.step()


def _raw_stub(server_address: str, pki: Path, name: str) -> tuple[grpc.Channel, Any]:
    creds = grpc.ssl_channel_credentials(
        (pki / "ca.pem").read_bytes(),
        (pki / f"{name}.key").read_bytes(),
        (pki / f"{name}.pem").read_bytes(),
    )
    channel = grpc.secure_channel(server_address, creds)
    return channel, pb_grpc.PagekeeperServiceStub(channel)


def test_with_mutual_tls_a_registration_is_bound_to_its_certificate_across_restarts(
    pki: Path, tmp_path: Path
) -> None:
    """Another certificate of the same CA cannot step, renew, take over, unregister or
    watch the tables of a client registered with the first; the binding is journaled and
    snapshotted."""
    args = [*tls_args(pki, client_ca=True), "--num-pages", "64", "--lease-ttl-s", "60"]
    workdir = tmp_path / "srv"
    server = launch(workdir, *args)
    try:
        channel, owner = _raw_stub(server.grpc_address, pki, "client")
        reg = owner.RegisterClient(pb.RegisterClientRequest(role=pb.CLIENT_ROLE_SCHEDULER))
        client_id, generation = reg.client_id, reg.generation
        tokens = np.arange(40, dtype="<i4").tobytes()
        owner.Step(
            pb.StepRequest(
                client_id=client_id,
                generation=generation,
                step_id=1,
                admissions=[pb.Admission(request_id="mine", token_ids=tokens)],
            )
        )
        channel.close()
        _, clients = _https_get(server, "/v1/clients", pki / "ca.pem")
        assert {c["client_id"]: c["identity"] for c in clients}[client_id] == "client"

        def assert_refused_to_the_other_certificate(generation: int) -> None:
            channel, stub = _raw_stub(server.grpc_address, pki, "client2")
            calls = [
                lambda: stub.Step(
                    pb.StepRequest(
                        client_id=client_id,
                        generation=generation,
                        step_id=1000,
                        free_request_ids=["mine"],
                    )
                ),
                lambda: stub.Heartbeat(
                    pb.HeartbeatRequest(client_id=client_id, generation=generation)
                ),
                lambda: stub.Unregister(
                    pb.UnregisterRequest(client_id=client_id, generation=generation)
                ),
                lambda: stub.RegisterClient(
                    pb.RegisterClientRequest(role=pb.CLIENT_ROLE_SCHEDULER, client_id=client_id)
                ),
                lambda: next(
                    iter(
                        stub.WatchTables(
                            pb.WatchTablesRequest(client_id=client_id, generation=generation),
                            timeout=10,
                        )
                    )
                ),
            ]
            try:
                for call in calls:
                    with pytest.raises(grpc.RpcError) as exc:
                        call()
                    assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED
                    assert "bound to certificate 'client'" in exc.value.details()
                # Its own registration works: the certificate is good, the client is not its.
                own = stub.RegisterClient(pb.RegisterClientRequest(role=pb.CLIENT_ROLE_SCHEDULER))
                assert own.client_id != client_id
            finally:
                channel.close()
            _, requests = _https_get(server, "/v1/requests/mine", pki / "ca.pem")
            assert requests["num_tokens"] == 40  # nothing changed

        assert_refused_to_the_other_certificate(generation)
        # Killed (the journal replays the registration), then stopped (the snapshot has it).
        for how in (signal.SIGKILL, signal.SIGTERM):
            server.stop(how)
            server = launch(workdir, *args)
            assert_refused_to_the_other_certificate(generation)
        # The owner's own certificate takes its registration over after the restarts.
        channel, stub = _raw_stub(server.grpc_address, pki, "client")
        try:
            again = stub.RegisterClient(
                pb.RegisterClientRequest(role=pb.CLIENT_ROLE_SCHEDULER, client_id=client_id)
            )
            assert again.generation == generation + 1
        finally:
            channel.close()
    finally:
        server.stop()
    # The data dir holds a bound registration: format 4 at least, which a pagekeeper
    # reading only formats 1-3 refuses instead of dropping that record as damage (5: the
    # service also reserved journal space ahead, which a reader of 1-4 refuses too).
    db = sqlite3.connect(workdir / "data" / "pagekeeper.db")
    try:
        assert db.execute("SELECT value FROM meta WHERE key = 'format_version'").fetchone() == (
            "5",
        )
    finally:
        db.close()


def test_with_mutual_tls_the_same_node_socket_needs_the_registrations_ticket(
    pki: Path, tmp_path: Path
) -> None:
    """The socket carries no certificate: a call there for a client bound to one needs the
    ticket its registration returned, sent in the hello. The client does that by itself
    (its steps go over the socket); a connection without the ticket, or with another
    client's, gets PERMISSION_DENIED for Step, Heartbeat and Unregister, and nothing
    changes; registering over the socket is refused; the ticket outlives a restart."""
    sock = tmp_path / "run" / "pk.sock"
    args = [*tls_args(pki, client_ca=True), "--num-pages", "64", "--local-socket", str(sock)]
    workdir = tmp_path / "srv"
    server = launch(workdir, *args)

    def tls_of(name: str) -> ClientTLS:
        return ClientTLS(str(pki / "ca.pem"), str(pki / f"{name}.pem"), str(pki / f"{name}.key"))

    owner = PagekeeperClient(server.grpc_address, tls=tls_of("client"))
    other = PagekeeperClient(server.grpc_address, tls=tls_of("client2"))
    try:
        mine = owner.register("scheduler", name="owner", renew=False)
        theirs = other.register("scheduler", name="other", renew=False)
        assert mine.local_ticket and theirs.local_ticket
        assert mine.local_ticket != theirs.local_ticket
        owner.admit("mine", list(range(40)))
        owner.step()
        assert owner.transport == "local" and owner.stats.num_local_calls >= 1

        async def async_owner() -> tuple[str, int]:
            async with AsyncPagekeeperClient(server.grpc_address, tls=tls_of("client")) as c:
                reg = await c.register("scheduler", name="async", renew=False)
                await c.admit("async-r", list(range(20)))
                await c.step()
                return c.transport, len(reg.local_ticket)

        assert asyncio.run(async_owner()) == ("local", 64)
        # A socket named up front is opened before registering: reopened with the ticket.
        with PagekeeperClient(
            server.grpc_address, tls=tls_of("client"), local_socket=str(sock)
        ) as named:
            named.register("scheduler", name="named", renew=False)
            named.admit("named-r", list(range(20)))
            named.step()
            assert named.transport == "local" and named.stats.num_local_calls >= 1
        step_id = 1000

        def over_socket(ticket: tuple[str, str] | None) -> None:
            nonlocal step_id
            step_id += 1
            channel = LocalChannel(str(sock), timeout=10, ticket=ticket)
            calls = {
                "Step": pb.StepRequest(
                    client_id=mine.client_id,
                    generation=mine.generation,
                    step_id=step_id,
                    free_request_ids=["mine"],
                ),
                "Heartbeat": pb.HeartbeatRequest(
                    client_id=mine.client_id, generation=mine.generation
                ),
                "Unregister": pb.UnregisterRequest(
                    client_id=mine.client_id, generation=mine.generation
                ),
            }
            answers = {
                "Step": pb.StepResponse,
                "Heartbeat": pb.HeartbeatResponse,
                "Unregister": pb.UnregisterResponse,
            }
            try:
                for method, request in calls.items():
                    with pytest.raises(PermissionDeniedError, match="did not open with its ticket"):
                        channel.call(method, request, answers[method], 10.0)
                with pytest.raises(PermissionDeniedError, match="registers over gRPC"):
                    channel.call(
                        "RegisterClient",
                        pb.RegisterClientRequest(
                            role=pb.CLIENT_ROLE_SCHEDULER, client_id=mine.client_id
                        ),
                        pb.RegisterClientResponse,
                        10.0,
                    )
            finally:
                channel.close()
            _, request = _https_get(server, "/v1/requests/mine", pki / "ca.pem")
            assert request["num_tokens"] == 40  # nothing changed
            _, clients = _https_get(server, "/v1/clients", pki / "ca.pem")
            assert {c["client_id"]: c["generation"] for c in clients}[mine.client_id] == 1

        over_socket(None)
        over_socket((mine.client_id, theirs.local_ticket))  # another client's ticket
        over_socket((theirs.client_id, theirs.local_ticket))  # its own id: not this client
        altered = mine.local_ticket[:-1] + ("1" if mine.local_ticket.endswith("0") else "0")
        over_socket((mine.client_id, altered))

        # Killed and started again: the recovered registration's ticket opens the socket.
        server.stop(signal.SIGKILL)
        server = launch(workdir, *args)
        channel = LocalChannel(str(sock), timeout=10, ticket=(mine.client_id, mine.local_ticket))
        try:
            step_id += 1
            channel.call(
                "Step",
                pb.StepRequest(
                    client_id=mine.client_id,
                    generation=mine.generation,
                    step_id=step_id,
                    free_request_ids=["mine"],
                ),
                pb.StepResponse,
                10.0,
            )
        finally:
            channel.close()
        with pytest.raises(urllib.error.HTTPError) as gone:
            _https_get(server, "/v1/requests/mine", pki / "ca.pem")
        assert gone.value.code == 404  # freed by that step
    finally:
        owner.close()
        other.close()
        server.stop()


# -- rotation -----------------------------------------------------------------------------


def _replace(src: Path, dst: Path) -> None:
    """Copy ``src`` over ``dst`` as a rotation does: a new file renamed into place."""
    tmp = dst.with_suffix(".new")
    shutil.copyfile(src, tmp)
    tmp.replace(dst)


def _served_by(server: RunningServer, cafile: Path) -> bool:
    """Whether a new gRPC connection that trusts only ``cafile`` gets served."""
    tls = ClientTLS(ca_file=str(cafile))
    client = PagekeeperClient(server.grpc_address, tls=tls, timeout=3, retry_s=0)
    try:
        client.pool_info()
        return True
    except UnavailableError:
        return False
    finally:
        client.close()


def _https_ok(server: RunningServer, cafile: Path) -> bool:
    try:
        return _https_get(server, "/readyz", cafile)[0] == 200
    except (urllib.error.URLError, ssl.SSLError, ConnectionError):
        return False


def _metric(
    server: RunningServer, cafile: Path, result: str, name: str = "pagekeeper_tls_reloads_total"
) -> float | None:
    context = ssl.create_default_context(cafile=str(cafile))
    url = f"https://{server.http_address}/metrics"
    with urllib.request.urlopen(url, context=context, timeout=10) as response:
        text = response.read().decode()
    series = f'{name}{{result="{result}"}} ' if result else f"{name} "
    for line in text.splitlines():
        if line.startswith(series):
            return float(line.split()[-1])
    return None


def test_rotated_certificates_serve_new_connections_after_sighup(pki: Path, tmp_path: Path) -> None:
    live = tmp_path / "certs"
    live.mkdir()
    for name in ("server.pem", "server.key"):
        shutil.copyfile(pki / name, live / name)
    args = ["--tls-cert-file", str(live / "server.pem"), "--tls-key-file", str(live / "server.key")]
    server = launch(tmp_path / "srv", *args, "--num-pages", "32")
    try:
        old_ca, new_ca = pki / "ca.pem", pki / "other-ca.pem"
        assert _served_by(server, old_ca) and not _served_by(server, new_ca)
        # Both results are series from the start, at 0 (a rate() needs them to exist).
        assert _metric(server, old_ca, "loaded") == _metric(server, old_ca, "failed") == 0.0
        # A connection opened before the rotation keeps working after it.
        kept = PagekeeperClient(server.grpc_address, tls=ClientTLS(str(old_ca)), local_socket=None)
        kept.pool_info()

        # A half-done rotation (new certificate, old key): refused, the old pair serves on.
        _replace(pki / "server2.pem", live / "server.pem")
        server.process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "TLS files changed but do not load" not in server.logs():
            assert time.monotonic() < deadline, server.logs()
            time.sleep(0.05)
        assert _served_by(server, old_ca) and _https_ok(server, old_ca)
        assert _metric(server, old_ca, "failed") == 1

        # The key follows: the new pair serves new connections on both listeners.
        _replace(pki / "server2.key", live / "server.key")
        server.process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while not _served_by(server, new_ca):
            assert time.monotonic() < deadline, server.logs()
            server.process.send_signal(signal.SIGHUP)
            time.sleep(0.1)
        assert not _served_by(server, old_ca)
        assert _https_ok(server, new_ca) and not _https_ok(server, old_ca)
        assert _metric(server, new_ca, "loaded") == 1
        expiry = _metric(server, new_ca, "", "pagekeeper_tls_certificate_expiry_timestamp_seconds")
        assert expiry == certificate_not_after((pki / "server2.pem").read_bytes())
        assert "TLS files reloaded" in server.logs()
        assert kept.pool_info().counters.num_free_pages > 0
        kept.close()
    finally:
        assert server.stop() == 0


def test_reload_reports_each_bad_change_once_and_keeps_the_old_pair(
    pki: Path, tmp_path: Path
) -> None:
    cert, key = tmp_path / "s.pem", tmp_path / "s.key"
    shutil.copyfile(pki / "server.pem", cert)
    shutil.copyfile(pki / "server.key", key)
    tls = ServerTLS(str(cert), str(key))
    tls.http_context()
    assert tls.reload_if_changed() is False  # nothing changed
    _replace(pki / "server2.pem", cert)
    with pytest.raises(ConfigError) as exc:
        tls.reload_if_changed()
    assert exc.value.field == "server.tls_key_file"
    assert tls.reload_if_changed() is False  # the same bad change: said once
    assert tls.cert_chain == (pki / "server.pem").read_bytes()
    key.unlink()
    with pytest.raises(ConfigError, match="cannot read"):
        tls.reload_if_changed()
    _replace(pki / "server2.key", key)
    assert tls.reload_if_changed() is True
    assert tls.cert_chain == (pki / "server2.pem").read_bytes()
    assert tls.num_reloads == 1
    assert tls._take_pending_grpc() is not None and tls._take_pending_grpc() is None


def test_the_certificate_expiry_is_read_from_the_der(pki: Path, tmp_path: Path) -> None:
    """UTCTime (before 2050) and GeneralizedTime (from 2050) validity, a CA's (v3 with
    extensions) and a leaf's, against openssl's own reading; garbage is a ValueError."""
    openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "40000",
        "-keyout", "far.key", "-out", "far.pem", "-subj", "/CN=far", cwd=tmp_path,
    )  # fmt: skip
    for path in (pki / "server.pem", pki / "ca.pem", tmp_path / "far.pem"):
        text = subprocess.run(
            ["openssl", "x509", "-enddate", "-noout", "-in", str(path)],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        when = text.strip().split("=", 1)[1]  # e.g. "Dec  8 06:35:19 2026 GMT"
        expected = datetime.strptime(when, "%b %d %H:%M:%S %Y %Z").replace(tzinfo=UTC)
        assert certificate_not_after(path.read_bytes()) == expected.timestamp(), path
    assert certificate_not_after((tmp_path / "far.pem").read_bytes()) > 2**31  # past 2038
    with pytest.raises(ValueError):
        certificate_not_after(b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    # Damaged certificates: a date or a ValueError, never another exception.
    der = ssl.PEM_cert_to_DER_cert((pki / "server.pem").read_text())
    rng = random.Random(7)
    outcomes = {"read": 0, "refused": 0}
    for _ in range(2000):
        damaged = bytearray(der)
        for _ in range(rng.randint(1, 4)):
            damaged[rng.randrange(min(len(der), 400))] = rng.randrange(256)
        cut = bytes(damaged[: rng.randint(0, len(der))] if rng.random() < 0.3 else damaged)
        try:
            certificate_not_after(ssl.DER_cert_to_PEM_cert(cut).encode())
            outcomes["read"] += 1
        except ValueError:
            outcomes["refused"] += 1
    assert outcomes["read"] > 100 and outcomes["refused"] > 100, outcomes


# -- configuration errors -----------------------------------------------------------------


def _settings(**server: str) -> Settings:
    return load_settings(environ={}, flags={f"server.{k}": v for k, v in server.items()})


@pytest.mark.parametrize(
    ("server", "field", "reason"),
    [
        ({"tls_cert_file": "x.pem"}, "server.tls_key_file", "both a certificate and its key"),
        ({"tls_key_file": "x.key"}, "server.tls_cert_file", "both a certificate and its key"),
        ({"tls_client_ca_file": "ca.pem"}, "server.tls_client_ca_file", "need TLS"),
    ],
)
def test_incomplete_tls_settings_name_the_field(server, field: str, reason: str) -> None:
    with pytest.raises(ConfigError) as exc:
        _settings(**server)
    assert exc.value.field == field
    assert reason in exc.value.reason


def test_unusable_tls_files_name_the_field(pki: Path, tmp_path: Path) -> None:
    cert, key = str(pki / "server.pem"), str(pki / "server.key")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    cases = [
        ({"tls_cert_file": str(tmp_path / "none.pem"), "tls_key_file": key}, "tls_cert_file",
         "cannot read"),
        ({"tls_cert_file": cert, "tls_key_file": str(tmp_path / "none.key")}, "tls_key_file",
         "cannot read"),
        ({"tls_cert_file": str(garbage), "tls_key_file": key}, "tls_cert_file",
         "no PEM certificate"),
        ({"tls_cert_file": cert, "tls_key_file": str(pki / "client.key")}, "tls_key_file",
         "is not the private key"),
        ({"tls_cert_file": cert, "tls_key_file": key, "tls_client_ca_file": str(garbage)},
         "tls_client_ca_file", "no readable PEM CA certificate"),
    ]  # fmt: skip
    for server, field, reason in cases:
        with pytest.raises(ConfigError) as exc:
            load_server_tls(_settings(**server))
        assert exc.value.field == f"server.{field}", server
        assert reason in exc.value.reason, (server, exc.value.reason)
    tls = load_server_tls(_settings(tls_cert_file=cert, tls_key_file=key))
    assert tls is not None and not tls.requires_client_certificates
    assert load_server_tls(_settings()) is None


def test_serve_refuses_a_bad_tls_file_in_one_line_before_touching_the_data_dir(
    pki: Path, tmp_path: Path
) -> None:
    data_dir = tmp_path / "data"
    result = subprocess.run(
        [
            sys.executable, "-m", "pagekeeper", "serve",
            "--grpc-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0",
            "--data-dir", str(data_dir),
            "--tls-cert-file", str(pki / "server.pem"),
            "--tls-key-file", str(pki / "client.key"),
        ],
        capture_output=True, text=True, env=clean_env(), cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("pagekeeper: bad configuration: server.tls_key_file:")
    assert not data_dir.exists()


def test_config_prints_the_tls_files(pki: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pagekeeper", "config", "--format", "json"],
        capture_output=True,
        text=True,
        env=clean_env(
            {
                "PAGEKEEPER_TLS_CERT_FILE": str(pki / "server.pem"),
                "PAGEKEEPER_TLS_KEY_FILE": str(pki / "server.key"),
            }
        ),
        cwd=ROOT,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    server = json.loads(result.stdout)["server"]
    assert server["tls_cert_file"] == str(pki / "server.pem")
    assert server["tls_key_file"] == str(pki / "server.key")


# -- the client's choice ------------------------------------------------------------------


def test_the_clients_tls_argument() -> None:
    assert resolve_tls(False) is None
    assert resolve_tls(True) == ClientTLS()
    assert resolve_tls(None) is None or isinstance(resolve_tls(None), ClientTLS)
    with pytest.raises(ValueError, match="both cert_file and key_file"):
        ClientTLS(cert_file="c.pem")
    with pytest.raises(TypeError):
        resolve_tls("yes")  # type: ignore[arg-type]
    env = {
        "PAGEKEEPER_TLS_CA_FILE": "/ca.pem",
        "PAGEKEEPER_TLS_CLIENT_CERT_FILE": "/c.pem",
        "PAGEKEEPER_TLS_CLIENT_KEY_FILE": "/c.key",
    }
    assert ClientTLS.from_env(env) == ClientTLS("/ca.pem", "/c.pem", "/c.key")
    assert ClientTLS.from_env({}) is None
    with pytest.raises(OSError):
        PagekeeperClient("127.0.0.1:1", tls=ClientTLS(ca_file="/nonexistent/ca.pem"))


def test_a_grpc_error_from_tls_is_unavailable_not_unknown(
    tls_server: RunningServer,
) -> None:
    """A plaintext gRPC channel to the TLS port: the raw code the client maps."""
    channel = grpc.insecure_channel(tls_server.grpc_address)
    try:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with pytest.raises(grpc.RpcError) as exc:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
        assert exc.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    finally:
        channel.close()
