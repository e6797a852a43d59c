"""docker-compose.yml, run for real without a Docker engine (tests/compose/runner.py).

Every service of the default profile starts as a local process from the file's own
commands, environment, health checks and dependencies: the service, two example workers
(``--check``: every row of every step is compared with dense attention) and the example
scheduler (shared system prompts, decode, finish, preemption). Then:

- the REST API lists both workers and the scheduler while the load runs, and /metrics
  shows it (pages in use, requests running, steps, prefix-cache hits);
- both workers followed the same published steps (the scheduler's count), row for row,
  each at its own kernel block size, with no mismatch;
- stopping leaves nothing behind: every process ended on SIGTERM (none needed SIGKILL),
  no ring file in /dev/shm, no listening port.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.compose.runner import COMPOSE_FILE, DownReport, LocalStack, load_compose

pytestmark = pytest.mark.timeout(180)

NUM_STEPS = 40
TOKEN = "compose-test-token"
WORKERS = ("worker-1", "worker-2")


def _metrics(text: str) -> dict[str, float]:
    """Unlabelled samples of a Prometheus exposition."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.partition(" ")
            values[name] = float(value)
    return values


def _read_json(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def _watch_load(stack: LocalStack, http: httpx.Client, timeout: float) -> dict[str, Any]:
    """Poll REST while the scheduler runs, until the clients list shows both workers and
    a scheduler and /metrics shows requests holding pages."""
    deadline = time.monotonic() + timeout
    seen: dict[str, Any] = {}
    while time.monotonic() < deadline:
        clients = http.get("/v1/clients").json()
        metrics = _metrics(http.get("/metrics").text)
        names = {c["name"] for c in clients}
        schedulers = [c for c in clients if c["role"] == "scheduler"]
        if (
            set(WORKERS) <= names
            and schedulers
            and metrics.get("pagekeeper_requests", 0) > 0
            and metrics.get("pagekeeper_used_pages", 0) > 0
        ):
            seen = {"clients": clients, "metrics": metrics}
            return seen
        if stack.services["scheduler"].returncode() is not None:
            break
        time.sleep(0.05)
    pytest.fail(
        "the REST API never showed both workers, a scheduler and a running load\n"
        f"last clients: {clients}\n{stack.services['scheduler'].logs()}"
    )


def _explain(stack: LocalStack) -> str:
    return "\n".join(f"--- {name} ---\n{s.logs(30)}" for name, s in stack.services.items())


def test_compose_stack_runs_the_scenario_and_leaves_nothing_behind(tmp_path: Path) -> None:
    variables = {
        "PAGEKEEPER_TOKEN": TOKEN,
        "PAGEKEEPER_NUM_PAGES": "1024",
        "PAGEKEEPER_SCHEDULER_STEPS": str(NUM_STEPS),
    }
    compose = load_compose(COMPOSE_FILE, variables)
    summaries = tmp_path / "summaries"
    summaries.mkdir()
    extra_args = {
        "scheduler": ["--summary-json", str(summaries / "scheduler.json")],
        **{
            name: ["--check", "--summary-json", str(summaries / f"{name}.json")] for name in WORKERS
        },
    }
    stack = LocalStack(compose, tmp_path / "run", extra_args=extra_args, variables=variables)
    assert stack.order == ["pagekeeper", "worker-1", "worker-2", "scheduler"]
    report: DownReport | None = None
    try:
        stack.up()
        # Compose's ordering held: the scheduler started only once both workers were
        # healthy, i.e. registered (their health check asks the service).
        assert all(stack.services[w].is_healthy for w in WORKERS)
        http = httpx.Client(base_url=f"http://{stack.endpoint('pagekeeper', 8000)}", timeout=10)
        with http:
            during = _watch_load(stack, http, timeout=60)
            assert stack.wait_exit("scheduler", timeout=90) == 0, _explain(stack)
            for name in WORKERS:  # the scheduler's "end" on the feed ends them
                assert stack.wait_exit(name, timeout=30) == 0, _explain(stack)
            after = _metrics(http.get("/metrics").text)
            clients_after = http.get("/v1/clients").json()
    finally:
        report = stack.down()

    # -- the REST API saw the whole deployment, with what each worker registered ----------
    workers = {c["name"]: c for c in during["clients"] if c["role"] == "worker"}
    assert set(workers) == set(WORKERS)
    assert all(w["device"] == "cpu" for w in workers.values())
    assert clients_after == []  # everyone unregistered on the way out
    load = during["metrics"]
    assert load["pagekeeper_clients"] == 3

    # -- both workers followed the same published steps, and their attention matched ----
    scheduler = _read_json(summaries / "scheduler.json")
    assert scheduler["steps"] == NUM_STEPS
    assert scheduler["published"] == NUM_STEPS
    assert scheduler["worker_failures"] == []
    # Its steps went over the service's same-node socket (a volume both mount).
    assert scheduler["transport"] == "local"
    num_rows = round(scheduler["mean_batch"] * scheduler["steps"])
    results = {name: _read_json(summaries / f"{name}.json") for name in WORKERS}
    for name, result in results.items():
        assert result["failures"] == 0, (name, result)
        assert result["steps"] == scheduler["published"], (name, result)
        assert result["rows"] == num_rows, (name, result)
        assert result["rows_checked"] == result["rows"]  # --check: every row compared
        assert result["max_err"] < 1e-4
        assert result["kernel_block_sizes"] == workers[name]["kernel_block_sizes"]
    assert results["worker-1"]["tokens"] == results["worker-2"]["tokens"] > 0
    # The compose file's point: one physical page size, each worker's kernels reading it in
    # their own block size (64-token pages; FLASH_ATTN x16 and FLASHINFER 16/32).
    sizes = {name: tuple(r["kernel_block_sizes"]) for name, r in results.items()}
    assert sizes["worker-1"] != sizes["worker-2"], sizes

    # -- /metrics shows the load ------------------------------------------------------------
    assert after["pagekeeper_steps_total"] >= NUM_STEPS
    assert after["pagekeeper_published_total"] == scheduler["published"]
    assert after["pagekeeper_publish_errors_total"] == 0
    assert after["pagekeeper_allocated_pages_total"] > 0
    # Shared system prompts: admissions hit the prefix cache.
    assert after["pagekeeper_prefix_hits_tokens_total"] > 0
    assert scheduler["cached_tokens"] > 0
    # The scheduler drained: every page went back.
    assert after["pagekeeper_used_pages"] == 0
    assert after["pagekeeper_requests"] == 0

    # -- stopping left nothing behind ----------------------------------------------------
    assert report is not None
    assert report.is_clean, report
    service = report.outcome("pagekeeper")
    assert service.signal_sent == "SIGTERM" and not service.was_killed, service
    assert service.returncode == 0, service
    for name in (*WORKERS, "scheduler"):
        outcome = report.outcome(name)
        assert outcome.signal_sent is None and outcome.returncode == 0, outcome
    # The service's durable state went to the named volume (its local stand-in).
    volume = stack.volume_dir("pagekeeper-data")
    assert stack.services["pagekeeper"].env["PAGEKEEPER_DATA_DIR"] == str(volume)
    assert any(path.is_file() for path in volume.rglob("*")), "no durable state written"


def test_stopping_a_running_stack_uses_sigterm_and_cleans_up(tmp_path: Path) -> None:
    """`docker compose down` on a live stack (the scheduler never ends by itself by
    default): dependents stop first, every process exits on SIGTERM, and nothing stays."""
    variables = {"PAGEKEEPER_TOKEN": TOKEN, "PAGEKEEPER_NUM_PAGES": "512"}
    compose = load_compose(COMPOSE_FILE, variables)
    stack = LocalStack(compose, tmp_path / "run", variables=variables)
    try:
        stack.up()
        http = httpx.Client(base_url=f"http://{stack.endpoint('pagekeeper', 8000)}", timeout=10)
        with http:
            _watch_load(stack, http, timeout=60)
    finally:
        report = stack.down()
    assert [o.service for o in report.outcomes] == [
        "scheduler",
        "worker-2",
        "worker-1",
        "pagekeeper",
    ]
    for outcome in report.outcomes:
        assert outcome.signal_sent == "SIGTERM", outcome
        assert not outcome.was_killed, outcome
    assert report.outcome("pagekeeper").returncode == 0
    assert report.is_clean, report
