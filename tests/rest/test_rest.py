"""Every REST path against the real server, with the gRPC side driving the state."""

from __future__ import annotations

import re
import time
import urllib.parse

import grpc
import numpy as np
import pytest

from pagekeeper.core.hashing import native_hashing
from pagekeeper.core.pool import native_pool
from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2 as pb
from pagekeeper_client.errors import InvalidArgumentError, NotFoundError
from tests.helpers.grpc_util import Scheduler, from_i32, i32

PROBLEM = "application/problem+json"


@pytest.fixture
def running(pagekeeper_server):
    """A scheduler holding two requests (one reusing the other's prefix)."""
    sched = Scheduler(pagekeeper_server, "rest")
    # Tokens unique to this scheduler: earlier tests' cached pages must not hit.
    seed = int(sched.client_id.rsplit("-", 1)[1])
    tokens = np.random.default_rng(seed).integers(0, 30_000, 70).tolist()
    a, b = f"{sched.client_id}-a", f"{sched.client_id}-b"
    first = sched.admit(a, tokens)
    assert first.num_cached_tokens == 0
    assert sched.admit(b, tokens).num_cached_tokens == 64
    yield sched, a, b, from_i32(first.new_page_ids[0]), tokens
    sched.stub.Unregister(
        pb.UnregisterRequest(client_id=sched.client_id, generation=sched.generation),
        metadata=sched.md,
    )


def test_health_and_readiness(pagekeeper_server):
    http = pagekeeper_server.http()
    assert http.get("/healthz").json() == {"status": "ok"}
    assert http.get("/readyz").json() == {"status": "ready"}


def test_pool(pagekeeper_server, running):
    pool = pagekeeper_server.http().get("/v1/pool").json()
    assert pool["config"]["num_pages"] == 512
    # The server subprocess runs this checkout's package: it hashes as this process does.
    assert pool["config"]["native_hashing"] is native_hashing()
    assert pool["config"]["native_pool"] is native_pool()
    assert pool["groups"][0]["page_size"] == 16
    assert pool["groups"][0]["num_used_pages"] == pool["pages"]["num_used_pages"] > 0
    pages = pool["pages"]
    assert pages["num_free_pages"] + pages["num_used_pages"] == 511
    assert pool["prefix_cache"]["hits_tokens"] >= 64
    assert 0 < pool["prefix_cache"]["hit_rate"] <= 1
    assert pool["steps"]["num_steps"] >= 2
    assert pool["num_requests"] >= 2 and pool["num_clients"] >= 1
    # The default durability: every step so far is a record in the journal.
    durability = pool["durability"]
    assert durability["level"] == "process" and durability["failure"] == ""
    assert durability["last_seq"] >= pool["steps"]["num_steps"]
    assert durability["records_since_snapshot"] <= durability["last_seq"]
    assert durability["journal_segments"] >= 1 and durability["journal_bytes"] > 0
    assert pool["tls"] == {
        "enabled": False,
        "client_certificates": False,
        "cert_file": None,
        "expires_at": None,
        "num_reloads": 0,
    }


def test_pages(pagekeeper_server, running):
    http = pagekeeper_server.http()
    _, _, _, pages_a, _ = running
    shared = http.get(f"/v1/pages/{pages_a[0]}").json()
    assert shared["state"] == "used" and shared["ref_count"] == 2
    assert shared["is_cached"] and len(shared["page_hash"]) == 64  # sha256 hex
    assert shared["group_id"] == 0
    null = http.get("/v1/pages/0").json()
    assert null["state"] == "null" and null["ref_count"] == 0
    missing = http.get("/v1/pages/512")
    assert missing.status_code == 404 and missing.headers["content-type"] == PROBLEM
    assert missing.json()["type"].endswith("/not_found")
    # Listing by state, paginated: concatenated pages equal the whole listing.
    used = http.get("/v1/pages", params={"state": "used", "limit": 1000}).json()
    assert {p["page_id"] for p in used["items"]} >= set(pages_a)
    assert used["next_cursor"] is None
    collected, cursor = [], None
    while True:
        params = {"state": "used", "limit": 2} | ({"cursor": cursor} if cursor else {})
        chunk = http.get("/v1/pages", params=params).json()
        collected += [p["page_id"] for p in chunk["items"]]
        cursor = chunk["next_cursor"]
        if cursor is None:
            break
    assert collected == [p["page_id"] for p in used["items"]]
    free = http.get("/v1/pages", params={"state": "free", "limit": 5}).json()["items"]
    assert all(p["state"] == "free" and p["ref_count"] == 0 for p in free)
    assert http.get("/v1/pages", params={"cursor": "x"}).status_code == 400
    assert http.get("/v1/pages", params={"state": "bogus"}).status_code == 422


def test_requests(pagekeeper_server, running):
    http = pagekeeper_server.http()
    sched, a, b, pages_a, _ = running
    listed = {
        r["request_id"]: r for r in http.get("/v1/requests", params={"limit": 1000}).json()["items"]
    }
    assert listed[a]["owner"] == sched.client_id
    assert listed[b]["num_cached_tokens"] == 64
    assert listed[a]["num_pages"] == [5]
    detail = http.get(f"/v1/requests/{a}").json()
    assert detail["page_ids"] == [pages_a]
    assert detail["kernel_block_ids"] is None
    with_kernel = http.get(f"/v1/requests/{a}", params={"kernel_block_size": 8}).json()
    assert with_kernel["kernel_block_ids"] == [[p * 2 + j for p in pages_a for j in range(2)]]
    bad = http.get(f"/v1/requests/{a}", params={"kernel_block_size": 5})
    assert bad.status_code == 400 and "does not divide" in bad.json()["detail"]
    assert http.get("/v1/requests/nope").status_code == 404


def test_clients(pagekeeper_server, running):
    sched = running[0]
    clients = {c["client_id"]: c for c in pagekeeper_server.http().get("/v1/clients").json()}
    mine = clients[sched.client_id]
    assert mine["role"] == "scheduler" and mine["name"] == "rest"
    assert mine["generation"] == 1 and mine["num_requests"] == 2
    assert mine["last_step_id"] == sched.step_id
    assert 0 < mine["lease_remaining_s"] <= mine["lease_ttl_s"]


def test_events(pagekeeper_server, running):
    http = pagekeeper_server.http()
    everything = http.get("/v1/events", params={"since": 0, "limit": 10000}).json()
    assert not everything["fell_behind"]
    stored = [e for e in everything["events"] if e["type"] == "stored"]
    # Hex digests: the service's are 32 bytes; a client's may be of another size (tests
    # sharing this server send 16-byte engine hashes).
    hashes = [h for e in stored for h in e["page_hashes"]]
    assert stored and all(re.fullmatch("(?:[0-9a-f]{2}){1,64}", h) for h in hashes)
    assert any(len(h) == 64 for h in hashes)
    last = everything["last_event_seq"]
    assert http.get("/v1/events", params={"since": last}).json()["events"] == []
    tail = http.get("/v1/events", params={"since": last - 1}).json()["events"]
    assert [e["seq"] for e in tail] == [last]


def test_lookup(pagekeeper_server, running):
    http = pagekeeper_server.http()
    tokens = running[4]
    hit = http.post("/v1/lookup", json={"token_ids": tokens}).json()
    assert hit["num_hit_tokens"] == 64 and len(hit["page_ids"][0]) == 4
    salted = http.post(
        "/v1/lookup", json={"token_ids": tokens, "extra_keys": {"cache_salt": "s"}}
    ).json()
    assert salted["num_hit_tokens"] == 0
    # Client-computed hashes give the same answer.
    by_hash = http.post("/v1/lookup", json={"token_ids": tokens, "page_hashes": hit["page_hashes"]})
    assert by_hash.json()["num_hit_tokens"] == 64
    assert http.post("/v1/lookup", json={"token_ids": [-1]}).status_code == 422
    # A body that is missing, not JSON or not an object gets plain words, not pydantic's.
    for kwargs, words in (
        ({"content": b"token_ids=1", "headers": {"content-type": "text/plain"}}, "content-type"),
        ({}, "content-type: application/json (got none)"),
        ({"content": b"{bad", "headers": {"content-type": "application/json"}}, "not valid JSON"),
        ({"json": [1, 2]}, "must be a JSON object"),
        ({"json": {}}, "body.token_ids: Field required"),
        ({"json": {"token_ids": [1e30]}}, "body.token_ids.0: number too large"),
    ):
        refused = http.post("/v1/lookup", **kwargs)
        assert refused.status_code == 422 and refused.headers["content-type"] == PROBLEM
        assert words in refused.json()["detail"], refused.json()
    too_long = http.post("/v1/lookup", json={"token_ids": [1] * 4097})
    assert too_long.status_code == 400 and "max_model_len" in too_long.json()["detail"]
    assert (
        http.post("/v1/lookup", json={"token_ids": [1], "page_hashes": ["abc"]}).status_code == 400
    )


def test_admin_needs_the_admin_token(pagekeeper_server, running):
    http = pagekeeper_server.http()
    _, a, *_ = running
    for method, path in (("POST", "/v1/admin/reset-prefix-cache"), ("DELETE", f"/v1/requests/{a}")):
        missing = http.request(method, path)
        assert missing.status_code == 401 and missing.headers["content-type"] == PROBLEM
        assert missing.headers["www-authenticate"].startswith("Bearer")
        # The gRPC token is not the admin token.
        wrong = http.request(
            method, path, headers={"Authorization": f"Bearer {pagekeeper_server.token}"}
        )
        assert wrong.status_code == 401
    assert http.get(f"/v1/requests/{a}").status_code == 200  # nothing happened


def test_admin_force_free_and_reset(pagekeeper_server, running):
    http = pagekeeper_server.http()
    sched, a, *_ = running
    headers = pagekeeper_server.admin_headers
    busy = http.post("/v1/admin/reset-prefix-cache", headers=headers)
    assert busy.status_code == 409 and busy.json()["type"].endswith("/failed_precondition")
    freed = http.delete(f"/v1/requests/{a}", headers=headers)
    assert freed.json() == {"request_id": a, "owner": sched.client_id}
    assert http.get(f"/v1/requests/{a}").status_code == 404
    assert http.delete(f"/v1/requests/{a}", headers=headers).status_code == 404
    # The client's own count follows.
    mine = {c["client_id"]: c for c in http.get("/v1/clients").json()}[sched.client_id]
    assert mine["num_requests"] == 1
    assert mine["revoked_request_ids"] == [a]
    gauge = re.search(r"^pagekeeper_revoked_requests (\S+)$", http.get("/metrics").text, re.M)
    assert gauge is not None and float(gauge.group(1)) >= 1  # the server is shared
    freed_total = re.search(
        r"^pagekeeper_force_frees_total (\S+)$", http.get("/metrics").text, re.M
    )
    assert freed_total is not None and float(freed_total.group(1)) >= 1
    # The owner's next free of it is accepted as done (a stale view refuses no step).
    reply = sched.step(free_request_ids=[a])
    assert list(reply.results) == []
    assert http.get(f"/v1/requests/{a}").status_code == 404
    mine = {c["client_id"]: c for c in http.get("/v1/clients").json()}[sched.client_id]
    assert mine["revoked_request_ids"] == []


def test_owner_client_steps_on_after_a_force_free(server_factory):
    """The real client, its request freed by an admin under it: the queued free goes
    through, a decode of the other request and the batch too; a decode of the freed one is
    answered NO_CAPACITY (the scheduler preempts it) instead of a refused step resent
    forever."""
    from pagekeeper_client import PagekeeperClient

    server = server_factory("--num-pages", "64", admin_token="adm")
    http = server.http()
    admin = {"Authorization": "Bearer adm"}
    with PagekeeperClient(server.grpc_address, local_socket=None) as client:
        client.register("scheduler", name="owner")
        for rid, start in (("v", 100), ("o", 200), ("w", 300)):
            client.admit(rid, list(range(start, start + 40)))
        client.step()
        assert http.delete("/v1/requests/v", headers=admin).status_code == 200
        client.free_later("v")
        client.step(batch=["o"])
        assert not client.has_request("v")
        assert http.delete("/v1/requests/w", headers=admin).status_code == 200
        # Its decode fits its pages: answered here; the step's batch tells the client.
        assert client.allocate_slots("w", 1, new_token_ids=[7]).is_local
        result = client.step(batch=["o", "w"])
        assert result.revoked_request_ids == ("w",)
        assert result.unscheduled_request_ids == ("w",)
        # From then on the client answers it NO_CAPACITY (the scheduler preempts it) ...
        refused = client.allocate_slots("w", 1, new_token_ids=[8])
        assert refused.status.name == "NO_CAPACITY" and "admin" in refused.reason
        # ... in a decode step too (nothing planned for it; NO_CAPACITY with the step) ...
        assert client.allocate_decodes(["w", "o"], [9, 10]) == ["w"]
        decoded = client.step(batch=["o"])
        assert [(r.request_id, r.status.name) for r in decoded.results] == [("w", "NO_CAPACITY")]
        # ... while a free of it is queued and the queue dropped, too ...
        client.free_later("w")
        client.discard_queued()
        assert client.allocate_slots("w", 1, new_token_ids=[8]).status.name == "NO_CAPACITY"
        # ... and not after a free of it queued, nor for a new request under its id.
        with pytest.raises(InvalidArgumentError):  # the other rows are checked as ever
            client.allocate_decodes(["w", "o"], np.array([9.5, 10.5]))
        client.free_later("w")
        with pytest.raises(NotFoundError):
            client.allocate_slots("w", 1, new_token_ids=[8])
        client.admit("w", list(range(300, 340)), sync=False)
        assert not client.is_revoked("w")
        client.step(batch=["o"])
        assert client.allocate_slots("w", 1, new_token_ids=[8]).status.name == "OK"
        # ... and its free is accepted.
        client.free("w")
        assert client.step(batch=["o"]).revoked_request_ids == ()
        assert [r["request_id"] for r in http.get("/v1/requests").json()["items"]] == ["o"]
        # A growth the service sees (a page needed) is refused there with the reason.
        assert http.delete("/v1/requests/o", headers=admin).status_code == 200
        grown = client.allocate_slots("o", 40, new_token_ids=list(range(40)), sync=True)
        assert grown.status.name == "NO_CAPACITY" and "admin" in grown.reason
        client.free("o")
        client.step()
        assert http.get("/v1/requests").json()["items"] == []


def test_request_ids_with_a_slash(pagekeeper_server):
    """Ids are any 1-256 bytes: one holding "/" is read and force-freed by its %2F form,
    as the dashboard sends it."""
    sched = Scheduler(pagekeeper_server, "slash")
    http = pagekeeper_server.http()
    for k, rid in enumerate((f"{sched.client_id}/tenant/a b?#", f"{sched.client_id}\nline\r")):
        tokens = list(range(5000 + 100 * k, 5040 + 100 * k))
        assert sched.admit(rid, tokens).status == pb.ALLOCATION_STATUS_OK
        quoted = "/v1/requests/" + urllib.parse.quote(rid, safe="")
        got = http.get(quoted, params={"kernel_block_size": 16})
        assert got.status_code == 200 and got.json()["request_id"] == rid
        freed = http.delete(quoted, headers=pagekeeper_server.admin_headers)
        assert freed.status_code == 200 and freed.json()["request_id"] == rid
        assert http.get(quoted).status_code == 404
    sched.stub.Unregister(
        pb.UnregisterRequest(client_id=sched.client_id, generation=sched.generation),
        metadata=sched.md,
    )


def test_request_walk_lists_each_live_request_once_while_others_come_and_go(server_factory):
    """The /v1/requests cursor is a key (the last id returned), not a position: freeing
    or admitting requests mid-walk neither skips nor repeats one that runs throughout."""
    server = server_factory("--num-pages", "64")
    sched = Scheduler(server)
    for k, rid in enumerate("abcdef"):
        sched.admit(rid, list(range(100 * k, 100 * k + 5)))
    http = server.http()
    first = http.get("/v1/requests", params={"limit": 2}).json()
    assert [r["request_id"] for r in first["items"]] == ["a", "b"]
    sched.free("a")  # a position cursor skipped "c" here
    sched.admit("0", list(range(900, 905)))  # before the cursor: not listed, nothing repeats
    seen, cursor = [], first["next_cursor"]
    while cursor is not None:
        page = http.get("/v1/requests", params={"limit": 2, "cursor": cursor}).json()
        seen += [r["request_id"] for r in page["items"]]
        cursor = page["next_cursor"]
    assert seen == ["c", "d", "e", "f"]
    for bad in ("x", "2", "k!!", "k" + "A" * 2000):
        refused = http.get("/v1/requests", params={"cursor": bad})
        assert refused.status_code == 400 and "invalid cursor" in refused.json()["detail"]
    for bad in ("\u00b2", "\u2460", "\u0663"):  # digits to str.isdigit, not to the API
        assert http.get("/v1/pages", params={"cursor": bad}).status_code == 400


def test_http_method_label_is_bounded(pagekeeper_server):
    http = pagekeeper_server.http()
    for k in range(3):
        assert http.request(f"BOGUS{k}", "/nope").status_code in (404, 405)
    text = http.get("/metrics").text
    assert 'method="BOGUS' not in text and 'method="other"' in text


def test_routing_errors_are_problems_too(pagekeeper_server):
    http = pagekeeper_server.http()
    wrong = http.put("/v1/pool")
    assert wrong.status_code == 405 and wrong.headers["content-type"] == PROBLEM
    assert wrong.headers["allow"] == "GET"
    body = wrong.json()
    assert body["type"] == "about:blank" and body["title"] == "Method Not Allowed"
    assert body["status"] == 405
    missing = http.get("/v1/no-such-thing")
    assert missing.status_code == 404 and missing.json()["type"].endswith("/not_found")


def test_admin_disabled_without_a_token(server_factory):
    server = server_factory("--num-pages", "32")
    http = server.http()
    refused = http.post("/v1/admin/reset-prefix-cache")
    assert refused.status_code == 403 and "PAGEKEEPER_ADMIN_TOKEN" in refused.json()["detail"]


def test_reset_over_http(server_factory):
    server = server_factory("--num-pages", "32", admin_token="adm")
    sched = Scheduler(server)
    sched.admit("r", list(range(40)))
    sched.free("r")
    http = server.http()
    assert (
        http.post("/v1/lookup", json={"token_ids": list(range(40))}).json()["num_hit_tokens"] == 32
    )
    reset = http.post("/v1/admin/reset-prefix-cache", headers={"Authorization": "Bearer adm"})
    assert reset.json() == {"num_dropped_pages": 2}
    assert (
        http.post("/v1/lookup", json={"token_ids": list(range(40))}).json()["num_hit_tokens"] == 0
    )
    events = http.get("/v1/events").json()["events"]
    assert events[-1]["type"] == "all_cleared"


def test_kernel_tables_show_mamba_state_pages_whole(server_factory, tmp_path):
    """``?kernel_block_size=N`` splits the attention groups' pages; a Mamba group's state
    page stays whole, as workers get it (and GetBlockTable refuses to split it)."""
    config = tmp_path / "hybrid.toml"
    config.write_text(
        "[pool]\nnum_pages = 64\nmax_model_len = 1024\n"
        '[[pool.groups]]\nkind = "full"\npage_size = 64\n'
        '[[pool.groups]]\nkind = "mamba"\npage_size = 64\n'
    )
    server = server_factory("--config", str(config))
    sched = Scheduler(server)
    sched.admit("hy", list(range(100)))
    detail = server.http().get("/v1/requests/hy", params={"kernel_block_size": 16}).json()
    [full, mamba] = detail["page_ids"]
    assert len(full) == 2 and len(mamba) == 1
    assert detail["kernel_block_ids"][0] == [p * 4 + i for p in full for i in range(4)]
    assert detail["kernel_block_ids"][1] == mamba
    with pytest.raises(grpc.RpcError) as refused:
        sched.stub.GetBlockTable(
            pb.GetBlockTableRequest(request_id="hy", group_id=1, kernel_block_size=16),
            metadata=sched.md,
        )
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "never split" in refused.value.details()


def test_metrics(pagekeeper_server, running):
    http = pagekeeper_server.http()
    http.get("/v1/pool")
    text = http.get("/metrics").text
    assert 'pagekeeper_rpc_duration_seconds_bucket{code="OK",le="0.001",method="Step"}' in text
    assert (
        'pagekeeper_http_duration_seconds_count{method="GET",route="/v1/pool",status="200"}' in text
    )
    assert "pagekeeper_free_pages " in text and "pagekeeper_steps_total " in text
    assert "pagekeeper_step_apply_seconds_count" in text
    # Recent-value gauges are labelled "stat": "quantile" belongs to summaries.
    assert 'pagekeeper_durability_append_seconds{stat="p99"}' in text
    assert "quantile=" not in text
    gauges = {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("pagekeeper_event_buffer_")
    }
    assert set(gauges) == {
        "pagekeeper_event_buffer_events",
        "pagekeeper_event_buffer_bytes",
        "pagekeeper_event_buffer_first_seq",
    }
    # The shared server has produced events by now (the running requests' pages).
    assert gauges["pagekeeper_event_buffer_events"] >= 1
    assert gauges["pagekeeper_event_buffer_bytes"] > 0
    assert gauges["pagekeeper_event_buffer_first_seq"] >= 1


def test_pause_metrics(pagekeeper_server):
    """The server probes its event loop and times its collections from the start."""
    http = pagekeeper_server.http()
    deadline = time.monotonic() + 10
    while True:
        for _ in range(50):  # allocations enough for young collections
            http.get("/v1/pool")
        samples = {
            line.split()[0]: float(line.split()[1])
            for line in http.get("/metrics").text.splitlines()
            if line.startswith(("pagekeeper_event_loop_lag_seconds_", "pagekeeper_gc_pause_"))
        }
        lag = samples.get("pagekeeper_event_loop_lag_seconds_count", 0.0)
        young = samples.get('pagekeeper_gc_pause_seconds_count{generation="0"}', 0.0)
        if lag >= 2 and young >= 1:
            break
        assert time.monotonic() < deadline, samples
    assert 'pagekeeper_event_loop_lag_seconds_bucket{le="0.01"}' in samples


def test_openapi_documents_every_model(pagekeeper_server):
    document = pagekeeper_server.http().get("/openapi.json").json()
    for name, model in document["components"]["schemas"].items():
        if name in {"HTTPValidationError", "ValidationError"}:
            continue
        for field, spec in model.get("properties", {}).items():
            described = "description" in spec or "$ref" in spec or "allOf" in spec
            assert described, f"{name}.{field} is undocumented"


def test_api_docs_pages_load_nothing_from_elsewhere(pagekeeper_server):
    """/docs (Swagger UI) and /redoc name only the service's own scripts and styles (a
    host without internet access shows them), and the service serves each one."""
    http = pagekeeper_server.http()
    for page, kinds in (("/docs", ("js", "css")), ("/redoc", ("js",))):
        reply = http.get(page)
        assert reply.status_code == 200
        html = reply.text
        assert "http://" not in html and "https://" not in html, html
        assets = re.findall(r'(?:src|href)="(/docs/static/[^"]+)"', html)
        assert {a.rsplit(".", 1)[-1] for a in assets} >= set(kinds), assets
        for asset in assets:
            served = http.get(asset)
            assert served.status_code == 200, asset
            assert len(served.content) > 1000, asset
    assert "openapi" in http.get("/docs").text


def test_grpc_and_rest_agree(pagekeeper_server, running):
    sched, a, *_ = running
    table = sched.stub.GetBlockTable(pb.GetBlockTableRequest(request_id=a), metadata=sched.md)
    detail = pagekeeper_server.http().get(f"/v1/requests/{a}").json()
    assert from_i32(table.page_ids) == detail["page_ids"][0]
    assert i32(detail["page_ids"][0]) == table.page_ids


def test_client_learns_a_revocation_from_a_flush_and_stops_sending_for_it(server_factory):
    """A growth of a request queued before an admin freed it: the next allocate_slots of
    it flushes that growth first, and the answer's revocation makes it NO_CAPACITY (it was
    planned, and answered OK, anyway). Held decodes of a revoked request are not resent by
    every flush."""
    from pagekeeper_client import PagekeeperClient

    server = server_factory("--num-pages", "64", admin_token="adm")
    http = server.http()
    admin = {"Authorization": "Bearer adm"}
    with PagekeeperClient(server.grpc_address, local_socket=None) as client:
        client.register("scheduler", name="owner")
        client.admit("w", list(range(100, 140)))
        client.admit("o", list(range(200, 240)))
        client.step()
        assert client.allocate_slots("w", 10, new_token_ids=list(range(10))).status.name == (
            "PENDING"
        )
        assert http.delete("/v1/requests/w", headers=admin).status_code == 200
        got = client.allocate_slots("w", 1, new_token_ids=[7])
        assert got.status.name == "NO_CAPACITY" and client.is_revoked("w")
        client.free("w")
        # A decode held back before the mark arrived is not sent by every flush after it.
        client.admit("x", list(range(300, 340)))
        assert client.allocate_slots("x", 1, new_token_ids=[5]).is_local
        assert http.delete("/v1/requests/x", headers=admin).status_code == 200
        assert client.step(batch=["o"]).revoked_request_ids == ("x",)
        assert client.flush() is None
        client.free("x")
        assert client.step().revoked_request_ids == ()


def test_a_scheduler_taking_an_id_over_acknowledges_revocations_it_never_knew(server_factory):
    """A new process takes a scheduler's id over (its view is empty) while a revocation is
    outstanding: the answer's revoked id is none of its requests, so the client frees it
    with the next step, which ends the revocation (it could not be freed at all before)."""
    from pagekeeper_client import PagekeeperClient

    server = server_factory("--num-pages", "64", admin_token="adm")
    http = server.http()
    first = PagekeeperClient(server.grpc_address, local_socket=None)
    first.register("scheduler", name="old")
    first.admit("w", list(range(100, 140)))
    first.step()
    assert http.delete("/v1/requests/w", headers={"Authorization": "Bearer adm"}).is_success
    old_id = first.client_id
    first.close(unregister=False)
    with PagekeeperClient(server.grpc_address, local_socket=None) as second:
        second.register("scheduler", name="new", client_id=old_id)
        assert second.step().revoked_request_ids == ("w",)
        assert second.num_queued == 1  # the acknowledging free
        assert second.step().revoked_request_ids == ()
        mine = {c["client_id"]: c for c in http.get("/v1/clients").json()}[second.client_id]
        assert mine["revoked_request_ids"] == []
