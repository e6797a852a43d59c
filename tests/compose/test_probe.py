"""``python -m pagekeeper.probe``: the health probe the image and the compose file use."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pagekeeper.probe import connect_address
from pagekeeper_client.client import PagekeeperClient
from tests.helpers.server import RunningServer, clean_env

TOKEN = "probe-test-token"


def probe(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pagekeeper.probe", *args],
        env=clean_env(env),
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("listen", "connect"),
    [
        ("0.0.0.0:50051", "127.0.0.1:50051"),
        ("[::]:8000", "[::1]:8000"),
        ("127.0.0.1:1", "127.0.0.1:1"),
        ("pagekeeper:50051", "pagekeeper:50051"),
        ("[::1]:7", "[::1]:7"),
        ("unix:/run/pk.sock", "unix:/run/pk.sock"),
    ],
)
def test_connect_address(listen: str, connect: str) -> None:
    assert connect_address(listen) == connect


def test_healthy_service_with_token_and_registered_clients(
    server_factory: Callable[..., RunningServer],
) -> None:
    server = server_factory(token=TOKEN)
    grpc, http = server.grpc_address, server.http_address
    # Health needs no token (orchestrators probe without credentials); the service's own
    # environment is all the probe needs.
    result = probe(env={"PAGEKEEPER_GRPC_ADDRESS": grpc, "PAGEKEEPER_HTTP_ADDRESS": http})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SERVING" in result.stdout and "/readyz: 200" in result.stdout

    args = ("--grpc-address", grpc, "--http-address", http)
    missing = probe(*args, "--expect-client", "probe-scheduler", "--expect-role", "worker")
    assert missing.returncode == 1
    assert "not registered: client 'probe-scheduler', a worker" in missing.stdout
    client = PagekeeperClient(grpc, token=TOKEN)
    try:
        client.register("scheduler", name="probe-scheduler")
        found = probe(*args, "--expect-client", "probe-scheduler", "--expect-role", "scheduler")
        assert found.returncode == 0, found.stdout
        assert "registered: client 'probe-scheduler', a scheduler" in found.stdout
    finally:
        client.close()
    gone = probe(*args, "--expect-client", "probe-scheduler", "--quiet")
    assert gone.returncode == 1
    assert gone.stdout.startswith("FAIL http") and "ok " not in gone.stdout


def test_http_over_a_unix_socket(
    server_factory: Callable[..., RunningServer], tmp_path: Path
) -> None:
    sock = tmp_path / "http.sock"
    server = server_factory("--http-address", f"unix:{sock}")
    result = probe("--grpc-address", server.grpc_address, "--http-address", f"unix:{sock}")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"http unix:{sock} /readyz: 200" in result.stdout


def test_the_same_node_socket_is_checked_when_configured(
    server_factory: Callable[..., RunningServer],
) -> None:
    sockdir = Path(tempfile.mkdtemp(prefix="pk-probe-"))
    try:
        path = sockdir / "step.sock"
        server = server_factory("--local-socket", str(path), token=TOKEN)
        env = {
            "PAGEKEEPER_GRPC_ADDRESS": server.grpc_address,
            "PAGEKEEPER_HTTP_ADDRESS": server.http_address,
            "PAGEKEEPER_LOCAL_SOCKET": str(path),
            "PAGEKEEPER_TOKEN": TOKEN,
        }
        result = probe(env=env)
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"ok local socket {path}: answers" in result.stdout
        # A wrong token is refused at the hello; a socket that is gone is unhealthy.
        wrong = probe(env={**env, "PAGEKEEPER_TOKEN": "not-it"})
        assert wrong.returncode == 1 and "wrong bearer token" in wrong.stdout
        path.unlink()
        gone = probe(env=env)
        assert gone.returncode == 1 and f"FAIL local socket {path}" in gone.stdout
        assert probe("--no-local", env=env).returncode == 0
    finally:
        shutil.rmtree(sockdir, ignore_errors=True)


def test_wait_until_the_service_comes_up(
    server_factory: Callable[..., RunningServer], tmp_path: Path
) -> None:
    from tests.compose.runner import free_loopback_ports

    grpc_port, http_port = free_loopback_ports(2)
    waiting = subprocess.Popen(
        [sys.executable, "-m", "pagekeeper.probe", "--wait", "60", "--timeout", "1",
         "--grpc-address", f"127.0.0.1:{grpc_port}", "--http-address", f"127.0.0.1:{http_port}"],
        env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        time.sleep(1.0)
        assert waiting.poll() is None  # nothing listens yet: still retrying
        server_factory(
            "--grpc-address", f"0.0.0.0:{grpc_port}", "--http-address", f"0.0.0.0:{http_port}"
        )
        output, _ = waiting.communicate(timeout=60)
    finally:
        if waiting.poll() is None:
            waiting.kill()
            waiting.wait()
    assert waiting.returncode == 0, output


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (("--grpc-address", "127.0.0.1:1", "--no-http"), {}, "FAIL grpc 127.0.0.1:1"),
        (("--no-grpc", "--http-address", "127.0.0.1:1"), {}, "FAIL http 127.0.0.1:1"),
        (("--bogus",), {}, "unrecognized arguments"),
        ((), {"PAGEKEEPER_NUM_PAGES": "many"}, "FAIL configuration: pool.num_pages"),
        (("--no-grpc", "--no-http"), {}, "nothing to check"),
        (("--no-http", "--expect-role", "worker"), {}, "need the HTTP checks"),
        (("--timeout", "0"), {}, "--timeout must be positive"),
    ],
)
def test_unhealthy_and_unusable_exit_1_never_2(
    args: tuple[str, ...], env: dict[str, str], message: str
) -> None:
    """Docker reads 0 as healthy and 1 as unhealthy, and reserves 2."""
    result = probe(*args, env=env)
    assert result.returncode == 1, result
    assert message in result.stdout + result.stderr


def test_defaults_follow_the_service_configuration_file(tmp_path: Path) -> None:
    config = tmp_path / "pagekeeper.toml"
    config.write_text('[server]\ngrpc_address = "0.0.0.0:1"\nhttp_address = "127.0.0.1:2"\n')
    result = probe(env={"PAGEKEEPER_CONFIG": str(config)})
    assert result.returncode == 1
    assert "FAIL grpc 127.0.0.1:1" in result.stdout  # the file's address, wildcard mapped
    flag = probe("--config", str(config), "--no-grpc")
    assert flag.returncode == 1
    assert "FAIL http 127.0.0.1:2 /readyz" in flag.stdout
