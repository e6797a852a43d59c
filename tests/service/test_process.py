"""The process: CLI, readiness, ports, signals, unix sockets, leases in real time."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import httpx
import pytest

from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2 as pb
from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2_grpc as pb_grpc
from tests.helpers.grpc_util import Scheduler
from tests.helpers.server import ROOT, ServerStartError, clean_env


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pagekeeper", *args],
        capture_output=True,
        text=True,
        env=clean_env(env),
        cwd=ROOT,
        timeout=60,
    )


def test_config_command_prints_effective_settings():
    out = run_cli("config", "--num-pages", "100", env={"PAGEKEEPER_HTTP_ADDRESS": "127.0.0.1:9"})
    assert out.returncode == 0, out.stderr
    assert "num_pages = 100" in out.stdout and 'http_address = "127.0.0.1:9"' in out.stdout
    as_json = json.loads(run_cli("config", "--format", "json").stdout)
    assert as_json["server"]["grpc_address"] == "127.0.0.1:50051"


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (("serve", "--num-pages", "1"), "pool.num_pages"),
        (("serve", "--grpc-address", "bad"), "server.grpc_address"),
        (("config", "--ring-depth", "x"), "publish.ring_depth"),
    ],
)
def test_bad_config_exits_with_one_line(args, field):
    out = run_cli(*args)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and field in lines[0], out.stderr


def test_port_in_use_fails_cleanly(server_factory, tmp_path):
    first = server_factory()
    with pytest.raises(ServerStartError, match="cannot start"):
        server_factory("--grpc-address", "127.0.0.1:0", "--http-address", first.http_address)


@pytest.mark.parametrize("which", ["grpc", "http"])
def test_a_busy_address_is_named_in_one_line_without_a_traceback(which, tmp_path):
    """Either port held by another program: exit 1 with one line naming the address, and
    nothing else of ours on stderr (the gRPC case once ended in grpcio's RuntimeError
    traceback; the HTTP case in a traceback from the gRPC server left to the collector)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        address = f"127.0.0.1:{busy.getsockname()[1]}"
        addresses = {"grpc": "127.0.0.1:0", "http": "127.0.0.1:0", which: address}
        out = run_cli(
            "serve",
            "--grpc-address", addresses["grpc"],
            "--http-address", addresses["http"],
            "--data-dir", str(tmp_path / "data"),
            "--publish-transport", "none",
        )  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr and "Exception ignored" not in out.stderr, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    name = {"grpc": "gRPC", "http": "HTTP"}[which]
    assert last.startswith(f"pagekeeper: cannot start: cannot bind {name} to {address}"), last


def test_ready_line_and_sigterm_drains(server_factory):
    server = server_factory()
    stdout = (server.workdir / "stdout.log").read_text()
    (line,) = [ln for ln in stdout.splitlines() if ln.startswith("pagekeeper ready ")]
    assert json.loads(line.split(" ", 2)[2])["grpc_port"] == server.info["grpc_port"]
    # An open event stream does not hold the shutdown up: it ends, the process exits 0.
    stub = server.stub()
    stream = stub.WatchEvents(pb.WatchEventsRequest())
    next(iter(stream))
    ended = threading.Event()

    def drain() -> None:
        try:
            for _ in stream:
                pass
        except grpc.RpcError:
            pass
        ended.set()

    threading.Thread(target=drain, daemon=True).start()
    started = time.monotonic()
    assert server.stop(signal.SIGTERM) == 0
    assert time.monotonic() - started < 5
    assert ended.wait(5)
    assert not (server.workdir / "ready.json").exists()
    assert "stopped" in server.logs()


def test_sigint_exits_zero(server_factory):
    server = server_factory()
    assert server.stop(signal.SIGINT) == 0


def test_unix_socket_and_debug_invariants(server_factory, tmp_path):
    path = tmp_path / "pk.sock"
    server = server_factory("--grpc-address", f"unix:{path}", "--debug-invariants")
    assert server.grpc_address == f"unix:{path}"
    with grpc.insecure_channel(f"unix:{path}") as channel:
        stub = pb_grpc.PagekeeperServiceStub(channel)
        assert stub.GetPoolInfo(pb.GetPoolInfoRequest()).config.num_pages == 4096
    sched = Scheduler(server)
    assert sched.admit("u", list(range(50))).status == pb.ALLOCATION_STATUS_OK


def test_http_on_a_unix_socket_is_removed_at_stop(server_factory, tmp_path):
    path = tmp_path / "http.sock"
    server = server_factory("--grpc-address", "127.0.0.1:0", "--http-address", f"unix:{path}")
    assert server.http_address == f"unix:{path}"
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(path))) as http:
        assert http.get("http://pagekeeper/readyz").json() == {"status": "ready"}
    assert server.stop() == 0
    assert not path.exists()


def test_expired_scheduler_loses_its_requests(server_factory):
    server = server_factory("--lease-ttl-s", "0.5")
    sched = Scheduler(server)
    sched.admit("lease-a", list(range(64)))
    deadline = time.monotonic() + 10
    while server.http().get("/v1/requests").json()["items"]:
        assert time.monotonic() < deadline, "the lease never expired"
        time.sleep(0.1)
    assert server.http().get("/v1/clients").json() == []
    assert server.http().get("/v1/pool").json()["pages"]["num_used_pages"] == 0


def test_console_script_is_declared():
    text = (ROOT / "pyproject.toml").read_text()
    assert 'pagekeeper = "pagekeeper.__main__:main"' in text
    probe = socket.socket()
    probe.close()


def test_json_logs_are_one_object_a_line_uvicorns_included(server_factory):
    server = server_factory("--log-format", "json", "--log-level", "debug")
    server.http().get("/readyz")
    assert server.stop(signal.SIGTERM) == 0
    stderr = (server.workdir / "stderr.log").read_text()
    records = [json.loads(ln) for ln in stderr.splitlines() if ln.strip()]  # one object a line
    assert records
    assert all({"ts", "level", "logger", "message"} <= r.keys() for r in records)
    assert all(r["ts"].endswith("+00:00") for r in records)
    loggers = {r["logger"] for r in records}
    assert "pagekeeper" in loggers and "uvicorn.error" in loggers, loggers
    assert any(name.startswith("uvicorn") for name in loggers), loggers
    assert any(r["message"] == "stopped" for r in records)
    assert any("gRPC on" in r["message"] for r in records)
