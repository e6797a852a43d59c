"""The service process: one asyncio loop running the gRPC server and uvicorn (FastAPI) over
one runtime, a lease reaper, and graceful shutdown on SIGTERM/SIGINT.

Start-up order: build the pool, recovering it from the data directory (readiness
impossible before) → bind gRPC → bind HTTP → mark ready (health SERVING, /readyz 200) → log
the bound addresses and write the ready file. Shutdown: not ready → end streams → stop gRPC
(drain in-flight calls up to ``shutdown_grace_s``) → stop uvicorn (same) → release the
publication ring → snapshot the state and close the data directory (the next start-up
replays nothing).

Housekeeping on the loop, between calls: the lease reaper, and snapshots whenever the log
has grown by ``snapshot_every`` records. A failed durable write stops the process (the
state is then ahead of its log; a restart recovers the last durable state).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import json
import logging
import os
import signal
import socket
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

import uvicorn
from prometheus_client import Counter

from pagekeeper.auth import BearerTokens
from pagekeeper.core.errors import ConfigError, PagekeeperError
from pagekeeper.core.hashing import native_hashing
from pagekeeper.core.pool import native_pool
from pagekeeper.kvevents import KvEventCollector, KvEventPublisher, run_publisher
from pagekeeper.rest.app import create_app
from pagekeeper.rpc.local import LocalServer
from pagekeeper.rpc.server import GrpcServer
from pagekeeper.runtime import Runtime, build_runtime
from pagekeeper.settings import Settings, split_address
from pagekeeper.state import ExpireLeasesCommand
from pagekeeper.tls import RELOAD_INTERVAL_S, ServerTLS, load_server_tls

log = logging.getLogger("pagekeeper")

READY_LINE_PREFIX = "pagekeeper ready"
"""Start of the one stdout line that carries the bound addresses (JSON after a space)."""


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: the process shuts both servers down."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind_http_socket(address: str) -> socket.socket:
    """A listening socket for uvicorn; binding here lets port 0 report its real port."""
    if address.startswith("unix:"):
        path = address[len("unix:") :]
        with contextlib.suppress(FileNotFoundError):
            if Path(path).is_socket():
                os.unlink(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(path)
        sock.listen(2048)
        return sock
    host, port = split_address(address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY on accepted connections only when
    # the listening socket says so (proto 0 would leave Nagle on, and every keep-alive
    # response would wait ~40 ms for a delayed ACK).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def _socket_address(sock: socket.socket, asked: str) -> str:
    if asked.startswith("unix:"):
        return asked
    host, port = sock.getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def write_ready_file(path: str, info: dict[str, object]) -> None:
    """Atomically (write + rename): a reader never sees half a file."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(info, f)
    os.replace(tmp, path)


LEASE_HOLD_S = 1.0
"""A reaper tick this much later than due makes the reaper renew every lease first."""


async def _reap_leases(runtime: Runtime, period: float) -> None:
    """Expire leases every ``period``. Leases run on the wall clock (they are journaled and
    survive restarts), so two things are set right first: the service itself held past the
    tick (a stall, a stopped process: heartbeats could not be answered) renews every lease,
    as a restart does (a journaled ResumeLeasesCommand); a step of the wall clock is found
    by :meth:`Runtime.now` itself, which every tick reads (so at least every second), and
    moves every lease by the step."""
    resumes = runtime.metrics.lease_resumes
    monotonic = runtime.monotonic  # the clock now() holds the wall clock against
    last_mono = monotonic()
    while True:
        await asyncio.sleep(period)
        try:
            wall = runtime.now()
            mono = monotonic()
            late = mono - last_mono - period
            last_mono = mono
            if late > LEASE_HOLD_S:
                command = runtime.state.resume_command(wall)
                count = runtime.state.resume_leases(command)
                resumes.labels("stall").inc()
                log.warning(
                    "the service was held %.1fs past a lease tick: every lease set to %s one "
                    "full lease before expiring any (%d client(s))",
                    late,
                    "exactly" if command.mode == "exact" else "at least",
                    count,
                )
            result = runtime.state.expire_leases(ExpireLeasesCommand(wall))
        except PagekeeperError as exc:
            # Only a fenced state refuses this (its log failed; the process is stopping).
            log.error("lease reaper: %s", exc.message)
            continue
        if result.expired_client_ids:
            log.warning(
                "leases expired: %s (%d requests freed)",
                ", ".join(result.expired_client_ids),
                result.num_freed_requests,
            )


async def _take_snapshots(runtime: Runtime, period: float) -> None:
    """Snapshot between calls once the log has grown by ``snapshot_every`` records."""
    durability = runtime.durability
    assert durability is not None
    while True:
        await asyncio.sleep(period)
        if durability.snapshot_due:
            # Encoded in a worker thread: calls go on meanwhile (a stop cancels it here,
            # and the graceful stop's own snapshot covers everything).
            await durability.snapshot_in_background(runtime.state)


def _valid_until(tls: ServerTLS) -> str:
    not_after = tls.not_after
    if not_after is None:
        return ""
    when = datetime.fromtimestamp(not_after, UTC).isoformat(timespec="seconds")
    return f" (valid until {when})"


def _note_expiry(runtime: Runtime, tls: ServerTLS) -> None:
    not_after = tls.not_after
    if not_after is not None:
        runtime.metrics.tls_not_after.set(not_after)


def _reload(
    counter: Counter,
    reload: Callable[[], bool],
    loaded: Callable[[], str],
    failed: str,
) -> None:
    """One look at rotated files: ``reload()`` True means new ones are in force
    (``loaded()`` says what to log); a ConfigError, that they do not load (``failed``
    starts the log line, which ends with what stays in force)."""
    try:
        if reload():
            counter.labels("loaded").inc()
            log.info("%s", loaded())
    except ConfigError as exc:
        counter.labels("failed").inc()
        log.error(failed, exc.field, exc.reason)


def _tokens_loaded(runtime: Runtime, holder: BearerTokens) -> str:
    # Streams re-check their token when woken: a revoked one ends them now, not at the
    # next event.
    runtime.events.notify()
    runtime.hub.notifier.notify()
    return f"bearer tokens reloaded from {holder.path}: {holder.count} accepted now"


def _tls_loaded(runtime: Runtime, tls: ServerTLS) -> str:
    _note_expiry(runtime, tls)
    return f"TLS files reloaded: new connections get the new certificate{_valid_until(tls)}"


async def _watch_files(
    runtime: Runtime,
    tls: ServerTLS | None,
    token_holders: tuple[BearerTokens, ...],
    wake: asyncio.Event,
) -> None:
    """Reload rotated TLS and token files: every RELOAD_INTERVAL_S, and at once on SIGHUP."""
    for counter, watched in (
        (runtime.metrics.tls_reloads, tls is not None),
        (runtime.metrics.token_reloads, bool(token_holders)),
    ):
        if watched:
            for result in ("loaded", "failed"):
                counter.labels(result)  # both series exist from the start (at 0)
    while True:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), RELOAD_INTERVAL_S)
        forced = wake.is_set()  # SIGHUP: token files are read even if they seem unchanged
        wake.clear()
        if tls is not None:
            _reload(
                runtime.metrics.tls_reloads,
                tls.reload_if_changed,
                lambda: _tls_loaded(runtime, tls),
                "TLS files changed but do not load (%s: %s); the previous certificate keeps "
                "serving",
            )
        for holder in token_holders:
            _reload(
                runtime.metrics.token_reloads,
                functools.partial(holder.reload_if_changed, force=forced),
                functools.partial(_tokens_loaded, runtime, holder),
                "token file changed but does not load (%s: %s); the tokens in force stay",
            )


SETTLE_DELAY_S = 0.001
"""How long after an answer the work a step deferred waits (unless a call comes first and
does it): long enough for the caller to take the reply before this process competes with
it for a core. Measured on 2 cores, 8 x 2,000-token admissions: settling at once made the
step's round trip 5-12% slower than settling 1-3 ms later (it ran while the caller was
still taking the reply); a scheduler's next step comes after a forward pass, far later."""


async def serve(
    settings: Settings,
    *,
    ready_file: str | None = None,
    stop: asyncio.Event | None = None,
    runtime: Runtime | None = None,
    tls: ServerTLS | Literal["settings"] | None = "settings",
) -> None:
    """Run until SIGTERM/SIGINT (or ``stop`` is set), then drain and return. ``tls``: the
    checked TLS material (default: loaded from ``settings``; raises ConfigError)."""
    if tls == "settings":
        tls = load_server_tls(settings)
    runtime = runtime or build_runtime(settings)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread
            loop.add_signal_handler(sig, stop.set)
    runtime.on_fatal.append(lambda reason: loop.call_soon_threadsafe(stop.set))

    state = runtime.state
    settle_timer: asyncio.TimerHandle | None = None

    def settle() -> None:
        nonlocal settle_timer
        settle_timer = None
        try:
            state.settle()
        except Exception as exc:  # a bug: the state can no longer be trusted
            log.exception("settling deferred prefix-cache work failed")
            runtime.fail(f"settling deferred prefix-cache work failed: {exc}")

    def schedule_settle() -> None:
        nonlocal settle_timer
        if settle_timer is None:
            settle_timer = loop.call_later(SETTLE_DELAY_S, settle)

    if settings.defer_caching:
        # A step's admissions cache their pages (and drop the pages they evicted from the
        # index) after the answer is on its way: the reply does not wait for it. Every
        # other call settles first.
        state.defer_caching(schedule_settle)
    if runtime.durability is not None:
        # The journal's next records go into zeros written ahead of them, after the answer
        # of the step that asked (see CommandLog.reserve_ahead).
        reserve = runtime.durability.reserve_ahead
        runtime.durability.schedule_reserve = lambda: loop.call_later(SETTLE_DELAY_S, reserve)

    runtime.tls = tls  # before the servicer: it binds registrations to certificates
    grpc_server = GrpcServer(runtime)
    grpc_address = await grpc_server.start(
        settings.grpc_address, None if tls is None else tls.grpc_credentials()
    )
    local_server: LocalServer | None = None
    try:
        http_socket = bind_http_socket(settings.http_address)
    except OSError as exc:
        await grpc_server.stop(0)
        raise OSError(
            f"cannot bind HTTP to {settings.http_address}: {exc.strerror or exc}"
        ) from None
    http_address = _socket_address(http_socket, settings.http_address)
    config = uvicorn.Config(
        create_app(runtime),
        log_level="warning" if settings.log_level != "debug" else "debug",
        access_log=settings.log_level == "debug",
        log_config=None,  # uvicorn's records go through the process's handler and format
        lifespan="off",
        timeout_graceful_shutdown=max(1, round(settings.shutdown_grace_s)),
        **({} if tls is None else tls.uvicorn_options()),
    )
    http_server = _Uvicorn(config)
    http_task = asyncio.create_task(http_server.serve(sockets=[http_socket]), name="uvicorn")
    housekeeping = [
        asyncio.create_task(
            _reap_leases(runtime, min(1.0, settings.lease_ttl_s / 4)), name="lease-reaper"
        )
    ]
    if runtime.durability is not None:
        housekeeping.append(asyncio.create_task(_take_snapshots(runtime, 0.5), name="snapshots"))
    housekeeping.append(
        asyncio.create_task(runtime.metrics.probe_loop_lag(), name="loop-lag-probe")
    )
    if tls is not None:
        _note_expiry(runtime, tls)
    token_holders = runtime.tokens.holders()
    reload_now = asyncio.Event()
    # SIGHUP reloads what can be reloaded, and never stops the service (its default action).
    with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread
        loop.add_signal_handler(signal.SIGHUP, reload_now.set)
    if tls is not None or token_holders:
        housekeeping.append(
            asyncio.create_task(
                _watch_files(runtime, tls, token_holders, reload_now), name="file-reload"
            )
        )
    kv_task: asyncio.Task[None] | None = None
    try:
        runtime.kv_events = KvEventPublisher.from_settings(settings, runtime.state, runtime.events)
        if runtime.kv_events is not None:
            runtime.metrics.registry.register(KvEventCollector(runtime.kv_events))
            # Stopped after the drain (steps finishing then are published too).
            kv_task = asyncio.create_task(run_publisher(runtime.kv_events), name="kv-events")
            kv_task.add_done_callback(_report_publisher_end)
        while not http_server.started:
            if http_task.done():
                http_task.result()  # re-raise the start-up failure
                raise RuntimeError("the HTTP server stopped during start-up")
            await asyncio.sleep(0.005)

        # The pool, the recovered state and the imported modules live as long as the
        # process: keep them out of the collector's scans (full collections over them
        # paused steps for 40-50 ms). The young generation: grpc.aio leaves ~5 objects
        # of cyclic garbage per call (the closure of its method-handler lookup), which
        # only a collection frees; a pause grows with what it finds (~0.35 us an object
        # here), so at 5,000 it is ~4 ms every ~1,000 calls (at 50,000: 18-20 ms every
        # ~10,000; at 2,000: 2-3 ms every ~400 calls).
        gc.collect()
        gc.freeze()
        gc.set_threshold(5_000, 20, 100)
        runtime.metrics.watch_gc()  # the collections while serving (not the one above)
        runtime.is_ready = True
        if settings.local_socket:
            local_server = LocalServer(grpc_server.servicer)
            await local_server.start(os.path.abspath(settings.local_socket))
        await grpc_server.set_serving(True)
        kv = runtime.kv_events
        info = {
            "pid": os.getpid(),
            "grpc_address": grpc_address,
            "http_address": http_address,
            "grpc_port": _port(grpc_address),
            "http_port": _port(http_address),
            "local_socket": local_server.path if local_server is not None else None,
            "tls": tls is not None,
            "kv_events_endpoint": None if kv is None else kv.endpoint,
            "kv_events_replay_endpoint": None if kv is None else kv.replay_endpoint,
        }
        log.info(
            "gRPC on %s, HTTP on %s%s%s; page hashing in %s, pool loops in %s",
            grpc_address,
            http_address,
            ""
            if tls is None
            else " over TLS"
            + (", gRPC clients need a certificate" if tls.requires_client_certificates else "")
            + _valid_until(tls),
            (f", local socket {local_server.path}" if local_server is not None else "")
            + (f", KV events on {kv.endpoint}" if kv is not None else ""),
            "C (pagekeeper.core._native)" if native_hashing() else "pure Python",
            "C (pagekeeper.core._poolops)" if native_pool() else "pure Python",
        )
        print(f"{READY_LINE_PREFIX} {json.dumps(info)}", flush=True)
        if ready_file:
            # Last: whoever waits for the file finds the ready line already written.
            write_ready_file(ready_file, info)

        await stop.wait()
        if runtime.fatal:
            log.critical("stopping: %s", runtime.fatal)
        log.info("shutting down: draining for up to %.1fs", settings.shutdown_grace_s)
    finally:
        runtime.begin_shutdown()
        runtime.metrics.unwatch_gc()
        for task in housekeeping:
            task.cancel()
        if local_server is not None:
            await local_server.stop()
        await grpc_server.stop(settings.shutdown_grace_s)
        http_server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await http_task
        http_socket.close()
        if settings.http_address.startswith("unix:"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(settings.http_address[len("unix:") :])  # ours: bound above
        if kv_task is not None:
            kv_task.cancel()
            # Its own failure, if it had one, was reported when it ended.
            await asyncio.gather(kv_task, return_exceptions=True)
        if runtime.kv_events is not None:
            try:
                runtime.kv_events.publish_pending()  # the drained steps' events
            except Exception:  # the snapshot below matters more than routers' last batch
                log.exception("the KV-event publisher could not send the drained steps' events")
            runtime.kv_events.close()
        runtime.close()
        if ready_file:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(ready_file)
        log.info("stopped")


def _report_publisher_end(task: asyncio.Task[None]) -> None:
    """The KV-event publisher runs until shutdown cancels it: any other end is logged (the
    service goes on; WatchEvents and /v1/events still serve the events)."""
    if not task.cancelled() and task.exception() is not None:
        log.error(
            "the KV-event publisher stopped: %r; no more events go out over ZeroMQ",
            task.exception(),
        )


def _port(address: str) -> int | None:
    if address.startswith("unix:"):
        return None
    return int(address.rpartition(":")[2])
