"""The service's configuration: embedded defaults < TOML file < ``PAGEKEEPER_*`` env < flags.

Every knob has one entry in :data:`OPTIONS` (its dotted name in the TOML file, its
environment variable, its command-line flag and its parser), so the four sources cannot
drift apart. A bad value raises :class:`pagekeeper.core.errors.ConfigError` naming the field;
``pagekeeper serve`` turns that into one line on stderr and a non-zero exit.

The TOML file mirrors :meth:`Settings.to_dict`::

    [server]
    grpc_address = "127.0.0.1:50051"   # or "unix:/run/pagekeeper.sock"
    http_address = "127.0.0.1:8000"
    [pool]
    num_pages = 4096
    max_model_len = 8192
    [[pool.groups]]
    kind = "full"
    page_size = 16
    [publish]
    transport = "shm"
"""

from __future__ import annotations

import difflib
import json
import math
import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from pagekeeper.core.config import PoolConfig, check_switch
from pagekeeper.core.errors import ConfigError

ENV_PREFIX = "PAGEKEEPER_"
PUBLISH_TRANSPORTS = ("shm", "cpu_ipc", "cuda_ipc", "none")
DURABILITY_LEVELS = ("none", "process", "fsync")
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")
KV_EVENT_HASH_FORMATS = ("int", "bytes")
_REDACTED = "<redacted>"
_MAX_UNIX_PATH = 107  # sun_path holds 108 bytes, the terminating NUL included


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything the service process needs; immutable once loaded."""

    # -- server ------------------------------------------------------------------------
    grpc_address: str = "127.0.0.1:50051"
    """``HOST:PORT`` (port 0 picks a free one) or ``unix:PATH``."""
    http_address: str = "127.0.0.1:8000"
    """``HOST:PORT`` (port 0 picks a free one) or ``unix:PATH``."""
    local_socket: str | None = None
    """A unix socket path for same-host clients (None: off). It carries the unary calls
    (Step, Lookup, ...) in plain frames instead of gRPC: the same answers for a fraction of
    the per-call cost (``pagekeeper_client.local``). Created owner-only; advertised to
    clients at registration."""
    token: str | None = None
    """Bearer token required on every gRPC call and every HTTP mutation (None: none)."""
    admin_token: str | None = None
    """Bearer token of the HTTP admin endpoints; defaults to ``token``. With neither set the
    admin endpoints are refused (403): force-freeing pages needs a deliberate credential."""
    token_file: str | None = None
    """A file listing the accepted bearer tokens instead of ``token``: one a line, each
    accepted, re-read when it changes (rotation without a restart; ``pagekeeper.auth``)."""
    admin_token_file: str | None = None
    """The same for ``admin_token``."""
    http_read_auth: bool = False
    """Require a bearer token (the service's or the admin's) on the HTTP reads too: every
    ``/v1/...`` route (pool, pages, requests, clients, events with their prompt token ids,
    lookup, the dashboard's data). ``/healthz``, ``/readyz``, ``/metrics`` and the dashboard
    page itself stay open. Off (the default): reads are open to whoever reaches the HTTP
    address, which is loopback unless configured otherwise."""
    tls_cert_file: str | None = None
    """PEM certificate chain: gRPC and HTTP are served over TLS with it (None: plaintext,
    for loopback and trusted networks). Needs ``tls_key_file``."""
    tls_key_file: str | None = None
    """PEM private key of ``tls_cert_file``."""
    tls_client_ca_file: str | None = None
    """PEM CA certificates: gRPC clients must present a certificate signed by one (mutual
    TLS). HTTP asks for none (probes, Prometheus); its mutations keep their tokens."""
    max_message_bytes: int = 64 * 1024 * 1024
    max_clients: int = 64
    max_requests_per_step: int = 1024
    """Most frees + growths + admissions in one Step, and most requests in one batch."""
    max_tokens_per_step: int = 16384
    """Most scheduled tokens in one published batch (the ring's slot-mapping capacity)."""
    lease_ttl_s: float = 10.0
    max_lease_ttl_s: float = 300.0
    lease_grace_s: float = 0.0
    """How long after a scheduler's lease expires its requests are freed."""
    event_buffer_size: int = 65536
    """KV events kept for WatchEvents / GET /v1/events resumption."""
    event_buffer_bytes: int = 64 * 1024 * 1024
    """...and at most about this many bytes of them (a stored event holds its tokens: 65,536
    admissions of 2,000 tokens would be ~2 GB, and every snapshot would copy them)."""
    kv_events_endpoint: str | None = None
    """A ZeroMQ endpoint (``tcp://HOST:PORT``, port 0 picks one; ``ipc://PATH``) the
    service binds a PUB socket on and publishes its KV events to, in vLLM's wire format
    (``pagekeeper.kvevents``): routers built for vLLM engines subscribe unchanged. None:
    off (WatchEvents and ``GET /v1/events`` serve them either way)."""
    kv_events_replay_endpoint: str | None = None
    """A ZeroMQ ROUTER endpoint answering replay requests (the batches since a sequence
    number, from the last ``kv_events_buffer_steps``), as vLLM's publisher does."""
    kv_events_topic: str = ""
    """The topic frame of every published batch (vLLM's default: empty)."""
    kv_events_hash_format: str = "int"
    """``int`` (the low 64 bits of each page hash, big-endian: vLLM's default) or
    ``bytes`` (the whole digest, as vLLM with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``)."""
    kv_events_buffer_steps: int = 10_000
    """Published batches kept for replay."""
    kv_events_data_parallel_rank: int = 0
    """The ``data_parallel_rank`` each batch carries (routers tell engines apart by it)."""
    debug_invariants: bool = False
    """Run the core's ``check_invariants()`` after every mutation (slow; for debugging)."""
    defer_caching: bool = True
    """Enter a step's admitted pages into the prefix cache (hashing past the lookup's first
    miss, indexing, their ``stored`` events), and drop the cached pages their allocations
    took from it (their ``removed`` events), once its answer is on its way, not before:
    every other call settles that work first, so answers, events and state are those of
    doing it at once. ``false``: do it before answering."""
    data_dir: str = "data"
    """Where the durable state lives (the command log's segments in ``journal/``, the
    latest snapshot in ``snapshots/``, registered in one SQLite file; see
    docs/reliability.md). Relative paths are relative to
    the working directory: ``make serve`` keeps it in the repository's git-ignored
    ``data/``."""
    durability: str = "process"
    """``none`` (nothing written; a restart starts empty), ``process`` (every acknowledged
    change survives the process being killed, ``kill -9`` included) or ``fsync`` (it also
    survives power loss: one fsync per change)."""
    snapshot_every: int = 10_000
    """Log records between two snapshots (bounds the replay at start-up)."""
    log_level: str = "info"
    log_format: str = "text"
    """``text`` (one readable line per record) or ``json`` (one JSON object per line: ``ts``,
    ``level``, ``logger``, ``message``, ``exc`` with a traceback), both on stderr."""
    shutdown_grace_s: float = 5.0
    """How long SIGTERM waits for in-flight calls before cancelling them."""
    # -- pool --------------------------------------------------------------------------
    pool: PoolConfig = field(default_factory=PoolConfig)
    # -- publish -----------------------------------------------------------------------
    publish_transport: str = "shm"
    """Where step tables are published for workers: a shared-memory ring ("shm"), CUDA IPC
    ("cuda_ipc"), its CPU stand-in ("cpu_ipc"), or "none" (only the WatchTables stream)."""
    ring_depth: int = 2
    publish_device: str = ""
    """``cuda:N`` for the cuda_ipc transport."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for name in ("http_read_auth", "debug_invariants", "defer_caching"):
            check_switch(f"server.{name}", getattr(self, name))
        if not isinstance(self.publish_device, str):
            raise ConfigError(
                "publish.device", f"must be a string ('cuda:N'), got {self.publish_device!r}"
            )
        for name in ("grpc_address", "http_address"):
            _check_address(name, getattr(self, name))
        if self.local_socket is not None:
            path = self.local_socket
            if not isinstance(path, str) or not path.strip():
                raise ConfigError("server.local_socket", "must be a socket path when set")
            _check_unix_path("server.local_socket", path)
        for name in (
            "token",
            "admin_token",
            "token_file",
            "admin_token_file",
            "tls_cert_file",
            "tls_key_file",
            "tls_client_ca_file",
        ):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ConfigError(f"server.{name}", "must be a non-empty string when set")
            if value == _REDACTED:
                # `pagekeeper config > file` writes this in place of a secret: serving with
                # it would lock the real clients out and let in whoever knows the word.
                raise ConfigError(
                    f"server.{name}",
                    f"is {_REDACTED!r}, what `pagekeeper config` prints in place of a secret; "
                    "give the secret itself (or its file) instead",
                )
        for name in ("token", "admin_token"):
            if "\0" in (getattr(self, name) or ""):
                raise ConfigError(f"server.{name}", "must not contain a NUL character")
            if getattr(self, name) is not None and getattr(self, f"{name}_file") is not None:
                raise ConfigError(f"server.{name}_file", f"set {name} or {name}_file, not both")
        if self.http_read_auth and not (
            self.token or self.token_file or self.admin_token or self.admin_token_file
        ):
            raise ConfigError(
                "server.http_read_auth", "needs a token: set token or token_file (or the admin's)"
            )
        self._validate_kv_events()
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            missing = "tls_key_file" if self.tls_key_file is None else "tls_cert_file"
            raise ConfigError(f"server.{missing}", "TLS needs both a certificate and its key")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ConfigError(
                "server.tls_client_ca_file",
                "client certificates need TLS: set tls_cert_file and tls_key_file too",
            )
        for name, low in (
            ("max_message_bytes", 1024),
            ("max_clients", 1),
            ("max_requests_per_step", 1),
            ("max_tokens_per_step", 1),
            ("event_buffer_size", 1),
            ("event_buffer_bytes", 1024),
            ("snapshot_every", 1),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"server.{name}", f"must be an int >= {low}, got {value!r}")
        if self.max_message_bytes >= 2**31:
            raise ConfigError("server.max_message_bytes", "must be below 2 GiB (gRPC limit)")
        for name in ("lease_ttl_s", "max_lease_ttl_s", "shutdown_grace_s", "lease_grace_s"):
            value = getattr(self, name)
            is_number = isinstance(value, int | float) and not isinstance(value, bool)
            low_ok = is_number and (value >= 0 if name == "lease_grace_s" else value > 0)
            if not is_number or not math.isfinite(value) or not low_ok:
                raise ConfigError(f"server.{name}", f"must be a positive number, got {value!r}")
        if self.lease_ttl_s > self.max_lease_ttl_s:
            raise ConfigError(
                "server.lease_ttl_s", f"exceeds max_lease_ttl_s {self.max_lease_ttl_s}"
            )
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(
                "server.log_level", f"one of {list(LOG_LEVELS)}, got {self.log_level!r}"
            )
        if self.log_format not in LOG_FORMATS:
            raise ConfigError(
                "server.log_format", f"one of {list(LOG_FORMATS)}, got {self.log_format!r}"
            )
        if not isinstance(self.data_dir, str) or not self.data_dir:
            raise ConfigError("server.data_dir", "must be a non-empty path string")
        if self.durability not in DURABILITY_LEVELS:
            raise ConfigError(
                "server.durability", f"one of {list(DURABILITY_LEVELS)}, got {self.durability!r}"
            )
        if not isinstance(self.pool, PoolConfig):
            raise ConfigError("pool", "must be a PoolConfig")
        if self.publish_transport not in PUBLISH_TRANSPORTS:
            raise ConfigError(
                "publish.transport",
                f"one of {list(PUBLISH_TRANSPORTS)}, got {self.publish_transport!r}",
            )
        if not isinstance(self.ring_depth, int) or isinstance(self.ring_depth, bool):
            raise ConfigError("publish.ring_depth", f"must be an int, got {self.ring_depth!r}")
        if not 1 <= self.ring_depth <= 64:
            raise ConfigError("publish.ring_depth", f"must lie in [1, 64], got {self.ring_depth}")
        if self.publish_transport == "cuda_ipc" and not self.publish_device.startswith("cuda:"):
            raise ConfigError("publish.device", "the cuda_ipc transport needs device = 'cuda:N'")

    def _validate_kv_events(self) -> None:
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            value = getattr(self, name)
            if value is not None:
                _check_zmq_endpoint(f"server.{name}", value)
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ConfigError(
                "server.kv_events_replay_endpoint", "replay needs kv_events_endpoint set too"
            )
        if (
            self.kv_events_replay_endpoint is not None
            and self.kv_events_replay_endpoint == self.kv_events_endpoint
            and not self.kv_events_endpoint.endswith(":0")  # port 0: two free ports
        ):
            raise ConfigError(
                "server.kv_events_replay_endpoint", "must differ from kv_events_endpoint"
            )
        if not isinstance(self.kv_events_topic, str):
            raise ConfigError("server.kv_events_topic", "must be a string")
        if self.kv_events_hash_format not in KV_EVENT_HASH_FORMATS:
            raise ConfigError(
                "server.kv_events_hash_format",
                f"one of {list(KV_EVENT_HASH_FORMATS)}, got {self.kv_events_hash_format!r}",
            )
        for name, low in (("kv_events_buffer_steps", 1), ("kv_events_data_parallel_rank", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"server.{name}", f"must be an int >= {low}, got {value!r}")

    def to_dict(self, *, redact: bool = True) -> dict[str, Any]:
        """The nested form of the TOML file (``None`` values dropped: TOML has no null)."""

        def secret(value: str | None) -> str | None:
            return _REDACTED if (redact and value is not None) else value

        server = {
            "grpc_address": self.grpc_address,
            "http_address": self.http_address,
            "local_socket": self.local_socket,
            "token": secret(self.token),
            "admin_token": secret(self.admin_token),
            "token_file": self.token_file,
            "admin_token_file": self.admin_token_file,
            "http_read_auth": self.http_read_auth,
            "tls_cert_file": self.tls_cert_file,
            "tls_key_file": self.tls_key_file,
            "tls_client_ca_file": self.tls_client_ca_file,
            "max_message_bytes": self.max_message_bytes,
            "max_clients": self.max_clients,
            "max_requests_per_step": self.max_requests_per_step,
            "max_tokens_per_step": self.max_tokens_per_step,
            "lease_ttl_s": self.lease_ttl_s,
            "max_lease_ttl_s": self.max_lease_ttl_s,
            "lease_grace_s": self.lease_grace_s,
            "event_buffer_size": self.event_buffer_size,
            "event_buffer_bytes": self.event_buffer_bytes,
            "kv_events_endpoint": self.kv_events_endpoint,
            "kv_events_replay_endpoint": self.kv_events_replay_endpoint,
            "kv_events_topic": self.kv_events_topic,
            "kv_events_hash_format": self.kv_events_hash_format,
            "kv_events_buffer_steps": self.kv_events_buffer_steps,
            "kv_events_data_parallel_rank": self.kv_events_data_parallel_rank,
            "debug_invariants": self.debug_invariants,
            "defer_caching": self.defer_caching,
            "data_dir": self.data_dir,
            "durability": self.durability,
            "snapshot_every": self.snapshot_every,
            "log_level": self.log_level,
            "log_format": self.log_format,
            "shutdown_grace_s": self.shutdown_grace_s,
        }
        pool = self.pool.to_dict()
        pool["groups"] = [{k: v for k, v in g.items() if v is not None} for g in pool["groups"]]
        return {
            "server": {k: v for k, v in server.items() if v is not None},
            "pool": pool,
            "publish": {
                "transport": self.publish_transport,
                "ring_depth": self.ring_depth,
                "device": self.publish_device,
            },
        }


def _check_address(name: str, value: object) -> None:
    where = f"server.{name}"
    if not isinstance(value, str) or not value:
        raise ConfigError(where, "must be HOST:PORT or unix:PATH")
    if value.startswith("unix:"):
        if len(value) <= len("unix:"):
            raise ConfigError(where, "unix: needs a socket path")
        return
    host, sep, port = value.rpartition(":")
    if not sep or not host:
        raise ConfigError(where, f"must be HOST:PORT or unix:PATH, got {value!r}")
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(where, f"port must be an int in [0, 65535], got {port!r}")


def _check_unix_path(where: str, path: str) -> None:
    size = len(os.fsencode(os.path.abspath(path)))
    if size > _MAX_UNIX_PATH:
        raise ConfigError(
            where,
            f"the absolute path must be at most {_MAX_UNIX_PATH} bytes (a unix socket "
            f"address), got {size}",
        )


def _check_zmq_endpoint(where: str, value: object) -> None:
    if not isinstance(value, str):
        raise ConfigError(where, "must be tcp://HOST:PORT or ipc://PATH")
    if value.startswith("ipc://"):
        if len(value) <= len("ipc://"):
            raise ConfigError(where, "ipc:// needs a path")
        _check_unix_path(where, value[len("ipc://") :])
        return
    if not value.startswith("tcp://"):
        raise ConfigError(where, f"must be tcp://HOST:PORT or ipc://PATH, got {value!r}")
    host, sep, port = value[len("tcp://") :].rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(where, f"must be tcp://HOST:PORT (port 0-65535), got {value!r}")


def split_address(address: str) -> tuple[str, int]:
    """``"[::1]:80"`` → ``("::1", 80)``; ``"h:0"`` → ``("h", 0)``."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


# -- the one table of knobs ------------------------------------------------------------------


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _parse_int(text: str) -> int:
    return int(text.strip().replace("_", ""))


@dataclass(frozen=True, slots=True)
class Option:
    """One knob: ``path`` in the TOML file (``section.key``), its env var and flag."""

    path: str
    parse: Callable[[str], Any]
    help: str

    @property
    def is_switch(self) -> bool:
        """A yes/no setting (its flag alone means yes)."""
        return self.parse is _parse_bool

    @property
    def env(self) -> str:
        key = self.path.split(".", 1)[1]
        if self.path.startswith("publish."):
            key = "publish_" + key if key != "ring_depth" else key
        return ENV_PREFIX + key.upper()

    @property
    def flag(self) -> str:
        return "--" + self.env[len(ENV_PREFIX) :].lower().replace("_", "-")


OPTIONS: tuple[Option, ...] = (
    Option("server.grpc_address", str, "gRPC listen address, HOST:PORT or unix:PATH"),
    Option("server.http_address", str, "HTTP listen address, HOST:PORT or unix:PATH"),
    Option("server.local_socket", str, "unix socket path for same-host clients (default: off)"),
    Option("server.token", str, "bearer token for gRPC calls and HTTP mutations"),
    Option("server.admin_token", str, "bearer token for HTTP admin endpoints (default: token)"),
    Option("server.token_file", str, "file of accepted bearer tokens, one a line (re-read)"),
    Option("server.admin_token_file", str, "file of accepted admin tokens, one a line"),
    Option(
        "server.http_read_auth",
        _parse_bool,
        "require the token on HTTP reads too (/v1/...; health, metrics, the page stay open)",
    ),
    Option("server.tls_cert_file", str, "PEM certificate chain: serve gRPC and HTTP over TLS"),
    Option("server.tls_key_file", str, "PEM private key of the TLS certificate"),
    Option(
        "server.tls_client_ca_file",
        str,
        "PEM CA certificates gRPC clients' certificates must be signed by (mutual TLS)",
    ),
    Option("server.max_message_bytes", _parse_int, "largest gRPC message, bytes"),
    Option("server.max_clients", _parse_int, "most registered clients"),
    Option("server.max_requests_per_step", _parse_int, "most requests per Step / batch"),
    Option("server.max_tokens_per_step", _parse_int, "most scheduled tokens per batch"),
    Option("server.lease_ttl_s", float, "default client lease TTL, seconds"),
    Option("server.max_lease_ttl_s", float, "longest lease a client may ask for, seconds"),
    Option("server.lease_grace_s", float, "delay before an expired scheduler's requests are freed"),
    Option("server.event_buffer_size", _parse_int, "KV events kept for resumption"),
    Option("server.event_buffer_bytes", _parse_int, "...and at most this many bytes of them"),
    Option("server.kv_events_endpoint", str, "ZeroMQ PUB endpoint for KV events (vLLM format)"),
    Option("server.kv_events_replay_endpoint", str, "ZeroMQ ROUTER endpoint for replays"),
    Option("server.kv_events_topic", str, "topic frame of published KV-event batches"),
    Option("server.kv_events_hash_format", str, "int (low 64 bits, vLLM's default) or bytes"),
    Option("server.kv_events_buffer_steps", _parse_int, "KV-event batches kept for replay"),
    Option("server.kv_events_data_parallel_rank", _parse_int, "data_parallel_rank of each batch"),
    Option("server.debug_invariants", _parse_bool, "check core invariants after every mutation"),
    Option(
        "server.defer_caching",
        _parse_bool,
        "cache a step's admitted pages after its answer is sent (false: before)",
    ),
    Option("server.data_dir", str, "directory for durable state"),
    Option(
        "server.durability",
        str,
        "none, process (survives kill -9) or fsync (survives power loss)",
    ),
    Option("server.snapshot_every", _parse_int, "log records between two snapshots"),
    Option("server.log_level", str, "debug, info, warning or error"),
    Option("server.log_format", str, "text, or json (one object a line) for log collectors"),
    Option("server.shutdown_grace_s", float, "drain time on SIGTERM, seconds"),
    Option("pool.num_pages", _parse_int, "pages in the pool, null page included"),
    Option("pool.page_size", _parse_int, "page size of the (single) KV-cache group, tokens"),
    Option("pool.max_model_len", _parse_int, "most tokens per request"),
    Option("pool.enable_prefix_caching", _parse_bool, "enable the prefix cache"),
    Option("pool.hash_algorithm", str, "page hash: sha256_cbor or xxhash_cbor"),
    Option("publish.transport", str, "table publication: shm, cpu_ipc, cuda_ipc or none"),
    Option("publish.ring_depth", _parse_int, "slots in the publication ring"),
    Option("publish.device", str, "cuda:N for the cuda_ipc transport"),
)
OPTIONS_BY_PATH = {o.path: o for o in OPTIONS}


def _set(tree: dict[str, Any], path: str, value: Any) -> None:
    section, key = path.split(".", 1)
    tree.setdefault(section, {})[key] = value


def _merge(base: dict[str, Any], top: Mapping[str, Any]) -> None:
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def read_toml(path: str) -> dict[str, Any]:
    """Parse a config file; unreadable or malformed files raise ConfigError("config")."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError("config", f"cannot read {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("config", f"{path} is not valid TOML: {exc}") from None


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """The ``PAGEKEEPER_*`` variables that name a known option, parsed."""
    tree: dict[str, Any] = {}
    for option in OPTIONS:
        raw = environ.get(option.env)
        if raw is None:
            continue
        tree_value = _parse(option, raw, source=option.env)
        _set(tree, option.path, tree_value)
    return tree


# Variables the client, workers, the compose file and tools read (not settings of the
# service): never taken for a misspelled setting.
OTHER_ENV = frozenset(
    ENV_PREFIX + name
    for name in (
        "CONFIG",
        "TLS_CA_FILE",
        "TLS_CLIENT_CERT_FILE",
        "TLS_CLIENT_KEY_FILE",
        "FEED_ADDRESS",
        "FEED_TIMEOUT",
        "WORKER_DEVICE",
        "WORKER_BACKENDS",
        "SCHEDULER_STEPS",
        "SCHEDULER_MAX_RUNNING",
        "SCHEDULER_WORKERS",
        "PUBLISH_HOST",
        "HTTP_PORT",
        "GRPC_PORT",
        "NATIVE_HASHING",
        "NATIVE_POOL",
        "NATIVE_CLIENT",
        "VLLM_VENV",
        "VLLM_ENGINE",
        "PROPERTY_SCALE",
    )
)


def misspelled_env(environ: Mapping[str, str]) -> list[tuple[str, str]]:
    """``(variable, the setting's variable it is probably meant as)`` for each
    ``PAGEKEEPER_*`` variable that names no setting but nearly names one (a typo is ignored
    like any variable the service does not read: clients, workers and tools read others)."""
    known = [option.env for option in OPTIONS]
    out = []
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or name in known or name in OTHER_ENV:
            continue
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.9)
        if close:
            out.append((name, close[0]))
    return out


def _parse(option: Option, raw: str, *, source: str) -> Any:
    try:
        return option.parse(raw)
    except ValueError as exc:
        raise ConfigError(option.path, f"{source}={raw!r}: {exc}") from None


def flag_overrides(values: Mapping[str, str | None]) -> dict[str, Any]:
    """Command-line values keyed by option path (None = flag not given), parsed."""
    tree: dict[str, Any] = {}
    for path, raw in values.items():
        if raw is None:
            continue
        option = OPTIONS_BY_PATH[path]
        _set(tree, path, _parse(option, raw, source=option.flag))
    return tree


def from_tree(tree: Mapping[str, Any]) -> Settings:
    """Build (and validate) settings from the nested TOML-shaped form."""
    unknown = set(tree) - {"server", "pool", "publish"}
    if unknown:
        raise ConfigError(sorted(unknown)[0], "unknown section (server, pool, publish)")
    server = dict(_section(tree, "server"))
    pool = dict(_section(tree, "pool"))
    publish = dict(_section(tree, "publish"))

    known_server = {f.name for f in fields(Settings)} - {
        "pool",
        "publish_transport",
        "ring_depth",
        "publish_device",
    }
    for key in server:
        if key not in known_server:
            raise ConfigError(f"server.{key}", "unknown field")
    for key in publish:
        if key not in ("transport", "ring_depth", "device"):
            raise ConfigError(f"publish.{key}", "unknown field")

    # `page_size` is the flat shortcut for single-group pools (env var / flag).
    page_size = pool.pop("page_size", None)
    try:
        pool_config = PoolConfig.from_dict(pool)
        if page_size is not None:
            if len(pool_config.groups) != 1:
                raise ConfigError(
                    "page_size", "only applies to a single-group pool; set pool.groups instead"
                )
            group = replace(pool_config.groups[0], page_size=page_size)
            pool_config = replace(pool_config, groups=(group,))
    except ConfigError as exc:
        # The core names fields inside the pool; the user knows them as pool.<field>.
        raise ConfigError(f"pool.{exc.field}", exc.reason) from None
    except TypeError as exc:  # e.g. a string where the core compares numbers
        raise ConfigError("pool", str(exc)) from None
    settings = Settings(
        **{k: v for k, v in server.items()},
        pool=pool_config,
        publish_transport=publish.get("transport", "shm"),
        ring_depth=publish.get("ring_depth", 2),
        publish_device=publish.get("device", ""),
    )
    return settings


def _section(tree: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = tree.get(name, {})
    if not isinstance(value, Mapping):
        raise ConfigError(name, "must be a table")
    return value


def load_settings(
    *,
    config_path: str | None = None,
    environ: Mapping[str, str] | None = None,
    flags: Mapping[str, str | None] | None = None,
) -> Settings:
    """Defaults < TOML (``config_path``, else ``$PAGEKEEPER_CONFIG``) < env < flags."""
    environ = os.environ if environ is None else environ
    tree: dict[str, Any] = {}
    path = config_path or environ.get(ENV_PREFIX + "CONFIG")
    if path:
        _merge(tree, read_toml(path))
    _merge(tree, env_overrides(environ))
    _merge(tree, flag_overrides(flags or {}))
    try:
        return from_tree(tree)
    except TypeError as exc:  # a wrongly typed value that reached a constructor
        raise ConfigError("config", str(exc)) from None


# -- printing --------------------------------------------------------------------------------


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def to_toml(settings: Settings) -> str:
    """The effective configuration as a TOML file ``--config`` reads back (secrets
    redacted)."""
    tree = settings.to_dict()
    lines: list[str] = []
    for section in ("server", "pool", "publish"):
        values = tree[section]
        lines.append(f"[{section}]")
        tables = {
            k: v for k, v in values.items() if isinstance(v, list) and v and isinstance(v[0], dict)
        }
        for key, value in values.items():
            if key not in tables:
                lines.append(f"{key} = {_toml_value(value)}")
        for key, rows in tables.items():
            for row in rows:
                lines.append("")
                lines.append(f"[[{section}.{key}]]")
                lines.extend(f"{k} = {_toml_value(v)}" for k, v in row.items())
        lines.append("")
    return "\n".join(lines)


def to_json(settings: Settings) -> str:
    return json.dumps(settings.to_dict(), indent=2, sort_keys=False)


__all__ = [
    "OPTIONS",
    "Option",
    "Settings",
    "load_settings",
    "split_address",
    "to_json",
    "to_toml",
]
