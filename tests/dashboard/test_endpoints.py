"""The dashboard's HTTP surface on the real server (subprocess, loopback, ephemeral ports):
the page and its files, the page map of a known state, the largest requests, the samples,
and the event stream's wire format, resumption and shutdown."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pagekeeper.core.errors import NotFound
from pagekeeper.rest.app import create_app
from pagekeeper.rest.routers.dashboard import STATIC_DIR, _static_file
from pagekeeper.runtime import build_runtime
from pagekeeper.settings import Settings
from tests.dashboard.known_state import (
    CACHED_PAGES,
    EXPECTED_TOTALS,
    NUM_PAGES,
    SERVER_FLAGS,
    SHARED_PAGES,
    USED_PAGES,
    KnownState,
    make_known_state,
)
from tests.helpers.server import RunningServer, launch


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    server = launch(tmp_path_factory.mktemp("dashboard-endpoints"), *SERVER_FLAGS)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def known(server: RunningServer) -> KnownState:
    return make_known_state(server)


def read_events(response: httpx.Response, count: int, timeout: float = 10.0) -> list[dict]:
    """The first ``count`` events of a stream, parsed (comments skipped)."""
    events: list[dict] = []
    fields: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    for line in response.iter_lines():
        assert time.monotonic() < deadline, f"only {len(events)} events in {timeout}s"
        if line == "":
            if fields:
                events.append(fields)
                fields = {}
                if len(events) == count:
                    return events
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        assert name in {"retry", "event", "id", "data"}, line
        fields[name] = value[1:] if value.startswith(" ") else value
    raise AssertionError(f"stream ended after {len(events)} events")


# -- the page and its files -------------------------------------------------------------------


def test_index_and_static_files(server: RunningServer):
    http = server.http()
    page = http.get("/")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    html = page.text
    assert 'id="page-map"' in html
    # Every asset is local (works offline): no http(s) URL is loaded by the page.
    for src in ("/dashboard/static/app.js", "/dashboard/static/vendor/uPlot.iife.min.js"):
        assert src in html
        asset = http.get(src)
        assert asset.status_code == 200
        assert asset.headers["content-type"].startswith("text/javascript")
        assert asset.headers["cache-control"] == "no-cache"
    assert not re.findall(r'(?:src|href)="(?:https?:)?//', html), "the page loads remote files"
    css = http.get("/dashboard/static/dashboard.css")
    assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
    assert http.get("/dashboard/static/nope.js").status_code == 404
    assert http.get("/dashboard/static/%2e%2e/routers/dashboard.py").status_code == 404


def test_static_files_never_leave_the_static_directory():
    assert _static_file("index.html") == STATIC_DIR / "index.html"
    for bad in ("../routers/dashboard.py", "/etc/passwd", "vendor", "vendor/../../app.py"):
        with pytest.raises(NotFound):
            _static_file(bad)


def test_static_files_ship_in_the_package():
    names = {p.relative_to(STATIC_DIR).as_posix() for p in STATIC_DIR.rglob("*") if p.is_file()}
    assert {
        "index.html",
        "app.js",
        "dashboard.css",
        "vendor/uPlot.iife.min.js",
        "vendor/uPlot.min.css",
        "vendor/uPlot.LICENSE",
    } <= names
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert '"static/*", "static/**/*"' in pyproject


def test_openapi_documents_the_json_but_not_the_stream():
    paths = create_app(build_runtime(Settings(publish_transport="none"))).openapi()["paths"]
    assert {"/v1/dashboard/page-map", "/v1/dashboard/requests", "/v1/dashboard/samples"} <= set(
        paths
    )
    assert "/v1/dashboard/stream" not in paths  # it never ends: no fuzzer may call it
    assert "/" not in paths


# -- JSON ---------------------------------------------------------------------------------------


def test_page_map_of_the_known_state_is_exact(server: RunningServer, known: KnownState):
    body = server.http().get("/v1/dashboard/page-map", params={"bins": 4096}).json()
    assert body["num_pages"] == NUM_PAGES
    assert body["num_bins"] == NUM_PAGES  # more bins than pages: one page per bin
    assert body["pool_totals"] == EXPECTED_TOTALS
    (lane,) = body["groups"]
    assert lane["kind"] == "full" and lane["page_size"] == 16
    assert lane["totals"] == {**EXPECTED_TOTALS, "other": 0}
    bins = lane["bins"]
    assert "other" not in bins
    assert [p for p, n in enumerate(bins["shared"]) if n] == SHARED_PAGES
    assert [p for p, n in enumerate(bins["used"]) if n] == USED_PAGES
    assert [p for p, n in enumerate(bins["cached"]) if n] == CACHED_PAGES
    assert [p for p, n in enumerate(bins["null"]) if n] == [0]
    # The same pool as /v1/pool sees it.
    pages = server.http().get("/v1/pool").json()["pages"]
    assert pages["num_used_pages"] == len(SHARED_PAGES) + len(USED_PAGES)
    assert pages["num_free_cached_pages"] == len(CACHED_PAGES)


def test_page_map_binned(server: RunningServer, known: KnownState):
    body = server.http().get("/v1/dashboard/page-map", params={"bins": 16}).json()
    assert body["num_bins"] == 16
    (lane,) = body["groups"]
    # 256 pages in 16 bins of 16: bin 0 holds pages 0-15, which is every non-free page.
    assert {s: v[0] for s, v in lane["bins"].items()} == {
        "free": 0,
        "cached": 4,
        "used": 5,
        "shared": 6,
        "null": 1,
    }
    assert all(v[1:] == [0] * 15 for s, v in lane["bins"].items() if s != "free")
    assert lane["bins"]["free"][1:] == [16] * 15


@pytest.mark.parametrize("bins", ["0", "65537", "x"])
def test_page_map_rejects_bad_bins(server: RunningServer, bins: str):
    response = server.http().get("/v1/dashboard/page-map", params={"bins": bins})
    assert response.status_code == 422
    assert response.headers["content-type"].startswith("application/problem+json")


def test_largest_requests(server: RunningServer, known: KnownState):
    body = server.http().get("/v1/dashboard/requests", params={"limit": 2}).json()
    assert body["num_requests"] == 3
    ids = known.request_ids
    # a and b both hold 7 pages (ties keep admission order); d holds 3.
    assert [r["request_id"] for r in body["items"]] == [ids["a"], ids["b"]]
    b = body["items"][1]
    assert b["num_pages"] == [7] and b["num_pages_total"] == 7
    assert b["num_tokens"] == 100 and b["num_cached_tokens"] == 96
    assert b["owner"] == known.scheduler.client_id
    everything = server.http().get("/v1/dashboard/requests").json()["items"]
    assert [r["request_id"] for r in everything] == [ids["a"], ids["b"], ids["d"]]


def test_samples_accumulate(server: RunningServer):
    http = server.http()
    first = http.get("/v1/dashboard/samples").json()
    assert first["interval_s"] == 1.0
    deadline = time.monotonic() + 5
    while True:
        later = http.get("/v1/dashboard/samples", params={"since": first["last_seq"]}).json()
        if later["samples"]:
            break
        assert time.monotonic() < deadline, "no new sample within 5 s"
        time.sleep(0.2)
    assert all(s["seq"] > first["last_seq"] for s in later["samples"])
    assert later["last_seq"] == later["samples"][-1]["seq"]


# -- the event stream -------------------------------------------------------------------------


def test_stream_sends_history_then_live_samples(server: RunningServer, known: KnownState):
    with (
        httpx.Client(base_url=server.http_url, timeout=10) as client,
        client.stream("GET", "/v1/dashboard/stream") as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["cache-control"] == "no-cache"
        history, live1, live2 = read_events(response, 3)
    assert history["event"] == "history"
    assert history["retry"] == "2000"
    body = json.loads(history["data"])
    assert body["replace"] is True
    assert body["interval_s"] == 1.0
    assert body["samples"], "the sampler started with the server: history is not empty"
    seqs = [s["seq"] for s in body["samples"]]
    assert seqs == sorted(seqs)
    assert history["id"] == str(seqs[-1])
    for event, expected_seq in ((live1, seqs[-1] + 1), (live2, seqs[-1] + 2)):
        assert event["event"] == "sample"
        sample = json.loads(event["data"])
        assert sample["seq"] == expected_seq == int(event["id"])
        assert set(sample) >= {
            "t",
            "usage",
            "hit_rate",
            "evictions_per_s",
            "steps_per_s",
            "step_p50_ms",
            "step_p99_ms",
        }
        # The known state holds 11 of 255 pages.
        assert sample["num_used_pages"] == 11
        assert sample["usage"] == pytest.approx(11 / 255)


def test_stream_resumes_after_last_event_id(server: RunningServer):
    http = server.http()
    last = http.get("/v1/dashboard/samples").json()["last_seq"]
    assert last >= 2
    with httpx.Client(base_url=server.http_url, timeout=10) as client:
        headers = {"Last-Event-ID": str(last - 1)}
        with client.stream("GET", "/v1/dashboard/stream", headers=headers) as response:
            (history,) = read_events(response, 1)
        body = json.loads(history["data"])
        assert body["replace"] is False
        assert [s["seq"] for s in body["samples"]][:2] == [last, last + 1][: len(body["samples"])]
        # An id the server never issued (it restarted): start over with everything.
        headers = {"Last-Event-ID": str(last + 10_000)}
        with client.stream("GET", "/v1/dashboard/stream", headers=headers) as response:
            (history,) = read_events(response, 1)
        body = json.loads(history["data"])
        assert body["replace"] is True
        assert body["samples"][0]["seq"] <= last


def test_shutdown_ends_open_streams(tmp_path: Path):
    server = launch(tmp_path / "stream-shutdown", "--num-pages", "32")
    got_history = threading.Event()
    ended = threading.Event()

    def listen() -> None:
        try:
            with (
                httpx.Client(base_url=server.http_url, timeout=30) as client,
                client.stream("GET", "/v1/dashboard/stream") as response,
            ):
                for line in response.iter_lines():
                    if line.startswith("event: history"):
                        got_history.set()
        except httpx.HTTPError:
            pass
        ended.set()

    thread = threading.Thread(target=listen, daemon=True)
    thread.start()
    assert got_history.wait(10)
    started = time.monotonic()
    assert server.stop(timeout=15) == 0
    assert time.monotonic() - started < 5, "an open event stream held up shutdown"
    assert ended.wait(5)
