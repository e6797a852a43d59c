"""The dashboard in a real headless browser: Debian's chromium driven by chromedriver through
selenium, against the real server (subprocess, loopback, ephemeral ports).

It loads the page with no console error, checks that the page map shows a known state (legend
counts, lane totals and the colour of individual cells), opens a request's page and kernel
block tables, runs a load over gRPC and watches the live charts advance over the event
stream, and saves a screenshot to ``artifacts/dashboard.png``.

Needs ``chromium`` and ``chromedriver`` (``scripts/install_browser.sh``) and ``selenium``;
without them the test skips and says why, unless ``PAGEKEEPER_REQUIRE_BROWSER=1`` (CI), where
a missing browser fails it instead.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2 as pb
from tests.dashboard.known_state import (
    CACHED_PAGES,
    EXPECTED_TOTALS,
    KERNEL_BLOCK_SIZE,
    NUM_PAGES,
    SERVER_FLAGS,
    SHARED_PAGES,
    USED_PAGES,
    make_known_state,
)
from tests.helpers.grpc_util import Scheduler, i32
from tests.helpers.pki import HAVE_OPENSSL, make_pki, tls_args
from tests.helpers.server import ROOT, RunningServer, launch

ARTIFACT = ROOT / "artifacts" / "dashboard.png"
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1440,1000",
    "--force-device-scale-factor=1",
    # The TLS test's server certificate is of a throwaway CA (HTTP asks for no client one).
    "--ignore-certificate-errors",
)
WAIT_S = 15.0


def _unavailable(reason: str) -> None:
    if os.environ.get("PAGEKEEPER_REQUIRE_BROWSER") == "1":
        pytest.fail(f"{reason} (PAGEKEEPER_REQUIRE_BROWSER=1)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def driver() -> Iterator[Any]:
    try:
        from selenium import webdriver
        from selenium.common.exceptions import WebDriverException
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _unavailable("selenium is not installed (pip install selenium==4.51.0)")
    chromium = next(
        (p for name in ("chromium", "chromium-browser") if (p := shutil.which(name))), None
    )
    chromedriver = shutil.which("chromedriver")
    if chromium is None or chromedriver is None:
        _unavailable(
            "chromium and chromedriver are not installed: run scripts/install_browser.sh "
            "(Debian packages chromium, chromium-driver)"
        )
    profile = tempfile.mkdtemp(prefix="pagekeeper-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")  # a fresh profile every run
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    try:
        browser = webdriver.Chrome(options=options, service=Service(chromedriver))
    except WebDriverException as exc:
        shutil.rmtree(profile, ignore_errors=True)
        _unavailable(f"chromium did not start: {exc.msg}")
    browser.set_page_load_timeout(30)
    yield browser
    browser.quit()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    server = launch(tmp_path_factory.mktemp("dashboard-browser"), *SERVER_FLAGS)
    yield server
    server.stop()


def wait_until(check: Callable[[], Any], what: str, timeout: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.1)


def console_errors(browser: Any) -> list[str]:
    return [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"]


# Reads the colour at the middle of page ``p``'s cell in lane 0 (one page per cell here).
CELL_COLOURS_JS = """
const canvas = document.querySelector('.lane[data-group="0"] canvas');
const cell = Number(canvas.dataset.cell), cols = Number(canvas.dataset.cols);
const dpr = canvas.width / parseFloat(canvas.style.width);
const px = Math.max(1, Math.round(cell * dpr));
const ctx = canvas.getContext('2d');
const out = {};
for (const p of arguments[0]) {
  const x = (p % cols) * px + Math.floor(px / 2) - 1;
  const y = Math.floor(p / cols) * px + Math.floor(px / 2) - 1;
  const d = ctx.getImageData(x, y, 1, 1).data;
  out[p] = [d[0], d[1], d[2]];
}
return out;
"""

LEGEND_COLOURS_JS = """
const out = {};
for (const li of document.querySelectorAll('#legend li')) {
  const rgb = getComputedStyle(li.querySelector('.sw')).backgroundColor.match(/\\d+/g);
  out[li.dataset.state] = rgb.slice(0, 3).map(Number);
}
return out;
"""


# The header's chips once the pool was read (null before).
OPS_JS = """
const j = document.getElementById('ops-journal'), t = document.getElementById('ops-tls');
const a = document.getElementById('ops-auth'), k = document.getElementById('ops-kv');
if (!j.dataset.level || !t.dataset.tls) return null;
return {
  journal: {level: j.dataset.level, tone: j.dataset.tone, text: j.textContent, title: j.title},
  tls: {tls: t.dataset.tls, tone: t.dataset.tone, text: t.textContent, title: t.title,
        expiresAt: t.dataset.expiresAt},
  auth: {auth: a.dataset.auth, tone: a.dataset.tone, text: a.textContent, title: a.title},
  kv: {kv: k.dataset.kv, hidden: k.hidden, tone: k.dataset.tone, text: k.textContent,
       title: k.title},
};
"""


def save_full_page_screenshot(browser: Any, path: Path) -> None:
    """The whole page, not just the viewport (Chrome DevTools: capture beyond viewport)."""
    import base64

    width, height = browser.execute_script(
        "const e = document.documentElement; return [e.scrollWidth, e.scrollHeight];"
    )
    shot = browser.execute_cdp_cmd(
        "Page.captureScreenshot",
        {
            "format": "png",
            "captureBeyondViewport": True,
            "clip": {"x": 0, "y": 0, "width": width, "height": height, "scale": 1},
        },
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(base64.b64decode(shot["data"]))


class Load:
    """A scheduler admitting, growing and freeing requests until stopped: shared prefixes,
    decodes and, once fresh pages run out, evictions of cached pages."""

    def __init__(self, server: RunningServer) -> None:
        self.scheduler = Scheduler(server, name="load")
        self.stop = threading.Event()
        self.num_steps = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Load:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)

    def _run(self) -> None:
        try:
            running: list[str] = []
            prefix = list(range(50_000, 50_064))  # 4 pages every load request shares
            n = 0
            while not self.stop.is_set():
                n += 1
                rid = f"load-{n}"
                frees = [running.pop(0)] if len(running) >= 8 else []
                growths = [
                    pb.Growth(request_id=r, num_new_tokens=1, new_token_ids=i32([n % 30_000]))
                    for r in running
                ]
                suffix = list(range(n * 97 % 40_000, n * 97 % 40_000 + 40 + n % 48))
                reply = self.scheduler.step(
                    free_request_ids=frees,
                    growths=growths,
                    admissions=[pb.Admission(request_id=rid, token_ids=i32(prefix + suffix))],
                )
                if reply.results[-1].status == pb.ALLOCATION_STATUS_OK:
                    running.append(rid)
                else:  # no room: preempt the oldest, as a scheduler would
                    if running:
                        self.scheduler.free(running.pop(0))
                self.num_steps += 1
                time.sleep(0.002)
        except BaseException as exc:  # surfaced by the test
            self.error = exc


def test_dashboard_in_a_browser(driver: Any, server: RunningServer) -> None:
    from selenium.webdriver.common.by import By

    known = make_known_state(server, prefix="req")
    browser = driver
    browser.get(server.http_url + "/")
    # Under load (a full `make test`), chromium once answered an empty title right after
    # get() returned; the page is the same, so wait for it rather than read it once.
    title = wait_until(lambda: browser.title, "the dashboard's title")
    assert title.startswith("pagekeeper"), title

    # -- the page map reflects the known state ---------------------------------------------
    wait_until(
        lambda: browser.execute_script(
            "return document.getElementById('page-map').dataset.ready === 'true'"
        ),
        "the first page map",
    )
    page_map = browser.find_element(By.ID, "page-map")
    assert page_map.get_attribute("data-num-pages") == str(NUM_PAGES)
    assert page_map.get_attribute("data-num-bins") == str(NUM_PAGES)  # one cell per page
    legend = {
        li.get_attribute("data-state"): int(li.get_attribute("data-count"))
        for li in browser.find_elements(By.CSS_SELECTOR, "#legend li")
    }
    assert legend == EXPECTED_TOTALS  # no 'other' entry: one group
    lane = browser.find_element(By.CSS_SELECTOR, '.lane[data-group="0"]')
    for state, count in {**EXPECTED_TOTALS, "other": 0}.items():
        assert lane.get_attribute(f"data-{state}") == str(count), state
    colours = browser.execute_script(LEGEND_COLOURS_JS)
    probes = {
        0: "null",
        SHARED_PAGES[0]: "shared",
        SHARED_PAGES[-1]: "shared",
        USED_PAGES[0]: "used",
        USED_PAGES[-1]: "used",
        CACHED_PAGES[0]: "cached",
        CACHED_PAGES[-1]: "cached",
        100: "free",
        NUM_PAGES - 1: "free",
    }
    cells = browser.execute_script(CELL_COLOURS_JS, list(probes))
    for page, state in probes.items():
        assert cells[str(page)] == colours[state], f"page {page}: expected {state}"

    # -- the header: the journal's level, plaintext ---------------------------------------
    ops = wait_until(lambda: browser.execute_script(OPS_JS), "the journal and TLS chips")
    assert ops["journal"]["level"] == "process" and ops["journal"]["tone"] == "ok"
    assert ops["journal"]["text"] == "journal: process"
    assert str(server.workdir / "data") in ops["journal"]["title"]
    assert ops["tls"] == {**ops["tls"], "tls": "off", "text": "plaintext", "tone": "muted"}
    assert ops["auth"] == {**ops["auth"], "auth": "none", "text": "no token", "tone": "muted"}
    assert ops["kv"]["kv"] == "off" and ops["kv"]["hidden"]

    # -- tables: clients with kernel block sizes, the largest requests ---------------------
    wait_until(
        lambda: browser.find_elements(
            By.CSS_SELECTOR, f'#clients tr[data-client="{known.worker_id}"]'
        ),
        "the worker in the clients table",
    )
    worker_row = browser.find_element(
        By.CSS_SELECTOR, f'#clients tr[data-client="{known.worker_id}"]'
    )
    kernel_cell = worker_row.find_element(By.CSS_SELECTOR, "td[data-kernel-block-sizes]")
    assert kernel_cell.get_attribute("data-kernel-block-sizes") == str(KERNEL_BLOCK_SIZE)
    rows = browser.find_elements(By.CSS_SELECTOR, "#requests tbody tr[data-request]")
    ids = known.request_ids
    assert [r.get_attribute("data-request") for r in rows] == [ids["a"], ids["b"], ids["d"]]

    # -- a request's physical table and, under each page, its kernel blocks -----------------
    rows[1].click()
    wait_until(
        lambda: browser.execute_script(
            "const d = document.getElementById('detail');"
            "return !d.hidden && d.dataset.request === arguments[0]"
            " && d.querySelectorAll('.pg').length > 0",
            ids["b"],
        ),
        "the request detail",
    )
    # Read in one script: the panel refreshes itself, so elements found in one call may be
    # replaced before the next (a stale element is the test's race, not the page's).
    detail = browser.execute_script(
        "const t = document.querySelector('#detail .gtable[data-group=\"0\"]');"
        "return {ratio: t.dataset.ratio, pages: [...t.querySelectorAll('.pg')].map(p => ("
        "{page: p.dataset.page, blocks: p.dataset.kernelBlocks,"
        " pid: p.querySelector('.pid').textContent}))};"
    )
    assert detail["ratio"] == "2"  # 16-token pages, 8-token kernel blocks
    pages = detail["pages"]
    assert [int(p["page"]) for p in pages] == [*SHARED_PAGES, 8]
    for p in pages:
        page = int(p["page"])
        assert p["blocks"] == f"{2 * page},{2 * page + 1}"
        assert p["pid"].strip() == str(page)

    # -- live charts advance while a load runs ---------------------------------------------
    def samples() -> int:
        return int(browser.find_element(By.ID, "charts").get_attribute("data-samples"))

    wait_until(lambda: samples() >= 1, "the first sample over the event stream")
    before = samples()
    with Load(server) as load:
        wait_until(lambda: samples() >= before + 3, "three more samples", timeout=20)
        # The steps chart drew the load: its latest points are non-zero.
        wait_until(
            lambda: browser.execute_script(
                "const s = window.pagekeeperDashboard.app.samples;"
                "return s.length && s[s.length - 1].steps_per_s > 0"
                " && s[s.length - 1].step_p50_ms !== null"
            ),
            "a sample with steps/s > 0",
        )
        points = browser.find_element(By.CSS_SELECTOR, '.chart[data-series="steps"]')
        assert int(points.get_attribute("data-points")) >= before + 3
        assert load.error is None, load.error
        # Let the map and tables catch up with the load, then take the picture.
        version = int(page_map.get_attribute("data-version"))
        wait_until(lambda: int(page_map.get_attribute("data-version")) > version, "a refreshed map")
        save_full_page_screenshot(browser, ARTIFACT)
    assert load.num_steps > 10
    assert load.error is None, load.error
    assert Path(ARTIFACT).stat().st_size > 10_000

    errors = console_errors(browser)
    assert not errors, errors


@pytest.mark.skipif(not HAVE_OPENSSL, reason="needs openssl")
def test_the_dashboard_shows_mutual_tls_and_certificate_bindings(
    driver: Any, tmp_path: Path
) -> None:
    """Over HTTPS, with client certificates required for gRPC: the header says mutual TLS
    and how long the served certificate has left (two days here: under the 14-day warning),
    and a client registered with a certificate shows the subject it is bound to."""
    import grpc

    from pagekeeper.tls import certificate_not_after
    from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2_grpc as pb_grpc

    (tmp_path / "pki").mkdir()
    pki = make_pki(tmp_path / "pki")
    tokens = tmp_path / "tokens"
    tokens.write_text("t1\nt2\n")
    tokens.chmod(0o600)
    server = launch(
        tmp_path / "srv",
        *tls_args(pki, client_ca=True),
        "--num-pages", "64", "--token-file", str(tokens),
        "--kv-events-endpoint", "tcp://127.0.0.1:0",
    )  # fmt: skip
    try:
        creds = grpc.ssl_channel_credentials(
            (pki / "ca.pem").read_bytes(),
            (pki / "client.key").read_bytes(),
            (pki / "client.pem").read_bytes(),
        )
        with grpc.secure_channel(server.grpc_address, creds) as channel:
            stub = pb_grpc.PagekeeperServiceStub(channel)
            reg = stub.RegisterClient(
                pb.RegisterClientRequest(role=pb.CLIENT_ROLE_SCHEDULER),
                metadata=(("authorization", "Bearer t2"),),
            )
        driver.get(f"https://{server.http_address}/")
        ops = wait_until(lambda: driver.execute_script(OPS_JS), "the journal and TLS chips")
        expires = certificate_not_after((pki / "server.pem").read_bytes())
        assert ops["tls"]["tls"] == "mutual" and float(ops["tls"]["expiresAt"]) == expires
        assert ops["tls"]["tone"] == "warn", ops["tls"]  # two days left
        assert ops["tls"]["text"].startswith("mutual TLS · cert "), ops["tls"]
        assert str(pki / "server.pem") in ops["tls"]["title"]
        assert ops["auth"]["auth"] == "file" and ops["auth"]["text"] == "token file · 2"
        assert str(tokens) in ops["auth"]["title"] and "t1" not in ops["auth"]["title"]
        endpoint = server.info["kv_events_endpoint"]
        assert ops["kv"] == {
            **ops["kv"], "kv": "on", "hidden": False, "tone": "ok",
            "text": f"KV events → {endpoint}",
        }  # fmt: skip
        row = wait_until(
            lambda: driver.execute_script(
                'const r = document.querySelector(`#clients tr[data-client="${arguments[0]}"]`);'
                "return r && {identity: r.dataset.identity,"
                " badge: r.querySelector('.ident') && r.querySelector('.ident').textContent};",
                reg.client_id,
            ),
            "the bound client in the clients table",
        )
        assert row == {"identity": "client", "badge": "client"}
        assert console_errors(driver) == []
    finally:
        server.stop()


def test_the_dashboard_asks_for_the_token_when_reads_need_one(driver: Any, tmp_path: Path) -> None:
    """With http_read_auth the page itself loads, its data answers 401: the dashboard asks
    for the token once, then shows the pool and says reads need a token."""
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    server = launch(tmp_path / "srv", "--num-pages", "64", "--http-read-auth", token="tok")
    try:
        driver.get(server.http_url + "/")
        WebDriverWait(driver, WAIT_S).until(expected_conditions.alert_is_present())
        prompt = driver.switch_to.alert
        assert "token" in prompt.text
        prompt.send_keys("tok")
        prompt.accept()
        ops = wait_until(lambda: driver.execute_script(OPS_JS), "the header chips")
        assert ops["auth"]["text"] == "token · reads too", ops["auth"]
        assert "HTTP reads need a token" in ops["auth"]["title"]
        wait_until(
            lambda: driver.execute_script(
                "return document.getElementById('page-map').dataset.ready === 'true'"
            ),
            "the page map, fetched with the token",
        )
        assert driver.execute_script("return sessionStorage.getItem('pagekeeper-token')") == "tok"
    finally:
        server.stop()
