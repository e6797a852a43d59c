"""Configuration: defaults < TOML < PAGEKEEPER_* env < flags; bad values name their field."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from pagekeeper.auth import load_server_tokens
from pagekeeper.core.config import GroupKind
from pagekeeper.core.errors import ConfigError
from pagekeeper.settings import OPTIONS, Settings, load_settings, read_toml, to_json, to_toml
from tests.helpers.server import clean_env

TOML = """
[server]
grpc_address = "127.0.0.1:6000"
http_address = "127.0.0.1:6001"
max_clients = 7
[pool]
num_pages = 1000
max_model_len = 2048
[[pool.groups]]
kind = "full"
page_size = 32
[[pool.groups]]
kind = "sliding_window"
page_size = 32
window = 128
[publish]
transport = "none"
"""


def test_defaults_need_no_file():
    settings = load_settings(environ={})
    assert settings.grpc_address == "127.0.0.1:50051"
    assert settings.http_address == "127.0.0.1:8000"
    assert settings.pool.num_pages == 4096 and settings.pool.groups[0].page_size == 16
    assert settings.pool.enable_prefix_caching and settings.pool.max_model_len == 8192
    assert settings.publish_transport == "shm" and settings.token is None


def test_precedence(tmp_path):
    path = tmp_path / "pk.toml"
    path.write_text(TOML)
    from_file = load_settings(config_path=str(path), environ={})
    assert from_file.grpc_address == "127.0.0.1:6000" and from_file.max_clients == 7
    assert [g.kind for g in from_file.pool.groups] == [GroupKind.FULL, GroupKind.SLIDING_WINDOW]
    env = {"PAGEKEEPER_GRPC_ADDRESS": "unix:/tmp/pk.sock", "PAGEKEEPER_MAX_CLIENTS": "9"}
    from_env = load_settings(config_path=str(path), environ=env)
    assert from_env.grpc_address == "unix:/tmp/pk.sock" and from_env.max_clients == 9
    assert from_env.http_address == "127.0.0.1:6001"  # the file still counts
    flags = {"server.max_clients": "11", "pool.num_pages": "77"}
    final = load_settings(config_path=str(path), environ=env, flags=flags)
    assert final.max_clients == 11 and final.pool.num_pages == 77
    assert final.grpc_address == "unix:/tmp/pk.sock"
    # $PAGEKEEPER_CONFIG names the file when --config does not.
    assert load_settings(environ={"PAGEKEEPER_CONFIG": str(path)}).max_clients == 7


def test_printed_config_reads_back(tmp_path):
    path = tmp_path / "pk.toml"
    path.write_text(TOML)
    settings = load_settings(config_path=str(path), environ={"PAGEKEEPER_TOKEN": "s3cret"})
    printed = to_toml(settings)
    assert "s3cret" not in printed and "s3cret" not in to_json(settings)
    again = tmp_path / "again.toml"
    again.write_text(printed.replace('"<redacted>"', '"s3cret"'))
    assert load_settings(config_path=str(again), environ={}) == settings
    assert read_toml(str(again))["pool"]["groups"][1]["window"] == 128
    # Read back as printed, the placeholder is refused (it was served as the token: the
    # real clients locked out, anyone who knows the word let in).
    as_printed = tmp_path / "as-printed.toml"
    as_printed.write_text(printed)
    with pytest.raises(ConfigError, match=r"server\.token.*in place of a secret"):
        load_settings(config_path=str(as_printed), environ={})
    with pytest.raises(ConfigError, match=r"server\.admin_token"):
        load_settings(environ={"PAGEKEEPER_ADMIN_TOKEN": "<redacted>"})


@pytest.mark.parametrize(
    ("source", "field"),
    [
        ({"env": {"PAGEKEEPER_NUM_PAGES": "1"}}, "pool.num_pages"),
        ({"env": {"PAGEKEEPER_NUM_PAGES": "many"}}, "pool.num_pages"),
        ({"env": {"PAGEKEEPER_PAGE_SIZE": "0"}}, "pool.groups[0].page_size"),
        ({"env": {"PAGEKEEPER_GRPC_ADDRESS": "nowhere"}}, "server.grpc_address"),
        ({"env": {"PAGEKEEPER_HTTP_ADDRESS": "127.0.0.1:99999"}}, "server.http_address"),
        ({"env": {"PAGEKEEPER_DEBUG_INVARIANTS": "maybe"}}, "server.debug_invariants"),
        ({"flags": {"publish.transport": "pigeon"}}, "publish.transport"),
        ({"flags": {"server.lease_ttl_s": "-1"}}, "server.lease_ttl_s"),
        ({"flags": {"server.max_message_bytes": "3000000000"}}, "server.max_message_bytes"),
        ({"flags": {"server.log_level": "loud"}}, "server.log_level"),
        ({"env": {"PAGEKEEPER_EVENT_BUFFER_BYTES": "100"}}, "server.event_buffer_bytes"),
        ({"toml": "[server]\nbogus = 1\n"}, "server.bogus"),
        ({"toml": "[pool]\nnum_pages = 'x'\n"}, "pool.num_pages"),
        ({"toml": "[pool]\n[[pool.groups]]\nkind = 'sliding_window'\n"}, "pool.groups[0].window"),
        ({"toml": "[pool]\n[[pool.groups]]\nkind = 'quantum'\n"}, "pool.groups[0].kind"),
        ({"toml": "[elsewhere]\n"}, "elsewhere"),
        # A TOML string is truthy: "false" must not switch a feature on.
        ({"toml": "[server]\ntoken = 't'\nhttp_read_auth = 'false'\n"}, "server.http_read_auth"),
        ({"toml": "[server]\ndebug_invariants = 'off'\n"}, "server.debug_invariants"),
        ({"toml": "[pool]\nenable_prefix_caching = 'false'\n"}, "pool.enable_prefix_caching"),
        ({"toml": "[pool]\nmax_model_len = true\n"}, "pool.max_model_len"),
        ({"toml": "[pool]\n[[pool.groups]]\npage_size = true\n"}, "pool.groups[0].page_size"),
        (
            {"toml": "[pool]\n[[pool.groups]]\nkind = 'mamba'\nenable_state_caching = 1\n"},
            "pool.groups[0].enable_state_caching",
        ),
        ({"toml": "[pool]\n[[pool.groups]]\nname = 3\n"}, "pool.groups[0].name"),
        ({"toml": "[publish]\ndevice = 3\n"}, "publish.device"),
        ({"toml": "this is = = not toml"}, "config"),
    ],
)
def test_bad_values_name_the_field(tmp_path, source, field):
    path = None
    if "toml" in source:
        path = tmp_path / "bad.toml"
        path.write_text(source["toml"])
    with pytest.raises(ConfigError) as exc:
        load_settings(
            config_path=str(path) if path else None,
            environ=source.get("env", {}),
            flags=source.get("flags"),
        )
    assert exc.value.field == field


def test_every_option_has_env_and_flag():
    envs = {o.env for o in OPTIONS}
    flags = {o.flag for o in OPTIONS}
    assert len(envs) == len(flags) == len(OPTIONS)
    for required in (
        "PAGEKEEPER_GRPC_ADDRESS",
        "PAGEKEEPER_HTTP_ADDRESS",
        "PAGEKEEPER_TOKEN",
        "PAGEKEEPER_NUM_PAGES",
    ):
        assert required in envs
    assert "--grpc-address" in flags and "--debug-invariants" in flags


def test_settings_validate_on_construction():
    with pytest.raises(ConfigError) as exc:
        Settings(ring_depth=0)
    assert exc.value.field == "publish.ring_depth"
    # The admin endpoints take the service's token unless they have their own.
    calls_only = load_server_tokens(Settings(token="t"))
    assert calls_only.admin is calls_only.calls
    own = load_server_tokens(Settings(token="t", admin_token="a"))
    assert own.admin is not None and own.admin.accepts(b"a") and not own.admin.accepts(b"t")
    # The same-node socket's hello ends the token at a NUL (what follows is a client's ticket).
    for field in ("token", "admin_token"):
        with pytest.raises(ConfigError, match="NUL") as exc:
            Settings(**{field: "a\0b"})
        assert exc.value.field == f"server.{field}"


def test_a_misspelled_variable_is_named(tmp_path):
    """A typo in a PAGEKEEPER_* variable is ignored like any variable the service does not
    read, but named (clients, workers and tools read variables of their own: no warning)."""
    from pagekeeper.settings import OTHER_ENV, misspelled_env

    env = {
        "PAGEKEEPER_DURABLITY": "none",
        "PAGEKEEPER_NUM_PAGE": "8",
        "PAGEKEEPER_WORKER_DEVICE": "cpu",
        "PAGEKEEPER_TLS_CA_FILE": "/x",
        "PAGEKEEPER_DURABILITY": "process",
        "PAGEKEEPER_CONFIG": "/y",
    }
    assert misspelled_env(env) == [
        ("PAGEKEEPER_DURABLITY", "PAGEKEEPER_DURABILITY"),
        ("PAGEKEEPER_NUM_PAGE", "PAGEKEEPER_NUM_PAGES"),
    ]
    # Every variable the project's other readers use is known as theirs.
    root = Path(__file__).resolve().parents[2]
    sources = [*root.glob("client/**/*.py"), *root.glob("scripts/*"), root / "docker-compose.yml"]
    used = set()
    for path in sources:
        used |= set(re.findall(r"PAGEKEEPER_[A-Z0-9_]*[A-Z0-9]", path.read_text(errors="replace")))
    assert misspelled_env(dict.fromkeys(used, "")) == []
    assert used <= OTHER_ENV | {o.env for o in OPTIONS}, used - OTHER_ENV
    done = subprocess.run(
        [sys.executable, "-m", "pagekeeper", "config"],
        env=clean_env({"PAGEKEEPER_DURABLITY": "none"}),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0
    assert "PAGEKEEPER_DURABLITY is not a setting (PAGEKEEPER_DURABILITY?)" in done.stderr
