"""Run docker-compose.yml without a Docker engine: every service as a local process.

    python -m tests.compose.runner                    # like `docker compose up`; Ctrl-C stops
    python -m tests.compose.runner --profile gpu --set PAGEKEEPER_SCHEDULER_WORKERS=4

What it takes from each service, as Compose would:

- the process: the service's ``entrypoint`` / ``command`` over the image's ENTRYPOINT / CMD,
  read from the Dockerfile stage its ``build.target`` names; ``python`` and console scripts
  resolve to this interpreter's virtualenv (the local install stands in for the image);
- the environment: the image's ENV, then the service's ``environment`` (interpolated from
  the variables given, as from a shell or .env);
- addresses: every container port a service lists under ``x-local.ports`` gets a free
  127.0.0.1 port, and every ``HOST:PORT`` that names it -- ``pagekeeper:50051`` from another
  service, ``0.0.0.0:8000`` or ``127.0.0.1:8000`` inside the service itself, in URLs too --
  is rewritten to it, in arguments, environment and health checks alike. An address naming
  a service on a port it does not list is an error (a typo would otherwise hang);
- volumes: each mount target is rewritten to a directory under the run directory (named
  volumes survive in ``volumes/NAME``);
- order: ``depends_on`` with ``service_started``, ``service_healthy`` (the health check,
  the service's own or the image's HEALTHCHECK, run as Docker runs it: every
  ``start_interval`` during ``start_period`` then every ``interval``, ``retries``
  consecutive failures after the start period = unhealthy) and
  ``service_completed_successfully``; ``required: false`` dependencies may be absent;
- stop: dependents first, ``stop_signal`` (else the image's STOPSIGNAL, else SIGTERM), then
  SIGKILL after ``stop_grace_period``.

Then :meth:`LocalStack.down` reports what was left behind: processes of any service's
session, shared-memory ring files named after a service's pid under /dev/shm, and listening
sockets on the allocated ports. What it cannot emulate (IPC namespaces, GPU reservations,
published host ports, restart policies) is listed in compose.ENGINE_ONLY_KEYS; every process
shares this host's /dev/shm, which is what ``ipc: shareable`` / ``service:pagekeeper`` give
the containers.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.compose.compose import (
    ComposeError,
    ComposeFile,
    HealthCheck,
    ServiceSpec,
    load_compose,
)
from tests.compose.dockerfile import Dockerfile, ImageConfig, parse_dockerfile

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"

_IMAGE_ENV_SKIPPED = frozenset({"PATH", "HOME", "HOSTNAME", "PYTHONHOME", "PYTHONPATH"})
"""Image variables that describe the image's filesystem, not the service's configuration."""

_LOOPBACK_NAMES = frozenset({"0.0.0.0", "127.0.0.1", "localhost", "[::]", "[::1]", "::"})
_ADDRESS = re.compile(r"(?P<host>\[[0-9A-Fa-f:.]*\]|[A-Za-z0-9_.-]+):(?P<port>\d{1,5})(?!\d)")


class RunnerError(RuntimeError):
    """A service failed to start, became unhealthy, or a dependency failed."""


@dataclass
class StopOutcome:
    service: str
    returncode: int | None
    signal_sent: str | None
    """None: the process had already exited on its own."""
    was_killed: bool
    seconds: float


@dataclass
class DownReport:
    """What stopping found: how each service ended and what was left behind."""

    outcomes: list[StopOutcome] = field(default_factory=list)
    leftover_processes: list[str] = field(default_factory=list)
    leftover_shm_files: list[str] = field(default_factory=list)
    leftover_listeners: list[str] = field(default_factory=list)

    @property
    def is_clean(self) -> bool:
        return not (self.leftover_processes or self.leftover_shm_files or self.leftover_listeners)

    def outcome(self, service: str) -> StopOutcome:
        return next(o for o in self.outcomes if o.service == service)


@dataclass
class LocalService:
    """One service's process and what it was started with."""

    spec: ServiceSpec
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    log_path: Path
    healthcheck: HealthCheck | None
    stop_signal: signal.Signals
    popen: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    is_healthy: bool = False
    last_health_output: str = ""

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def returncode(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def logs(self, tail: int = 60) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return ""
        return "\n".join(lines[-tail:])


def free_loopback_ports(count: int) -> list[int]:
    """``count`` distinct free ports on 127.0.0.1 (held open together while choosing, so
    they differ; released before the services bind them)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _signal(name: str | None) -> signal.Signals:
    if not name:
        return signal.SIGTERM
    name = name.upper()
    return signal.Signals[name if name.startswith("SIG") else "SIG" + name]


class LocalStack:
    """The services of one compose file running as local processes under ``run_dir``."""

    def __init__(
        self,
        compose: ComposeFile,
        run_dir: Path,
        *,
        profiles: Sequence[str] = (),
        services: Sequence[str] | None = None,
        extra_args: Mapping[str, Sequence[str]] | None = None,
        extra_env: Mapping[str, Mapping[str, str]] | None = None,
        variables: Mapping[str, str] | None = None,
        max_stop_grace_s: float | None = None,
    ) -> None:
        self.compose = compose
        self.run_dir = run_dir.resolve()
        self.variables = dict(variables or {})
        self.max_stop_grace_s = max_stop_grace_s
        active = compose.active_services(profiles)
        if services is not None:
            unknown = set(services) - set(active)
            if unknown:
                raise ComposeError(f"not enabled under profiles {list(profiles)}: {unknown}")
            active = [s for s in active if s in services]
        self.order = compose.start_order(active)
        self._dockerfiles: dict[Path, Dockerfile] = {}

        # Every service's ports, started or not: an address naming a service left out
        # (profiles, a subset) still rewrites, and then finds nothing listening, as a
        # container would find no such host.
        requested = [
            (name, port) for name, spec in compose.services.items() for port in spec.local_ports
        ]
        self.ports = dict(zip(requested, free_loopback_ports(len(requested)), strict=True))
        self.services: dict[str, LocalService] = {}
        for name in self.order:
            self.services[name] = self._prepare(
                compose.services[name],
                list((extra_args or {}).get(name, ())),
                dict((extra_env or {}).get(name, {})),
            )

    # -- building each process --------------------------------------------------------
    def image_config(self, spec: ServiceSpec) -> ImageConfig:
        if spec.dockerfile is None:
            raise ComposeError(
                f"services.{spec.name}: no build section, so no Dockerfile to read the "
                "image's ENTRYPOINT/CMD/ENV from"
            )
        path = (self.compose.path.parent / spec.dockerfile).resolve()
        if path not in self._dockerfiles:
            self._dockerfiles[path] = parse_dockerfile(path)
        return self._dockerfiles[path].stage(spec.build_target).config

    def endpoint(self, service: str, port: int) -> str:
        """``127.0.0.1:P``: where ``service``'s container port ``port`` listens locally."""
        try:
            return f"127.0.0.1:{self.ports[(service, port)]}"
        except KeyError:
            raise ComposeError(f"{service} does not list port {port} under x-local.ports") from None

    def volume_dir(self, name: str) -> Path:
        return self.run_dir / "volumes" / name

    def _mount_map(self, spec: ServiceSpec) -> list[tuple[str, Path]]:
        mapping = []
        for mount in spec.mounts:
            if mount.is_named_volume:
                local = self.volume_dir(mount.source)
            else:
                local = (self.compose.path.parent / mount.source).resolve()
            local.mkdir(parents=True, exist_ok=True)
            mapping.append((mount.target.rstrip("/") or "/", local))
        # Longest target first: /a/b wins over /a.
        return sorted(mapping, key=lambda item: -len(item[0]))

    def rewrite(self, service: str, text: str, mounts: Sequence[tuple[str, Path]]) -> str:
        """Addresses to loopback ports, mount targets to local directories."""
        names = set(self.compose.services)

        def address(match: re.Match[str]) -> str:
            host, port = match.group("host"), int(match.group("port"))
            if host in names:
                return self.endpoint(host, port)
            if host in _LOOPBACK_NAMES and (service, port) in self.ports:
                return self.endpoint(service, port)
            return match.group()

        text = _ADDRESS.sub(address, text)
        for target, local in mounts:
            text = re.sub(
                rf"(^|[=\s,]){re.escape(target)}(?=$|/)",
                lambda m, local=local: m.group(1) + str(local),
                text,
            )
        return text

    def _executable(self, name: str) -> str:
        bindir = Path(sys.executable).parent
        base = os.path.basename(name)
        if base in ("python", "python3", f"python3.{sys.version_info.minor}"):
            return sys.executable
        if (bindir / base).exists():
            return str(bindir / base)
        if os.path.isabs(name) and os.path.exists(name):
            return name
        found = shutil.which(name)
        if found is None:
            raise ComposeError(f"{name!r}: not found in {bindir} nor on PATH")
        return found

    def _prepare(
        self, spec: ServiceSpec, extra_args: list[str], extra_env: dict[str, str]
    ) -> LocalService:
        image = self.image_config(spec)
        mounts = self._mount_map(spec)
        home = self.run_dir / "home" / spec.name
        tmp = self.run_dir / "tmp" / spec.name
        for directory in (home, tmp):
            directory.mkdir(parents=True, exist_ok=True)
        env = {
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "HOME": str(home),
            "TMPDIR": str(tmp),
            "LANG": "C.UTF-8",
        }
        env.update({k: v for k, v in image.env.items() if k not in _IMAGE_ENV_SKIPPED})
        for key, value in spec.environment.items():
            if value is None:  # `KEY:` alone: from the shell's environment, else unset
                if key in self.variables:
                    env[key] = self.variables[key]
                else:
                    env.pop(key, None)
            else:
                env[key] = value
        env.update(extra_env)
        env = {k: self.rewrite(spec.name, v, mounts) for k, v in env.items()}

        argv = [
            self.rewrite(spec.name, arg, mounts)
            for arg in image.argv(spec.entrypoint, spec.command)
        ]
        argv[0] = self._executable(argv[0])
        argv += extra_args

        if spec.is_healthcheck_disabled:
            check = None
        elif spec.healthcheck is not None:
            check = spec.healthcheck
        elif not image.is_healthcheck_none:
            check = image.healthcheck
        else:
            check = None
        if check is not None:
            check_argv = [self.rewrite(spec.name, a, mounts) for a in check.argv]
            check_argv[0] = self._executable(check_argv[0])
            check = HealthCheck(
                argv=tuple(check_argv),
                interval_s=check.interval_s,
                timeout_s=check.timeout_s,
                retries=check.retries,
                start_period_s=check.start_period_s,
                start_interval_s=check.start_interval_s,
            )

        workdir = self.rewrite(spec.name, image.workdir, mounts)
        cwd = Path(workdir) if Path(workdir).is_relative_to(self.run_dir) else tmp
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        return LocalService(
            spec=spec,
            argv=argv,
            env=env,
            cwd=cwd,
            log_path=logs / f"{spec.name}.log",
            healthcheck=check,
            stop_signal=_signal(spec.stop_signal or image.stop_signal),
        )

    # -- running ----------------------------------------------------------------------
    def start(self, name: str) -> None:
        service = self.services[name]
        with open(service.log_path, "ab") as log:
            service.popen = subprocess.Popen(
                service.argv,
                env=service.env,
                cwd=service.cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                # Its own session: stopping and the leftover check find every process it
                # started, and a Ctrl-C at the terminal reaches only the runner.
                start_new_session=True,
            )
        service.started_at = time.monotonic()

    def run_healthcheck(self, name: str) -> bool:
        """Run the service's health check once, as ``docker exec`` would (the container's
        environment and working directory); True when it exits 0 within its timeout."""
        service = self.services[name]
        check = service.healthcheck
        if check is None:
            raise RunnerError(f"{name} has no health check")
        try:
            result = subprocess.run(
                check.argv,
                env=service.env,
                cwd=service.cwd,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=check.timeout_s,
                start_new_session=True,
            )
        except subprocess.TimeoutExpired:
            service.last_health_output = f"timed out after {check.timeout_s}s"
            return False
        service.last_health_output = (result.stdout + result.stderr).decode(errors="replace")
        return result.returncode == 0

    def wait_healthy(self, name: str) -> None:
        """Docker's health state machine, until healthy; RunnerError when unhealthy or when
        the process exits first."""
        service = self.services[name]
        check = service.healthcheck
        if check is None:
            raise RunnerError(
                f"{name}: a dependent waits for service_healthy, but it has no health check"
            )
        if service.is_healthy:
            return
        failures = 0
        next_check = service.started_at + (
            check.start_interval_s if check.start_period_s > 0 else check.interval_s
        )
        while True:
            self._check_running(name, "before becoming healthy")
            time.sleep(max(0.0, next_check - time.monotonic()))
            self._check_running(name, "before becoming healthy")
            now = time.monotonic()
            in_start_period = now - service.started_at < check.start_period_s
            if self.run_healthcheck(name):
                service.is_healthy = True
                return
            if not in_start_period:
                failures += 1
                if failures >= check.retries:
                    raise RunnerError(
                        f"{name} is unhealthy after {failures} failed checks: "
                        f"{service.last_health_output.strip()}\n{service.logs()}"
                    )
            interval = check.start_interval_s if in_start_period else check.interval_s
            next_check = time.monotonic() + interval

    def _check_running(self, name: str, when: str) -> None:
        service = self.services[name]
        rc = service.returncode()
        if rc is not None:
            raise RunnerError(f"{name} exited with status {rc} {when}\n{service.logs()}")

    def wait_condition(self, service: str, condition: str) -> None:
        if condition == "service_started":
            return
        if condition == "service_healthy":
            self.wait_healthy(service)
            return
        popen = self.services[service].popen
        assert popen is not None
        rc = popen.wait()
        if rc != 0:
            raise RunnerError(
                f"{service} did not complete successfully (status {rc})\n"
                f"{self.services[service].logs()}"
            )

    def up(self) -> None:
        """Start every service in dependency order, each once its dependencies meet their
        conditions (as ``docker compose up -d --wait`` would, without the final wait)."""
        for name in self.order:
            for dep in self.services[name].spec.depends_on:
                if dep.service in self.services:
                    try:
                        self.wait_condition(dep.service, dep.condition)
                    except RunnerError as exc:
                        raise RunnerError(f"dependency of {name} failed: {exc}") from None
            self.start(name)

    def wait_exit(self, name: str, timeout: float) -> int:
        """Wait for a service's process to exit on its own; its status."""
        popen = self.services[name].popen
        assert popen is not None
        try:
            return popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise RunnerError(
                f"{name} still running after {timeout}s\n{self.services[name].logs()}"
            ) from None

    def stop(self, name: str) -> StopOutcome:
        service = self.services[name]
        popen = service.popen
        started = time.monotonic()
        if popen is None:
            return StopOutcome(name, None, None, False, 0.0)
        if popen.poll() is not None:
            return StopOutcome(name, popen.returncode, None, False, 0.0)
        grace = service.spec.stop_grace_period_s
        if self.max_stop_grace_s is not None:
            grace = min(grace, self.max_stop_grace_s)
        popen.send_signal(service.stop_signal)
        was_killed = False
        try:
            popen.wait(grace)
        except subprocess.TimeoutExpired:
            was_killed = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(popen.pid, signal.SIGKILL)
            popen.wait()
        return StopOutcome(
            name,
            popen.returncode,
            service.stop_signal.name,
            was_killed,
            time.monotonic() - started,
        )

    def down(self) -> DownReport:
        """Stop every service (dependents first) and report what was left behind. Anything
        left is then killed, so a failing test does not leak into the next one."""
        report = DownReport()
        for name in reversed(self.order):
            report.outcomes.append(self.stop(name))
        pids = {s.pid: s.name for s in self.services.values() if s.popen is not None}
        leftovers = _session_members(set(pids))
        for pid, leader, cmdline in leftovers:
            report.leftover_processes.append(f"{pids[leader]}: pid {pid} {cmdline}")
        for pid, name in pids.items():
            for path in glob.glob(f"/dev/shm/pagekeeper-*-{pid}-*"):
                report.leftover_shm_files.append(f"{name}: {path}")
        listening = _listening_ports()
        for (name, container_port), port in self.ports.items():
            if port in listening:
                report.leftover_listeners.append(f"{name}: 127.0.0.1:{port} ({container_port})")
        for pid, _, _ in leftovers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return report

    def __enter__(self) -> LocalStack:
        return self

    def __exit__(self, *exc: object) -> None:
        if any(s.returncode() is None for s in self.services.values() if s.popen):
            self.down()


def _session_members(session_ids: set[int]) -> list[tuple[int, int, str]]:
    """Live (pid, session leader, command line) of the processes whose session or process
    group is one of ``session_ids`` (each service is started as a session leader)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        # Fields after the parenthesised command: state, ppid, pgrp, session, ...
        fields = stat.rsplit(")", 1)[1].split()
        state, pgrp, session = fields[0], int(fields[2]), int(fields[3])
        if state == "Z":
            continue
        owner = session if session in session_ids else pgrp if pgrp in session_ids else None
        if owner is not None:
            found.append((int(entry), owner, cmdline))
    return found


def _listening_ports() -> set[int]:
    """Local ports with a TCP socket in LISTEN state (IPv4 and IPv6)."""
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    if fields[3] == "0A":  # TCP_LISTEN
                        ports.add(int(fields[1].rsplit(":", 1)[1], 16))
        except FileNotFoundError:
            continue
    return ports


# -- command line ------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run docker-compose.yml as local processes.")
    parser.add_argument("--file", type=Path, default=COMPOSE_FILE)
    parser.add_argument("--profile", action="append", default=[])
    parser.add_argument("--run-dir", type=Path, help="default: a new directory under /tmp")
    parser.add_argument(
        "--set", action="append", default=[], metavar="VAR=VALUE", help="a compose variable"
    )
    parser.add_argument("service", nargs="*", help="services to run (default: all enabled)")
    ns = parser.parse_args(argv)
    variables = dict(os.environ)
    for item in ns.set:
        key, _, value = item.partition("=")
        variables[key] = value
    import tempfile

    run_dir = ns.run_dir or Path(tempfile.mkdtemp(prefix="pagekeeper-compose-"))
    compose = load_compose(ns.file, variables)
    stack = LocalStack(
        compose,
        run_dir,
        profiles=ns.profile,
        services=ns.service or None,
        variables=variables,
    )
    print(f"run directory {run_dir} (logs/, volumes/)")
    for (name, port), local in stack.ports.items():
        print(f"  {name}:{port} -> 127.0.0.1:{local}")
    stop = False

    def on_signal(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    status = 0
    try:
        stack.up()
        print("all services started; Ctrl-C stops them")
        while not stop and any(s.returncode() is None for s in stack.services.values()):
            time.sleep(0.2)
    except RunnerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        status = 1
    finally:
        report = stack.down()
    for outcome in report.outcomes:
        print(f"  {outcome}")
    if not report.is_clean:
        print(f"left behind: {report}", file=sys.stderr)
        status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
