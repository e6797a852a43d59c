"""Start the real ``pagekeeper serve`` as a subprocess on ephemeral loopback ports.

Reusable by every test directory::

    with start_server(tmp_path, "--num-pages", "64") as server:
        stub = server.stub()
        stub.GetPoolInfo(pb.GetPoolInfoRequest(), metadata=server.metadata)
        httpx.get(server.http_url + "/v1/pool")

The server binds port 0 for gRPC and HTTP and reports the real ports in a ``--ready-file``
(written atomically once both servers listen and the pool exists), so tests never race for
ports. Its stdout/stderr go to files under ``workdir`` (printed on start-up failure).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 60.0


class ServerStartError(RuntimeError):
    pass


@dataclass
class RunningServer:
    """A started server; ``stop()`` (or leaving ``start_server``'s block) ends it."""

    process: subprocess.Popen[bytes]
    workdir: Path
    grpc_address: str
    http_address: str
    info: dict[str, Any]
    token: str | None = None
    admin_token: str | None = None
    _channels: list[Any] = field(default_factory=list)
    _http: Any = None

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def http_url(self) -> str:
        return f"http://{self.http_address}"

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """gRPC call metadata carrying the token (empty when the server has none)."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    @property
    def admin_headers(self) -> dict[str, str]:
        token = self.admin_token or self.token
        return {"Authorization": f"Bearer {token}"} if token else {}

    def channel(self) -> Any:
        """A sync gRPC channel to the server (closed by ``stop()``)."""
        import grpc

        channel = grpc.insecure_channel(self.grpc_address)
        self._channels.append(channel)
        return channel

    def http(self) -> Any:
        """A shared ``httpx.Client`` on the HTTP address (building one costs ~0.1 s)."""
        if self._http is None:
            import httpx

            self._http = httpx.Client(base_url=self.http_url, timeout=30)
        return self._http

    def stub(self) -> Any:
        from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2_grpc as pb_grpc

        return pb_grpc.PagekeeperServiceStub(self.channel())

    def logs(self) -> str:
        out = (self.workdir / "stdout.log").read_text(errors="replace")
        err = (self.workdir / "stderr.log").read_text(errors="replace")
        return f"--- stdout ---\n{out}\n--- stderr ---\n{err}"

    def is_running(self) -> bool:
        return self.process.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        """Signal the server and wait; returns its exit status (kills it after timeout)."""
        for channel in self._channels:
            channel.close()
        self._channels.clear()
        if self._http is not None:
            self._http.close()
            self._http = None
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
                message = f"server did not stop within {timeout}s\n{self.logs()}"
                raise AssertionError(message) from None
        return self.process.returncode


def server_command(ready_file: Path, args: Sequence[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pagekeeper",
        "serve",
        "--grpc-address",
        "127.0.0.1:0",
        "--http-address",
        "127.0.0.1:0",
        "--ready-file",
        str(ready_file),
        *args,
    ]


_NATIVE_SWITCHES = ("PAGEKEEPER_NATIVE_HASHING", "PAGEKEEPER_NATIVE_POOL")


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The parent's environment without PAGEKEEPER_* (tests pass settings explicitly), but
    for the C accelerators' switches: ``PAGEKEEPER_NATIVE_HASHING=0
    PAGEKEEPER_NATIVE_POOL=0 make test`` runs every service it starts on the pure-Python
    loops too."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("PAGEKEEPER_") or k in _NATIVE_SWITCHES
    }
    env.update(extra or {})
    return env


def launch(
    workdir: Path,
    *args: str,
    env: Mapping[str, str] | None = None,
    token: str | None = None,
    admin_token: str | None = None,
    publish_transport: str = "none",
    timeout: float = START_TIMEOUT_S,
) -> RunningServer:
    """Start a server and wait until it is ready. ``args`` are extra ``serve`` flags."""
    workdir.mkdir(parents=True, exist_ok=True)
    ready_file = workdir / "ready.json"
    ready_file.unlink(missing_ok=True)
    extra_env = dict(env or {})
    if token is not None:
        extra_env["PAGEKEEPER_TOKEN"] = token
    if admin_token is not None:
        extra_env["PAGEKEEPER_ADMIN_TOKEN"] = admin_token
    extra_env.setdefault("PAGEKEEPER_DATA_DIR", str(workdir / "data"))
    command = server_command(ready_file, ["--publish-transport", publish_transport, *args])
    with open(workdir / "stdout.log", "wb") as out, open(workdir / "stderr.log", "wb") as err:
        process = subprocess.Popen(
            command, stdout=out, stderr=err, env=clean_env(extra_env), cwd=ROOT
        )
    deadline = time.monotonic() + timeout
    while not ready_file.exists():
        if process.poll() is not None:
            raise ServerStartError(
                f"server exited with {process.returncode} before ready\n"
                + (workdir / "stderr.log").read_text(errors="replace")
            )
        if time.monotonic() > deadline:
            process.kill()
            process.wait(5)
            raise ServerStartError(
                f"server not ready after {timeout}s\n"
                + (workdir / "stderr.log").read_text(errors="replace")
            )
        time.sleep(0.02)
    info = json.loads(ready_file.read_text())
    return RunningServer(
        process=process,
        workdir=workdir,
        grpc_address=info["grpc_address"],
        http_address=info["http_address"],
        info=info,
        token=token,
        admin_token=admin_token,
    )


@contextmanager
def start_server(workdir: Path, *args: str, **kwargs: Any) -> Iterator[RunningServer]:
    """``launch`` as a context manager: the server is stopped (SIGTERM) on exit."""
    server = launch(workdir, *args, **kwargs)
    try:
        yield server
    finally:
        server.stop()
