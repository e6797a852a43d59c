"""Bearer tokens from files: parsing, reloads, settings, the client's default, and a token
rotated on a running service (gRPC, the same-node socket, HTTP admin, metrics)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from pagekeeper.auth import BearerTokens, first_token, load_server_tokens, read_token_file
from pagekeeper.core.errors import ConfigError
from pagekeeper.settings import OPTIONS_BY_PATH, Settings, load_settings
from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2 as pb
from pagekeeper_client.client import default_token
from pagekeeper_client.errors import UnauthenticatedError
from tests.helpers.frames import FrameConnection
from tests.helpers.server import RunningServer, clean_env, server_command

FIELD = "server.token_file"


def write(path: Path, text: str) -> None:
    """Replace ``path`` whole (a new inode, as an editor or a secret mount does)."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(text)
    tmp.chmod(0o600)
    os.replace(tmp, path)


# -- the file format --------------------------------------------------------------------------


def test_token_file_lines_comments_and_duplicates(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text("# rotated 2026-12\n\n  old-token  \nnew-token\r\nold-token\n")
    assert read_token_file(str(path), FIELD) == ("old-token", "new-token")


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ("", "lists no token"),
        ("# only a comment\n\n", "lists no token"),
        ("good\nwith space\n", "line 2: a token must be printable ASCII"),
        ("tab\there\n", "line 1"),
        ("caf\u00e9\n", "line 1"),
        ("nul\0byte\n", "line 1"),
    ],
)
def test_bad_token_files_name_the_field_and_line(tmp_path: Path, content: str, reason: str) -> None:
    path = tmp_path / "tokens"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ConfigError, match=reason) as exc:
        read_token_file(str(path), FIELD)
    assert exc.value.field == FIELD


def test_missing_and_oversized_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read") as exc:
        read_token_file(str(tmp_path / "absent"), FIELD)
    assert exc.value.field == FIELD
    big = tmp_path / "big"
    big.write_bytes(b"x" * (1024 * 1024 + 1))
    with pytest.raises(ConfigError, match="over 1 MiB"):
        read_token_file(str(big), FIELD)


def test_accepts_each_listed_token_and_nothing_else() -> None:
    tokens = BearerTokens(("alpha", "beta"))
    assert tokens.accepts(b"alpha") and tokens.accepts(b"beta")
    for wrong in (b"", b"alph", b"alphaa", b"gamma", b"alpha\0"):
        assert not tokens.accepts(wrong)
    assert tokens.accepts_header(b"Bearer beta")
    assert not tokens.accepts_header(b"beta") and not tokens.accepts_header(b"Bearer  beta")
    assert tokens.first == "alpha" and tokens.count == 2
    assert not tokens.reload_if_changed()  # inline tokens never change
    with pytest.raises(ValueError):
        BearerTokens(())


# -- reloads ----------------------------------------------------------------------------------


def test_reload_follows_the_file_and_keeps_the_tokens_when_it_breaks(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    write(path, "one\n")
    tokens = BearerTokens.from_file(str(path), FIELD)
    assert (tokens.generation, tokens.num_reloads) == (0, 0)
    assert not tokens.reload_if_changed()  # unchanged

    write(path, "one\ntwo\n")
    assert tokens.reload_if_changed()
    assert tokens.accepts(b"one") and tokens.accepts(b"two")
    assert (tokens.generation, tokens.num_reloads) == (1, 1)

    write(path, "# same tokens, new file\none\ntwo\n")
    assert not tokens.reload_if_changed()  # re-read, nothing accepted changed
    assert tokens.generation == 1

    write(path, "\n")  # broken: reported once, then quiet until it changes again
    with pytest.raises(ConfigError, match="lists no token"):
        tokens.reload_if_changed()
    assert not tokens.reload_if_changed()
    assert tokens.accepts(b"one") and tokens.accepts(b"two") and tokens.generation == 1

    path.unlink()  # gone: reported once as well
    with pytest.raises(ConfigError, match="cannot read"):
        tokens.reload_if_changed()
    assert not tokens.reload_if_changed()
    assert tokens.accepts(b"two")

    write(path, "two\n")  # back, with the old token removed
    assert tokens.reload_if_changed()
    assert not tokens.accepts(b"one") and tokens.accepts(b"two")
    assert (tokens.generation, tokens.num_reloads) == (2, 2)


def test_sighup_reads_even_a_file_that_seems_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    write(path, "aaaa\n")
    tokens = BearerTokens.from_file(str(path), FIELD)
    before = os.stat(path)
    with open(path, "w") as f:  # same size, same mtime: only the ctime moves
        f.write("bbbb\n")
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert tokens.reload_if_changed()  # the ctime is part of the stamp
    assert tokens.accepts(b"bbbb") and not tokens.accepts(b"aaaa")
    # A change no stamp shows (a filesystem with coarse times): a forced read finds it.
    tokens._stamp = _stamp_of(path)
    with open(path, "w") as f:
        f.write("cccc\n")
    tokens._stamp = _stamp_of(path)  # as if the stamp had not moved
    assert not tokens.reload_if_changed()
    assert tokens.reload_if_changed(force=True)
    assert tokens.accepts(b"cccc")


def _stamp_of(path: Path) -> object:
    from pagekeeper.files import file_stamp

    return file_stamp(str(path))


def test_a_readable_token_file_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "tokens"
    path.write_text("t\n")
    path.chmod(0o644)
    with caplog.at_level("WARNING", logger="pagekeeper"):
        BearerTokens.from_file(str(path), FIELD)
    assert "readable by its group or others (mode 644)" in caplog.text
    caplog.clear()
    path.chmod(0o600)
    with caplog.at_level("WARNING", logger="pagekeeper"):
        BearerTokens.from_file(str(path), FIELD)
    assert caplog.text == ""


# -- settings ---------------------------------------------------------------------------------


def test_settings_token_files(tmp_path: Path) -> None:
    calls, admin = tmp_path / "calls", tmp_path / "admin"
    write(calls, "c1\nc2\n")
    write(admin, "a1\n")
    for name in ("token", "admin_token"):
        with pytest.raises(ConfigError, match=f"set {name} or {name}_file, not both") as exc:
            Settings(**{name: "x", f"{name}_file": str(calls)})
        assert exc.value.field == f"server.{name}_file"
    with pytest.raises(ConfigError) as exc:
        Settings(token_file=" ")
    assert exc.value.field == "server.token_file"
    assert OPTIONS_BY_PATH["server.token_file"].env == "PAGEKEEPER_TOKEN_FILE"
    assert OPTIONS_BY_PATH["server.admin_token_file"].flag == "--admin-token-file"
    settings = load_settings(environ={"PAGEKEEPER_TOKEN_FILE": str(calls)})
    assert settings.token_file == str(calls)
    assert settings.to_dict()["server"]["token_file"] == str(calls)  # a path, not a secret

    tokens = load_server_tokens(settings)
    assert tokens.admin is tokens.calls  # one holder: one reload covers both
    assert tokens.holders() == (tokens.calls,)
    assert first_token(settings) == "c1"
    both = load_server_tokens(Settings(token_file=str(calls), admin_token_file=str(admin)))
    assert both.admin is not None and both.admin.accepts(b"a1")
    assert both.calls is not None and not both.calls.accepts(b"a1")
    assert len(both.holders()) == 2
    same = load_server_tokens(Settings(token_file=str(calls), admin_token_file=str(calls)))
    assert same.admin is same.calls and len(same.holders()) == 1  # one reload, one log
    inline = load_server_tokens(Settings(token="t"))
    assert inline.calls is not None and inline.holders() == ()
    assert load_server_tokens(Settings()).calls is None
    with pytest.raises(ConfigError) as exc:
        load_server_tokens(Settings(admin_token_file=str(tmp_path / "absent")))
    assert exc.value.field == "server.admin_token_file"


def test_client_default_token(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    write(path, "# comment\r\n\n  first  \r\nsecond\n")
    assert default_token({}) is None
    assert default_token({"PAGEKEEPER_TOKEN_FILE": str(path)}) == "first"
    assert read_token_file(str(path), FIELD)[0] == "first"  # the service reads it alike
    assert default_token({"PAGEKEEPER_TOKEN": "inline"}) == "inline"
    env = {"PAGEKEEPER_TOKEN": "inline", "PAGEKEEPER_TOKEN_FILE": str(path)}
    with pytest.raises(ValueError, match="not both"):
        default_token(env)
    write(path, "bad token\n")
    with pytest.raises(ValueError, match="line 1: a token must be printable ASCII"):
        default_token({"PAGEKEEPER_TOKEN_FILE": str(path)})
    with pytest.raises(ValueError, match="cannot read"):
        default_token({"PAGEKEEPER_TOKEN_FILE": str(tmp_path / "absent")})
    write(path, "# nothing\n")
    with pytest.raises(ValueError, match="lists no token"):
        default_token({"PAGEKEEPER_TOKEN_FILE": str(path)})


# -- the running service ------------------------------------------------------------------------


@pytest.fixture
def sockdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="pk-auth-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _pool_info(server: RunningServer, token: str) -> grpc.StatusCode:
    try:
        server.stub().GetPoolInfo(
            pb.GetPoolInfoRequest(), metadata=(("authorization", f"Bearer {token}"),), timeout=10
        )
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def _reload(server: RunningServer, path: Path, text: str, num_reloads: int) -> None:
    write(path, text)
    server.process.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while server.http().get("/v1/pool").json()["auth"]["calls"]["num_reloads"] < num_reloads:
        assert time.monotonic() < deadline, server.logs()
        time.sleep(0.02)


def _metric(server: RunningServer, line_start: str) -> float:
    for line in server.http().get("/metrics").text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no metric {line_start}")


def test_a_token_rotated_on_a_running_service(
    server_factory: Callable[..., RunningServer], tmp_path: Path, sockdir: Path
) -> None:
    path = tmp_path / "tokens"
    write(path, "old-token\n")
    server = server_factory(
        "--token-file", str(path), "--local-socket", str(sockdir / "pk.sock"),
        "--durability", "none",
    )  # fmt: skip
    auth = server.http().get("/v1/pool").json()["auth"]
    assert auth["calls"] == {
        "source": "file", "file": str(path), "num_tokens": 1, "num_reloads": 0,
    }  # fmt: skip
    assert auth["admin"] == auth["calls"]
    assert _pool_info(server, "old-token") is grpc.StatusCode.OK
    assert _pool_info(server, "new-token") is grpc.StatusCode.UNAUTHENTICATED
    socket_path = server.info["local_socket"]
    held = FrameConnection(socket_path)  # a same-node connection opened with the old token
    held.hello("old-token")
    assert held.call("GetPoolInfo", pb.GetPoolInfoRequest())[0] == 0

    # Overlap: both accepted while clients move over.
    _reload(server, path, "old-token\nnew-token\n", 1)
    assert _pool_info(server, "old-token") is grpc.StatusCode.OK
    assert _pool_info(server, "new-token") is grpc.StatusCode.OK
    assert held.call("GetPoolInfo", pb.GetPoolInfoRequest())[0] == 0

    # The old token removed: refused on gRPC, on the socket connection that presented it,
    # and on the admin endpoints (the admin token defaults to the service's tokens).
    _reload(server, path, "new-token\n", 2)
    assert _pool_info(server, "old-token") is grpc.StatusCode.UNAUTHENTICATED
    assert _pool_info(server, "new-token") is grpc.StatusCode.OK
    status, body = held.call("GetPoolInfo", pb.GetPoolInfoRequest())
    assert status == grpc.StatusCode.UNAUTHENTICATED.value[0] and b"revoked" in body
    assert held.is_closed()
    fresh = FrameConnection(socket_path)
    fresh.hello("new-token")
    assert fresh.call("GetPoolInfo", pb.GetPoolInfoRequest())[0] == 0
    http = server.http()
    url = "/v1/admin/reset-prefix-cache"
    assert http.post(url, headers={"Authorization": "Bearer old-token"}).status_code == 401
    assert http.post(url, headers={"Authorization": "Bearer new-token"}).status_code == 200
    assert _metric(server, 'pagekeeper_token_reloads_total{result="loaded"}') == 2

    # A broken file changes nothing and is counted once.
    write(path, "# emptied by mistake\n")
    server.process.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while _metric(server, 'pagekeeper_token_reloads_total{result="failed"}') < 1:
        assert time.monotonic() < deadline, server.logs()
        time.sleep(0.02)
    assert _pool_info(server, "new-token") is grpc.StatusCode.OK
    assert server.is_running()
    fresh.sock.close()
    held.sock.close()
    assert "token file changed but does not load" in server.logs()
    assert "new-token" not in server.logs()  # tokens are never logged


def test_a_separate_admin_token_file(
    server_factory: Callable[..., RunningServer], tmp_path: Path
) -> None:
    calls, admin = tmp_path / "calls", tmp_path / "admin"
    write(calls, "call-token\n")
    write(admin, "admin-token\n")
    server = server_factory(
        "--token-file", str(calls), "--admin-token-file", str(admin), "--durability", "none"
    )
    url = "/v1/admin/reset-prefix-cache"
    http = server.http()
    assert http.post(url, headers={"Authorization": "Bearer call-token"}).status_code == 401
    assert http.post(url, headers={"Authorization": "Bearer admin-token"}).status_code == 200
    assert _pool_info(server, "admin-token") is grpc.StatusCode.UNAUTHENTICATED
    auth = http.get("/v1/pool").json()["auth"]
    assert auth["admin"]["file"] == str(admin) and auth["calls"]["file"] == str(calls)


def test_a_bad_token_file_stops_start_up_with_one_line(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    write(empty, "\n")
    for args, reason in (
        (["--token-file", str(tmp_path / "absent")], "server.token_file: cannot read"),
        (["--token-file", str(empty)], "server.token_file: " + str(empty) + " lists no token"),
        (["--token-file", str(empty), "--token", "t"], "set token or token_file, not both"),
    ):
        result = subprocess.run(
            server_command(tmp_path / "ready.json", [*args, "--durability", "none"]),
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and reason in lines[0], result.stderr
        assert lines[0].startswith("pagekeeper: bad configuration: ")


def test_the_probe_and_the_client_read_the_token_file(
    server_factory: Callable[..., RunningServer],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pagekeeper_client import PagekeeperClient

    path = tmp_path / "tokens"
    write(path, "file-token\n")
    server = server_factory("--token-file", str(path), "--durability", "none")
    env = {
        "PAGEKEEPER_GRPC_ADDRESS": server.grpc_address,
        "PAGEKEEPER_HTTP_ADDRESS": server.http_address,
        "PAGEKEEPER_TOKEN_FILE": str(path),
    }
    result = subprocess.run(
        [sys.executable, "-m", "pagekeeper.probe", "--no-local"],
        env=clean_env(env),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    monkeypatch.delenv("PAGEKEEPER_TOKEN", raising=False)
    monkeypatch.setenv("PAGEKEEPER_TOKEN_FILE", str(path))
    client = PagekeeperClient(server.grpc_address, local_socket=None)
    try:
        assert client.pool_info().config.num_pages > 0
    finally:
        client.close()


def test_clients_follow_their_token_file_through_a_rotation(
    server_factory: Callable[..., RunningServer],
    tmp_path: Path,
    sockdir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Steps over the same-node socket, lookups and heartbeats over gRPC, sync and asyncio:
    the service drops the old token after the clients' file has the new one, and the
    clients go on without an error (each refused call is retried once with the new token;
    a refused step is resent with the same id, so nothing is applied twice)."""
    import asyncio

    from pagekeeper_client import AsyncPagekeeperClient, PagekeeperClient

    service_file, client_file = tmp_path / "service-tokens", tmp_path / "client-token"
    write(service_file, "old-token\n")
    write(client_file, "old-token\n")
    server = server_factory(
        "--token-file", str(service_file), "--local-socket", str(sockdir / "pk.sock"),
        "--num-pages", "256", "--max-model-len", "2048", "--durability", "none",
    )  # fmt: skip
    monkeypatch.delenv("PAGEKEEPER_TOKEN", raising=False)
    monkeypatch.setenv("PAGEKEEPER_TOKEN_FILE", str(client_file))
    client = PagekeeperClient(server.grpc_address)
    loop = asyncio.new_event_loop()

    async def make_async() -> AsyncPagekeeperClient:
        return AsyncPagekeeperClient(server.grpc_address)  # made on the loop it runs on

    aclient = loop.run_until_complete(make_async())
    try:
        client.register("scheduler", name="sync")
        loop.run_until_complete(aclient.register("scheduler", name="async"))
        client.admit("s-1", list(range(40)))
        loop.run_until_complete(aclient.admit("a-1", list(range(40))))
        assert client.transport == "local" and aclient.transport == "local"

        _reload(server, service_file, "old-token\nnew-token\n", 1)
        write(client_file, "new-token\n")  # the clients have not looked yet
        _reload(server, service_file, "new-token\n", 2)
        assert _pool_info(server, "old-token") is grpc.StatusCode.UNAUTHENTICATED

        socket_before = client._local
        client.admit("s-2", list(range(100, 140)))  # over the socket: revoked, then resent
        assert client.has_request("s-2")
        assert client.transport == "local" and client._local is not socket_before
        assert client.lookup(list(range(40))).num_hit_tokens == 32
        client.heartbeat()
        loop.run_until_complete(aclient.admit("a-2", list(range(100, 140))))
        assert loop.run_until_complete(aclient.lookup(list(range(40)))).num_hit_tokens == 32
        assert client._token == "new-token" and aclient._token == "new-token"
        held = server.http().get("/v1/requests").json()
        ids = [r["request_id"] for r in held["items"]]
        assert sorted(ids) == ["a-1", "a-2", "s-1", "s-2"]  # each admitted once, none lost

        # A token the service does not know and the file does not fix: the error surfaces.
        _reload(server, service_file, "newer-token\n", 3)
        with pytest.raises(UnauthenticatedError):
            client.lookup(list(range(40)))
        # The file catches up: whatever call goes out next (a heartbeat here) takes it.
        write(client_file, "newer-token\n")
        client.heartbeat()
        assert client._token == "newer-token"

        # Calls refused at once in several threads and tasks all go on: the first re-read
        # serves the others (each sees the token is no longer the one it sent).
        write(client_file, "newest-token\n")
        _reload(server, service_file, "newest-token\n", 4)
        with ThreadPoolExecutor(4) as pool:
            hits = list(pool.map(lambda _: client.lookup(list(range(40))).num_hit_tokens, range(8)))
        assert hits == [32] * 8

        async def together() -> list[int]:
            found = await asyncio.gather(*(aclient.lookup(list(range(40))) for _ in range(6)))
            return [f.num_hit_tokens for f in found]

        assert loop.run_until_complete(together()) == [32] * 6
    finally:
        client.close()
        loop.run_until_complete(aclient.close())
        loop.close()


def test_a_stream_ends_when_its_token_is_revoked(
    server_factory: Callable[..., RunningServer], tmp_path: Path
) -> None:
    """A stream passed the call-time check when it opened: a reload that removes its token
    ends it with UNAUTHENTICATED at once, events pending or not; one whose token stays
    listed goes on."""
    path = tmp_path / "tokens"
    write(path, "old-token\nkept-token\n")
    server = server_factory("--token-file", str(path), "--durability", "none")
    stub = server.stub()
    revoked = stub.WatchEvents(
        pb.WatchEventsRequest(), metadata=(("authorization", "Bearer old-token"),)
    )
    kept = stub.WatchEvents(
        pb.WatchEventsRequest(), metadata=(("authorization", "Bearer kept-token"),)
    )
    next(revoked)  # the first message: the stream is open
    next(kept)
    _reload(server, path, "kept-token\n", 1)
    with pytest.raises(grpc.RpcError) as exc:
        next(revoked)
    assert exc.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert "revoked" in (exc.value.details() or "")
    # The kept stream still delivers: an event after the reload reaches it.
    assert (
        server.http()
        .post("/v1/admin/reset-prefix-cache", headers={"Authorization": "Bearer kept-token"})
        .status_code
        == 200
    )
    message = next(kept)
    assert [e.WhichOneof("event") for e in message.events] == ["all_cleared"]
    kept.cancel()


# -- HTTP reads ---------------------------------------------------------------------------------


def test_http_read_auth_needs_a_token_to_be_set() -> None:
    with pytest.raises(ConfigError) as exc:
        load_settings(environ={"PAGEKEEPER_HTTP_READ_AUTH": "1"})
    assert exc.value.field == "server.http_read_auth"
    assert load_settings(environ={"PAGEKEEPER_HTTP_READ_AUTH": "1", "PAGEKEEPER_TOKEN": "t"})


def test_http_reads_need_a_token_when_asked(server_factory) -> None:
    """With http_read_auth the data routes answer 401 (with the scheme) without the service
    or admin token; health, readiness, metrics, the dashboard page and its aggregate time
    series stay open. Without it (every other test's server) reads are open."""
    server = server_factory("--http-read-auth", token="calls", admin_token="adm")
    http = server.http()
    guarded = [
        ("GET", "/v1/pool"),
        ("GET", "/v1/pages?limit=2"),
        ("GET", "/v1/pages/1"),
        ("GET", "/v1/requests"),
        ("GET", "/v1/requests/nope"),
        ("GET", "/v1/clients"),
        ("GET", "/v1/events?since=0"),
        ("POST", "/v1/lookup"),
        ("GET", "/v1/dashboard/page-map?bins=8"),
        ("GET", "/v1/dashboard/requests"),
    ]
    for method, path in guarded:
        body = {"token_ids": [1, 2, 3]} if method == "POST" else None
        refused = http.request(method, path, json=body)
        assert refused.status_code == 401, path
        assert refused.headers["www-authenticate"].startswith("Bearer"), path
        assert (
            http.request(
                method, path, json=body, headers={"Authorization": "Bearer wrong"}
            ).status_code
            == 401
        ), path
        for token in ("calls", "adm"):
            answer = http.request(
                method, path, json=body, headers={"Authorization": f"Bearer {token}"}
            )
            assert answer.status_code in (200, 404), (path, answer.text)
    for path in ("/healthz", "/readyz", "/metrics", "/", "/v1/dashboard/samples"):
        assert http.get(path).status_code == 200, path
    # The admin endpoints keep their own token.
    reset = http.post("/v1/admin/reset-prefix-cache", headers={"Authorization": "Bearer calls"})
    assert reset.status_code == 401
