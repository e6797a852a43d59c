"""The Dockerfile, checked without a Docker engine.

- Static: the stages and what each runtime image carries (slim base, non-root user, the
  project's probe as HEALTHCHECK, entrypoint), no binary fetched at build time, pins that
  agree with pyproject.toml, and a build context (.dockerignore) that holds every COPY
  source and nothing it should not.
- Built for real, as far as no engine is needed: the build stage's COPY lines assemble its
  /src from the build context, its stub-generation RUN line runs as written, and pip builds
  the pagekeeper wheel from the result (offline: ``--no-deps``). The image's ENTRYPOINT + CMD
  then run *from that wheel* with the image's ENV, and its HEALTHCHECK command reports
  healthy while the service runs and unhealthy (exit 1, never Docker's reserved 2) after
  SIGTERM stopped it.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.compose.dockerfile import (
    Dockerfile,
    DockerIgnore,
    Stage,
    build_context,
    parse_dockerfile,
)
from tests.compose.runner import COMPOSE_FILE, ROOT, free_loopback_ports, load_compose

DOCKERFILE = ROOT / "Dockerfile"
RUNTIME_BASE = "python:3.11-slim"


@pytest.fixture(scope="module")
def dockerfile() -> Dockerfile:
    return parse_dockerfile(DOCKERFILE)


@pytest.fixture(scope="module")
def context_files() -> list[str]:
    return build_context(ROOT, DockerIgnore.read(ROOT / ".dockerignore"))


def _pyproject_pin(package: str) -> str:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    groups = [data["project"]["dependencies"], *data["project"]["optional-dependencies"].values()]
    for group in groups:
        for requirement in group:
            if re.split(r"[=<>\[ ]", requirement, maxsplit=1)[0] == package:
                return str(requirement)
    raise AssertionError(f"{package} is not in pyproject.toml")


# -- static ----------------------------------------------------------------------------------


def test_stages_and_runtime_images(dockerfile: Dockerfile) -> None:
    names = [s.name for s in dockerfile.stages]
    assert names == ["build", "service", "worker"]
    assert dockerfile.stages[-1].name == "worker"
    service, worker = dockerfile.stage("service"), dockerfile.stage("worker")
    assert service.base == RUNTIME_BASE  # the build stage's tools never reach it
    assert worker.parent is service
    for stage in (service, worker):
        user = stage.config.user
        assert user not in (None, "", "root", "0") and not str(user).startswith("0:"), user
    # The service image: `pagekeeper serve`, checked by the project's own probe.
    assert service.config.entrypoint == ("pagekeeper",)
    assert service.config.cmd == ("serve",)
    check = service.config.healthcheck
    assert check is not None and check.argv == ("python", "-m", "pagekeeper.probe")
    assert check.timeout_s > 2.0  # the probe's own per-check timeout must fit inside
    assert service.config.stop_signal == "SIGTERM"
    env = service.config.env
    ports = {
        env["PAGEKEEPER_GRPC_ADDRESS"].rpartition(":")[2],
        env["PAGEKEEPER_HTTP_ADDRESS"].rpartition(":")[2],
    }
    assert ports == set(service.config.exposed_ports)
    # The worker image runs the example worker; the service's probe does not apply to it.
    assert worker.config.entrypoint == ("python", "-m", "pagekeeper_client.examples.worker")
    assert worker.config.is_healthcheck_none


def test_nothing_but_packages_is_downloaded_at_build_time(dockerfile: Dockerfile) -> None:
    for stage in dockerfile.stages:
        for command in stage.runs():
            assert not re.search(r"\b(curl|wget|git clone|apt-get)\b", command), command
        for ins in stage.instructions:
            if ins.keyword == "ADD":
                assert "://" not in ins.text, ins.text


def test_pins_agree_with_pyproject(dockerfile: Dockerfile) -> None:
    build_runs = " ".join(dockerfile.stage("build").runs())
    tools = _pyproject_pin("grpcio-tools")
    assert f'"{tools}"' in build_runs, (tools, build_runs)
    torch_pin = _pyproject_pin("torch")
    worker = dockerfile.stage("worker")
    version = dict(
        ins.text.split("=", 1)
        for ins in worker.instructions
        if ins.keyword == "ARG" and "=" in ins.text
    )
    assert torch_pin == f"torch=={version['TORCH_VERSION']}"


def test_build_context_holds_every_copy_source_and_nothing_else(
    dockerfile: Dockerfile, context_files: list[str]
) -> None:
    files = set(context_files)
    for stage in dockerfile.stages:
        for flags, sources, _ in stage.copies():
            if "from" in flags:
                continue
            for source in sources:
                prefix = source.rstrip("/")
                assert prefix in files or any(f.startswith(prefix + "/") for f in files), source
    assert "pyproject.toml" in files and "proto/pagekeeper/v1/pagekeeper.proto" in files
    assert "service/pagekeeper/probe.py" in files
    forbidden = (".venv/", ".git/", "tests/", "artifacts/", "data/", "bench/")
    assert not [f for f in files if f.startswith(forbidden)]
    assert not [f for f in files if "__pycache__" in f or f.endswith(".pyc")]
    # The image generates its stubs from proto/: the committed ones stay out.
    assert not [f for f in files if "/_proto/" in f]


def test_dockerignore_semantics() -> None:
    ignore = DockerIgnore.read(ROOT / ".dockerignore")
    assert ignore.is_excluded(".venv/bin/python")
    assert not ignore.is_excluded("service/pagekeeper/server.py")
    assert ignore.is_excluded("service/pagekeeper/__pycache__/server.cpython-311.pyc")
    assert ignore.is_excluded("client/pagekeeper_client/_proto/pagekeeper/v1/pagekeeper_pb2.py")
    assert not ignore.is_excluded("scripts/gen_stubs.py")
    assert ignore.is_excluded("scripts/gpu_smoke.sh")


def test_compose_builds_existing_targets(dockerfile: Dockerfile) -> None:
    compose = load_compose(COMPOSE_FILE)
    for name, spec in compose.services.items():
        assert spec.dockerfile == "Dockerfile", name
        dockerfile.stage(spec.build_target)  # raises for a missing stage


# -- built for real (no engine) -------------------------------------------------------------


def _assemble(stage: Stage, context: list[str], root: Path) -> Path:
    """Execute the stage's COPY lines (sources from the build context) into ``root``."""
    workdir = root / stage.config.workdir.lstrip("/")
    workdir.mkdir(parents=True, exist_ok=True)
    for flags, sources, dest in stage.copies():
        assert "from" not in flags
        target = workdir / dest if not dest.startswith("/") else root / dest.lstrip("/")
        for source in sources:
            prefix = source.rstrip("/")
            if prefix in context:  # a file
                out = target / Path(prefix).name if dest.endswith("/") else target
                out.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / prefix, out)
                continue
            for rel in context:  # a directory: its contents land in dest
                if rel.startswith(prefix + "/"):
                    out = target / rel[len(prefix) + 1 :]
                    out.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(ROOT / rel, out)
    return workdir


@pytest.fixture(scope="module")
def built_wheel(
    dockerfile: Dockerfile, context_files: list[str], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    stage = dockerfile.stage("build")
    root = tmp_path_factory.mktemp("image-root")
    src = _assemble(stage, context_files, root)
    assert not (src / "client/pagekeeper_client/_proto").exists()
    # `python` of the RUN lines is this interpreter (its venv has grpcio-tools).
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    stub_runs = [r for r in stage.runs() if "gen_stubs.py" in r]
    assert len(stub_runs) == 1
    subprocess.run(
        ["/bin/sh", "-c", stub_runs[0]], cwd=src, env={**os.environ, "PATH": path}, check=True
    )
    # The wheel RUN line as written needs the package index for the dependencies; the
    # pagekeeper wheel itself builds from the same /src offline.
    wheel_runs = [r for r in stage.runs() if "pip wheel" in r]
    assert len(wheel_runs) == 1 and '".[service]"' in wheel_runs[0]
    wheels = root / "wheels"
    subprocess.run(
        [
            sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
            "--no-build-isolation", "--wheel-dir", str(wheels), ".",
        ],
        cwd=src,
        check=True,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )  # fmt: skip
    (wheel,) = wheels.glob("pagekeeper-*.whl")
    return wheel


def test_the_wheel_holds_generated_stubs_probe_and_dashboard(built_wheel: Path) -> None:
    names = set(zipfile.ZipFile(built_wheel).namelist())
    for required in (
        "pagekeeper/probe.py",
        "pagekeeper/__main__.py",
        "pagekeeper/rest/static/index.html",
        "pagekeeper_client/_proto/pagekeeper/v1/pagekeeper_pb2.py",
        "pagekeeper_client/_proto/pagekeeper/v1/pagekeeper_pb2_grpc.py",
        "pagekeeper_client/examples/worker.py",
        "pagekeeper_client/examples/scheduler.py",
    ):
        assert required in names, required
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(built_wheel).read(entry_points).decode()
    assert "pagekeeper = pagekeeper.__main__:main" in text


def _healthcheck(
    argv: tuple[str, ...], env: dict[str, str], cwd: Path
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *argv[1:]] if argv[0] == "python" else list(argv),
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_entrypoint_and_healthcheck_of_the_image(
    dockerfile: Dockerfile, built_wheel: Path, tmp_path: Path
) -> None:
    """``docker run pagekeeper`` and its HEALTHCHECK, as local commands on the built wheel."""
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile",
         "--target", str(site), str(built_wheel)],
        check=True,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )  # fmt: skip
    config = dockerfile.stage("service").config
    data = tmp_path / "data"
    data.mkdir()
    grpc_port, http_port = free_loopback_ports(2)
    env = {
        "PATH": f"{site / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "HOME": str(tmp_path),
        # The wheel's packages, not the source tree's (PYTHONPATH precedes the editable
        # install's finder).
        "PYTHONPATH": str(site),
        **config.env,
    }
    # The image's addresses, on free ports; the wildcard host stays, as in the container
    # (the probe must turn it into loopback by itself).
    for key, port in (
        ("PAGEKEEPER_GRPC_ADDRESS", grpc_port),
        ("PAGEKEEPER_HTTP_ADDRESS", http_port),
    ):
        host = config.env[key].rpartition(":")[0]
        assert host == "0.0.0.0"
        env[key] = f"{host}:{port}"
    env["PAGEKEEPER_DATA_DIR"] = str(data)
    check = config.healthcheck
    assert check is not None

    code = "import pagekeeper, pagekeeper_client as c; print(pagekeeper.__file__, c.__file__)"
    where = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert all(path.startswith(str(site)) for path in where.stdout.split()), where.stdout

    argv = config.argv()
    assert argv == ("pagekeeper", "serve")
    executable = shutil.which(argv[0], path=env["PATH"])
    assert executable == str(site / "bin" / "pagekeeper")
    unhealthy = _healthcheck(check.argv, env, data)
    assert unhealthy.returncode == 1, unhealthy  # nothing listens yet
    log = open(tmp_path / "service.log", "wb")  # noqa: SIM115
    process = subprocess.Popen(
        [executable, *argv[1:]], env=env, cwd=data, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + check.start_period_s
        while True:
            assert process.poll() is None, (tmp_path / "service.log").read_text()
            result = _healthcheck(check.argv, env, data)
            if result.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert result.returncode == 0, (result, (tmp_path / "service.log").read_text())
        assert f"ok grpc 127.0.0.1:{grpc_port}" in result.stdout
        assert f"ok http 127.0.0.1:{http_port} /readyz: 200" in result.stdout
        process.send_signal(signal.Signals[config.stop_signal or "SIGTERM"])
        assert process.wait(15) == 0
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        log.close()
    after = _healthcheck(check.argv, env, data)
    assert after.returncode == 1, after
    assert "FAIL grpc" in after.stdout


def test_worker_image_entrypoint_parses_the_compose_commands(
    dockerfile: Dockerfile, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every worker service's command, appended to the worker image's ENTRYPOINT, is a
    valid example-worker command line (argparse and backend specs), and names the worker
    as its health check expects."""
    from pagekeeper_client.examples import worker

    for key in list(os.environ):
        if key.startswith("PAGEKEEPER_"):
            monkeypatch.delenv(key)
    compose = load_compose(COMPOSE_FILE)
    config = dockerfile.stage("worker").config
    num_workers = 0
    for name, spec in compose.services.items():
        if spec.build_target != "worker":
            continue
        num_workers += 1
        argv = config.argv(spec.entrypoint, spec.command)
        assert argv[:3] == ("python", "-m", "pagekeeper_client.examples.worker"), name
        ns = worker.parse_args(list(argv[3:]))
        assert worker.parse_backends(ns.backend), shlex.join(argv)
        assert ns.name == name
        assert ns.device == ("cpu" if spec.profiles == () else f"cuda:{name[-1]}")
        assert spec.healthcheck is not None
        assert spec.healthcheck.argv[-2:] == ("--expect-client", name)
    assert num_workers == 4
