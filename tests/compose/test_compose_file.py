"""docker-compose.yml, checked as a file: the Compose Specification schema, then what the
schema cannot see (references, IPC, GPU profile, configuration the programs really read),
and the local runner's reading of Compose semantics.

The schema is check-jsonschema's vendored copy of the Compose Specification
(``--builtin-schema vendor.compose-spec``; no network).
"""

from __future__ import annotations

import copy
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from pagekeeper.settings import OPTIONS, load_settings
from tests.compose.compose import (
    ComposeError,
    ComposeFile,
    interpolate,
    load_yaml,
    parse_duration,
)
from tests.compose.dockerfile import parse_dockerfile
from tests.compose.runner import COMPOSE_FILE, ROOT, LocalStack, load_compose

CHECK_JSONSCHEMA = Path(sys.executable).parent / "check-jsonschema"
DEFAULT_SERVICES = ["pagekeeper", "worker-1", "worker-2", "scheduler"]
GPU_SERVICES = ["gpu-worker-0", "gpu-worker-1"]
WORKER_SERVICES = ["worker-1", "worker-2", *GPU_SERVICES]
CLIENT_PROGRAMS = (
    ROOT / "client/pagekeeper_client/examples/worker.py",
    ROOT / "client/pagekeeper_client/examples/scheduler.py",
)


def validate(path: Path) -> subprocess.CompletedProcess[str]:
    assert CHECK_JSONSCHEMA.exists(), (
        "check-jsonschema is missing from the virtualenv (a dev dependency: "
        "pip install check-jsonschema==0.39.0)"
    )
    return subprocess.run(
        [str(CHECK_JSONSCHEMA), "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture(scope="module")
def compose() -> ComposeFile:
    return load_compose(COMPOSE_FILE)  # no variables: every default must do


# -- the schema ------------------------------------------------------------------------------


def test_compose_file_is_valid_against_the_compose_spec() -> None:
    result = validate(COMPOSE_FILE)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok -- validation done" in result.stdout


MUTATIONS = {
    "unknown service key": lambda d: d["services"]["pagekeeper"].update(ipcc="shareable"),
    "unknown depends_on condition": lambda d: d["services"]["scheduler"]["depends_on"][
        "pagekeeper"
    ].update(condition="service_ready"),
    "healthcheck typo": lambda d: d["services"]["pagekeeper"]["healthcheck"].update(
        start_periods="1s"
    ),
    "GPU reservation without capabilities": lambda d: d["services"]["gpu-worker-0"]["deploy"][
        "resources"
    ]["reservations"]["devices"][0].pop("capabilities"),
    "volumes as a list": lambda d: d.update(volumes=["pagekeeper-data"]),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_the_schema_check_rejects_broken_variants(mutation: str, tmp_path: Path) -> None:
    """The validation above is not vacuous: the same file, broken one way, fails."""
    data = copy.deepcopy(load_yaml(COMPOSE_FILE))
    MUTATIONS[mutation](data)
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(yaml.safe_dump(data))
    result = validate(broken)
    assert result.returncode == 1, result.stdout


# -- what the schema cannot see --------------------------------------------------------------


def test_services_and_profiles(compose: ComposeFile) -> None:
    assert compose.active_services() == DEFAULT_SERVICES
    assert compose.active_services(["gpu"]) == DEFAULT_SERVICES + GPU_SERVICES
    assert compose.start_order(compose.active_services(["gpu"]))[0] == "pagekeeper"


def test_ipc_lets_workers_map_the_shared_memory_ring(compose: ComposeFile) -> None:
    services = compose.raw["services"]
    assert services["pagekeeper"]["ipc"] == "shareable"
    for name in WORKER_SERVICES:
        assert services[name]["ipc"] == "service:pagekeeper", name
    # The comment that says why stays with the setting.
    text = COMPOSE_FILE.read_text()
    assert "/dev/shm" in text and "ipc: shareable" in text


def test_dependencies_wait_for_health(compose: ComposeFile) -> None:
    dockerfile = parse_dockerfile(ROOT / "Dockerfile")
    conditions = {
        name: {d.service: d.condition for d in spec.depends_on}
        for name, spec in compose.services.items()
    }
    for name in WORKER_SERVICES:
        assert conditions[name] == {"pagekeeper": "service_healthy"}, name
    assert conditions["scheduler"] == {
        "pagekeeper": "service_healthy",
        "worker-1": "service_healthy",
        "worker-2": "service_healthy",
    }
    for name, deps in conditions.items():
        for dep, condition in deps.items():
            if condition == "service_healthy":
                spec = compose.services[dep]
                image = dockerfile.stage(spec.build_target).config
                has_check = spec.healthcheck is not None or (
                    not spec.is_healthcheck_disabled and image.healthcheck is not None
                )
                assert has_check, f"{name} waits for {dep} to be healthy; it has no check"
    # Every health check is the project's own probe.
    for name, spec in compose.services.items():
        if spec.healthcheck is not None:
            assert spec.healthcheck.argv[:3] == ("python", "-m", "pagekeeper.probe"), name


def test_gpu_profile_reserves_nvidia_devices_and_picks_one_each(compose: ComposeFile) -> None:
    devices = []
    for name, spec in compose.services.items():
        command = list(spec.command or ())
        reservations = (
            spec.engine_only.get("deploy", {}).get("resources", {}).get("reservations", {})
        )
        if name in GPU_SERVICES:
            assert spec.profiles == ("gpu",)
            (device,) = reservations["devices"]
            assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
            value = command[command.index("--device") + 1]
            assert re.fullmatch(r"cuda:\d+", value), value
            devices.append(value)
        else:
            assert not spec.profiles and not reservations, name
            if "--device" in command:
                assert command[command.index("--device") + 1] == "cpu"
    assert sorted(devices) == ["cuda:0", "cuda:1"]


def test_durable_state_lives_on_a_named_volume(compose: ComposeFile) -> None:
    service = compose.services["pagekeeper"]
    (mount,) = [m for m in service.mounts if m.source == "pagekeeper-data"]
    assert mount.is_named_volume and mount.source in compose.volumes
    assert service.environment["PAGEKEEPER_DATA_DIR"] == mount.target
    # The image creates (and gives the non-root user) that directory, so a new volume
    # starts writable.
    image = parse_dockerfile(ROOT / "Dockerfile").stage("service").config
    assert image.env["PAGEKEEPER_DATA_DIR"] == mount.target
    assert image.workdir == mount.target


def test_the_scheduler_reaches_the_same_node_socket(compose: ComposeFile) -> None:
    """The service's local socket lies on a volume the scheduler mounts at the same path
    (the path the service advertises), created by the image for the non-root user."""
    service, scheduler = compose.services["pagekeeper"], compose.services["scheduler"]
    path = service.environment["PAGEKEEPER_LOCAL_SOCKET"]
    assert path is not None
    directory = path.rsplit("/", 1)[0]
    (served,) = [m for m in service.mounts if m.target == directory]
    (shared,) = [m for m in scheduler.mounts if m.target == directory]
    assert served.is_named_volume and served.source == shared.source in compose.volumes
    assert (
        "install -d -o pagekeeper -g pagekeeper -m 0750 " + directory
        in (ROOT / "Dockerfile").read_text()
    )


def test_the_service_environment_is_configuration_the_service_reads(
    compose: ComposeFile,
) -> None:
    known = {option.env for option in OPTIONS}
    env = compose.services["pagekeeper"].environment
    unknown = sorted(k for k in env if k.startswith("PAGEKEEPER_") and k not in known)
    assert not unknown, f"the service ignores {unknown}"
    settings = load_settings(environ={k: v for k, v in env.items() if v is not None})
    assert settings.grpc_address == "0.0.0.0:50051"
    assert settings.http_address == "0.0.0.0:8000"
    assert settings.token  # never an unauthenticated deployment
    assert settings.pool.num_pages == 2048
    assert [g.page_size for g in settings.pool.groups] == [64]
    assert settings.publish_transport == "shm"


def test_client_environment_is_read_by_the_programs(compose: ComposeFile) -> None:
    """Worker and scheduler variables are ones the example programs (or the probe, which
    reads the service settings' names) actually read: a typo would silently do nothing."""
    read = {option.env for option in OPTIONS}
    for program in CLIENT_PROGRAMS:
        read |= set(re.findall(r"PAGEKEEPER_[A-Z_]+", program.read_text()))
    for name in (*WORKER_SERVICES, "scheduler"):
        env = compose.services[name].environment
        unread = sorted(k for k in env if k not in read)
        assert not unread, f"{name}: nothing reads {unread}"
        assert env["PAGEKEEPER_GRPC_ADDRESS"] == "pagekeeper:50051"
        assert (
            env["PAGEKEEPER_TOKEN"]
            == compose.services["pagekeeper"].environment["PAGEKEEPER_TOKEN"]
        )


def test_every_variable_has_a_default_and_ports_stay_on_loopback(compose: ComposeFile) -> None:
    bare = re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", COMPOSE_FILE.read_text())
    assert not bare, f"variables without a default (compose up would need them set): {bare}"
    for port in compose.raw["services"]["pagekeeper"]["ports"]:
        assert port.startswith("127.0.0.1:"), port
    overridden = load_compose(COMPOSE_FILE, {"PAGEKEEPER_NUM_PAGES": "512"})
    assert overridden.services["pagekeeper"].environment["PAGEKEEPER_NUM_PAGES"] == "512"


def test_local_ports_cover_what_each_service_listens_on(compose: ComposeFile) -> None:
    service = compose.services["pagekeeper"]
    listening = {
        int(service.environment[key].rpartition(":")[2])  # type: ignore[union-attr]
        for key in ("PAGEKEEPER_GRPC_ADDRESS", "PAGEKEEPER_HTTP_ADDRESS")
    }
    assert set(service.local_ports) == listening
    published = {int(p.rsplit(":", 1)[1]) for p in compose.raw["services"]["pagekeeper"]["ports"]}
    assert published <= listening
    feed = compose.services["scheduler"].environment["PAGEKEEPER_FEED_ADDRESS"]
    assert feed is not None
    assert compose.services["scheduler"].local_ports == (int(feed.rpartition(":")[2]),)


# -- the runner's reading of Compose --------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "variables", "expected"),
    [
        ("${A:-x}", {}, "x"),
        ("${A:-x}", {"A": ""}, "x"),
        ("${A-x}", {"A": ""}, ""),
        ("${A-x}", {}, "x"),
        ("${A:-${B:-y}}", {}, "y"),
        ("${A:+set}", {"A": "1"}, "set"),
        ("${A:+set}", {}, ""),
        ("$A/$${B}", {"A": "a"}, "a/${B}"),
        ("pre-${A}-post", {"A": "mid"}, "pre-mid-post"),
    ],
)
def test_interpolation(text: str, variables: dict[str, str], expected: str) -> None:
    assert interpolate(text, variables) == expected


def test_interpolation_errors() -> None:
    with pytest.raises(ComposeError, match="required variable A"):
        interpolate("${A:?set A}", {})
    with pytest.raises(ComposeError, match="unclosed"):
        interpolate("${A", {})


def test_durations() -> None:
    assert parse_duration("1m30s") == 90.0
    assert parse_duration("500ms") == 0.5
    assert parse_duration(3) == 3.0
    with pytest.raises(ComposeError):
        parse_duration("10 seconds")


def test_runner_rewrites_addresses_and_mounts(compose: ComposeFile, tmp_path: Path) -> None:
    stack = LocalStack(compose, tmp_path)
    grpc, http = stack.endpoint("pagekeeper", 50051), stack.endpoint("pagekeeper", 8000)
    pagekeeper, worker = stack.services["pagekeeper"], stack.services["worker-1"]
    # The service's own wildcard listen addresses, and other services' references to it.
    assert pagekeeper.env["PAGEKEEPER_GRPC_ADDRESS"] == grpc
    assert pagekeeper.env["PAGEKEEPER_HTTP_ADDRESS"] == http
    assert worker.env["PAGEKEEPER_GRPC_ADDRESS"] == grpc
    assert worker.env["PAGEKEEPER_FEED_ADDRESS"] == stack.endpoint("scheduler", 7000)
    assert stack.services["scheduler"].env["PAGEKEEPER_FEED_ADDRESS"] == stack.endpoint(
        "scheduler", 7000
    )
    # Things that look like HOST:PORT but are not addresses stay as they are.
    assert "0=FLASH_ATTN:x16" in worker.argv and "cpu" in worker.argv
    assert stack.rewrite("worker-1", "0=FLASHINFER:16,32 cuda:1", []) == (
        "0=FLASHINFER:16,32 cuda:1"
    )
    assert stack.rewrite("worker-1", "http://pagekeeper:8000/metrics", []) == (
        f"http://{http}/metrics"
    )
    with pytest.raises(ComposeError, match=r"x-local\.ports"):
        stack.rewrite("worker-1", "pagekeeper:9999", [])
    assert pagekeeper.env["PAGEKEEPER_DATA_DIR"] == str(stack.volume_dir("pagekeeper-data"))
    # Processes: the image's entrypoint with the service's command; python is this venv's.
    assert pagekeeper.argv[1:] == ["serve"]
    assert Path(pagekeeper.argv[0]).parent == Path(sys.executable).parent
    assert worker.argv[:3] == [sys.executable, "-m", "pagekeeper_client.examples.worker"]
    assert worker.healthcheck is not None and worker.healthcheck.start_interval_s == 1.0
    assert stack.services["scheduler"].healthcheck is None  # disabled in the file
    # Nothing of the outer environment leaks into a service.
    assert not {k for k in pagekeeper.env if k.startswith("PYTEST")}


def test_runner_refuses_what_it_cannot_emulate(tmp_path: Path) -> None:
    data: dict[str, Any] = copy.deepcopy(load_yaml(COMPOSE_FILE))
    data["services"]["pagekeeper"]["network_mode"] = "host"
    path = tmp_path / "docker-compose.yml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ComposeError, match="network_mode"):
        load_compose(path)
    data = copy.deepcopy(load_yaml(COMPOSE_FILE))
    data["services"]["scheduler"]["depends_on"]["worker-3"] = {"condition": "service_healthy"}
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ComposeError, match="worker-3"):
        load_compose(path)


def test_down_reports_what_a_service_left_behind(tmp_path: Path) -> None:
    """The leftover checks are not vacuous: a service that leaves a child process holding
    its listening socket and a ring file under its pid is reported on all three counts
    (and the child is killed)."""
    (tmp_path / "Dockerfile").write_text('FROM python:3.11-slim AS base\nENTRYPOINT ["python"]\n')
    script = (
        "import os, signal, socket, subprocess, sys, time\n"
        "sock = socket.create_server(('127.0.0.1', int(os.environ['PORT'])))\n"
        "open(f'/dev/shm/pagekeeper-shm-{os.getpid()}-test-0', 'w').close()\n"
        "subprocess.Popen(['sleep', '60'], pass_fds=[sock.fileno()])\n"
        "time.sleep(60)\n"
    )
    compose_text = {
        "services": {
            "leaky": {
                "build": {"context": ".", "target": "base"},
                "command": ["-c", script],
                "environment": {"PORT": "${PORT:-9000}"},
                "stop_grace_period": "5s",
                "x-local": {"ports": [9000]},
            }
        }
    }
    path = tmp_path / "docker-compose.yml"
    path.write_text(yaml.safe_dump(compose_text))
    stack = LocalStack(load_compose(path), tmp_path / "run")
    port = stack.ports[("leaky", 9000)]
    stack.services["leaky"].env["PORT"] = str(port)
    stack.up()
    pid = stack.services["leaky"].pid
    ring = Path(f"/dev/shm/pagekeeper-shm-{pid}-test-0")
    try:
        deadline = time.monotonic() + 30
        while not ring.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # the child is started right after the file
        report = stack.down()
    finally:
        ring.unlink(missing_ok=True)
    assert not report.is_clean
    assert report.outcome("leaky").signal_sent == "SIGTERM"
    assert [p for p in report.leftover_processes if "sleep 60" in p], report
    assert report.leftover_shm_files == [f"leaky: {ring}"]
    assert report.leftover_listeners == [f"leaky: 127.0.0.1:{port} (9000)"]
