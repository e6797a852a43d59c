"""The shipped Prometheus alert rules and Grafana dashboard (``deploy/``): well-formed, and
every pagekeeper series they name is one a running service exports."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import promql_parser
import pytest
import yaml

from tests.helpers.server import RunningServer

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "pagekeeper-rules.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "pagekeeper-dashboard.json"
SERIES = re.compile(r"\bpagekeeper_[a-z0-9_]+")


def rule_exprs() -> Iterator[tuple[str, str]]:
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            yield rule["alert"], rule["expr"]


def dashboard_exprs() -> Iterator[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            yield panel["title"], target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            yield variable["name"], variable["query"]["query"]


def _parses(expr: str) -> bool:
    """Prometheus's grammar accepts ``expr`` (Grafana's ``$instance`` filled in)."""
    try:
        promql_parser.parse(expr.replace("$instance", ".*"))
    except ValueError:
        return False
    return True


def test_rules_are_well_formed() -> None:
    names = []
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            names.append(rule["alert"])
            assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
            assert rule["labels"]["severity"] in ("critical", "warning", "info")
            assert rule["annotations"]["summary"] and rule["annotations"]["description"]
            assert _parses(rule["expr"]), rule["alert"]
    assert len(names) == len(set(names)) >= 10


def test_a_broken_expression_is_caught() -> None:
    assert not _parses("rate(pagekeeper_steps_total[5m]")
    assert not _parses("pagekeeper_usage_ratio >")
    assert _parses('sum(rate(pagekeeper_steps_total{instance=~"$instance"}[1m]))')


def test_dashboard_is_well_formed() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert _parses(target["expr"]), panel["title"]
            assert 'instance=~"$instance"' in target["expr"], panel["title"]


@pytest.fixture
def exported(server_factory: Callable[..., RunningServer], tmp_path: Path) -> set[str]:
    """The series names a service with the journal, a token file and the ZeroMQ publisher
    exports once called (TLS's are declared even without TLS)."""
    from pagekeeper_client import PagekeeperClient

    tokens = tmp_path / "tokens"
    tokens.write_text("t\n")
    tokens.chmod(0o600)
    server = server_factory(
        "--token-file", str(tokens), "--kv-events-endpoint", "tcp://127.0.0.1:0",
        "--num-pages", "64", "--page-size", "16",
    )  # fmt: skip
    client = PagekeeperClient(server.grpc_address, token="t", local_socket=None)
    try:
        client.register("scheduler", name="observability")
        client.admit("a", list(range(40)))
        client.step(batch=["a"])
        client.pool_info()
    finally:
        client.close()
    http = server.http()
    http.get("/v1/pool")
    text = http.get("/metrics").text
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1] != "#"}
    # A labelled family with no child yet (TLS reloads without TLS) is declared, not sampled:
    # its series appear once the situation does.
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split(" ", 3)
            names.add(family)  # counters are typed under their _total name here
            names.update(family + suffix for suffix in suffixes.get(kind, ("",)))
    return names


def test_every_series_named_is_exported(exported: set[str]) -> None:
    named: dict[str, list[str]] = {}
    for where, expr in [*rule_exprs(), *dashboard_exprs()]:
        for series in SERIES.findall(expr):
            named.setdefault(series, []).append(where)
    assert len(named) >= 20
    missing = {s: w for s, w in named.items() if s not in exported}
    assert not missing, missing
