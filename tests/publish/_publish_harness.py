"""Test harness for the publication contract suite: a reader in another process.

IPC transports refuse an import in the exporting process (as CUDA does), so every contract
test reads through a :class:`RemoteReader`: a spawned process that opens table views and
answers commands over a pipe. A second, one-way pipe feeds packed slots to stream views
(standing in for the WatchTables gRPC stream), consumed by a thread as a gRPC consumer
would be.

Only ``pagekeeper_client`` (and numpy) is imported in the reader process, never the service.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

# -- deterministic step contents: "the checksum embedded in the data" -------------------------


PATTERN_PERIOD = 64
"""Step contents repeat every PATTERN_PERIOD steps, so a writer can precompute them; two
steps that can share a slot while a read is in flight (``s`` and ``s + k * depth`` for
small ``k``) always differ."""


def pattern_shape(step: int, max_reqs: int, max_cols: int, max_tokens: int) -> tuple[int, int, int]:
    """(num_reqs, num_cols, num_tokens) of step ``step`` in the stress pattern."""
    phase = step % PATTERN_PERIOD
    return (
        1 + (phase * 7) % max_reqs,
        max(max_cols - phase % 5, 0),
        max(max_tokens - (phase * 3) % 17, 0),
    )


def pattern_arrays(
    step: int, table: int, max_reqs: int, max_cols: int, max_tokens: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The arrays step ``step`` publishes for table ``table``: every element is a function of
    (step phase, table, position), so any mix of two steps' bytes is detected."""
    phase = step % PATTERN_PERIOD
    num_reqs, num_cols, num_tokens = pattern_shape(step, max_reqs, max_cols, max_tokens)
    salt = phase * 1_000_003 + table * 7919
    bt = (np.arange(num_reqs * num_cols, dtype=np.int64).reshape(num_reqs, num_cols) + salt) % (
        2**31 - 1
    )
    rl = (np.arange(num_reqs, dtype=np.int64) + phase + table) % (num_cols + 1)
    sm = np.arange(num_tokens, dtype=np.int64) * 3 + salt
    return bt.astype(np.int32), rl.astype(np.int32), sm


def pattern_pad_id(step: int) -> int:
    return (step % PATTERN_PERIOD) % 3


def verify_step(
    step_tables: Any, specs: list[tuple[int, int, int]], max_reqs: int, max_tokens: int
) -> bool:
    """True iff ``step_tables`` holds exactly the pattern of its own step."""
    step = step_tables.step_seq
    if len(step_tables.tables) != len(specs):
        return False
    for i, t in enumerate(step_tables.tables):
        group_id, kbs, max_cols = specs[i]
        if (t.group_id, t.kernel_block_size) != (group_id, kbs):
            return False
        bt, rl, sm = pattern_arrays(step, i, max_reqs, max_cols, max_tokens)
        if step_tables.num_reqs != bt.shape[0] or t.pad_id != pattern_pad_id(step):
            return False
        if not (
            np.array_equal(np.asarray(t.block_table), bt)
            and np.array_equal(np.asarray(t.row_lengths), rl)
            and np.array_equal(np.asarray(t.slot_mapping), sm)
        ):
            return False
    return True


# -- the reader process ---------------------------------------------------------------------


def _tables_to_wire(step_tables: Any) -> tuple[Any, ...]:
    return (
        step_tables.step_seq,
        step_tables.epoch,
        step_tables.num_reqs,
        [
            (
                t.group_id,
                t.kernel_block_size,
                np.array(t.block_table),
                np.array(t.row_lengths),
                np.array(t.slot_mapping),
                t.pad_id,
            )
            for t in step_tables.tables
        ],
    )


def _tensors_to_wire(step_tensors: Any) -> tuple[Any, ...]:
    out = []
    for t in step_tensors.tables:
        out.append(
            (
                t.group_id,
                t.kernel_block_size,
                str(t.block_table.dtype),
                str(t.slot_mapping.dtype),
                str(t.block_table.device),
                t.block_table.cpu().numpy().copy(),
                t.row_lengths.cpu().numpy().copy(),
                t.slot_mapping.cpu().numpy().copy(),
            )
        )
    return (step_tensors.step_seq, step_tensors.num_reqs, out)


def _hammer(view: Any, descriptor: Any, seconds: float, copy: bool) -> dict[str, int]:
    """Read the latest step over and over for ``seconds``, verifying every byte."""
    from pagekeeper_client.ring import ReaderFellBehind, StepTimeout

    geometry = descriptor.geometry
    specs = list(geometry.tables)
    counts = {"verified": 0, "torn": 0, "fell_behind": 0, "skipped": 0, "distinct_steps": 0}
    seen_last = -1
    deadline = time.monotonic() + seconds
    # On a loaded machine one second may hold too few reads to mean anything: keep going
    # (bounded) until enough distinct steps were verified.
    hard_deadline = deadline + 15.0
    while True:
        now = time.monotonic()
        if now >= hard_deadline:
            break
        if now >= deadline and counts["verified"] >= 40 and counts["distinct_steps"] >= 20:
            break
        latest = view.latest_step()
        if latest < 0:
            time.sleep(0.0005)
            continue
        try:
            step = view.wait(latest, timeout=1.0, copy=copy)
        except ReaderFellBehind:
            counts["fell_behind"] += 1
            continue
        except StepTimeout:
            counts["skipped"] += 1
            continue
        ok = verify_step(step, specs, geometry.max_num_reqs, geometry.max_num_tokens)
        if not copy and not view.is_current(latest):
            # Zero-copy views are only promised until step + depth lands; a mismatch seen
            # after the writer moved on is the documented race, not a torn read.
            counts["skipped"] += 1
            continue
        if ok:
            counts["verified"] += 1
            if latest != seen_last:
                counts["distinct_steps"] += 1
                seen_last = latest
        else:
            counts["torn"] += 1
    stats = view.stats
    counts["busy_polls"] = stats.num_busy_polls
    counts["reader_fell_behind"] = stats.num_fell_behind
    return counts


def _tensor_storage(view: Any, step: int, timeout: float) -> dict[str, Any]:
    """Where a step's device tensors live (cuda_ipc: views of the imported ring)."""
    tensors = view.wait_tensors(step, timeout)
    table = tensors.tables[0].block_table
    return {
        "device": str(table.device),
        "storage_nbytes": table.untyped_storage().nbytes(),
        "data_ptr": table.data_ptr(),
        "is_current": view.is_current(step),
    }


def _await_latest(view: Any, step: int, timeout: float) -> int:
    """Poll until the view has seen step ``step`` (stream views receive asynchronously)."""
    deadline = time.monotonic() + timeout
    while view.latest_step() < step:
        if time.monotonic() > deadline:
            raise TimeoutError(f"step {step} never reached the view")
        time.sleep(0.0005)
    return int(view.latest_step())


def _serve(cmd_conn: Any, feed_conn: Any) -> None:  # pragma: no cover - runs in a child
    from pagekeeper_client.transports import open_table_view

    views: dict[int, Any] = {}
    descriptors: dict[int, Any] = {}
    lock = threading.Lock()

    def feeder() -> None:
        while True:
            try:
                view_id, payload = feed_conn.recv()
            except EOFError:
                return
            with lock:
                view = views.get(view_id)
            if view is None:
                continue
            if payload is None:
                view.mark_closed()
            else:
                view.feed(payload)

    threading.Thread(target=feeder, daemon=True).start()

    def open_view(view_id: int, descriptor: Any, options: dict[str, Any]) -> None:
        view = open_table_view(descriptor, **options)
        with lock:
            views[view_id] = view
            descriptors[view_id] = descriptor

    def close_view(view_id: int) -> None:
        with lock:
            view = views.pop(view_id, None)
        if view is not None:
            view.close()

    handlers: dict[str, Callable[..., Any]] = {
        "open": open_view,
        "close": close_view,
        "wait": lambda v, step, timeout, copy: _tables_to_wire(
            views[v].wait(step, timeout, copy=copy)
        ),
        "wait_tensors": lambda v, step, timeout, device=None: _tensors_to_wire(
            views[v].wait_tensors(step, timeout, device=device)
        ),
        "tensor_storage": lambda v, step, timeout: _tensor_storage(views[v], step, timeout),
        "latest_step": lambda v: views[v].latest_step(),
        "is_current": lambda v, step: views[v].is_current(step),
        "stats": lambda v: {
            "num_reads": views[v].stats.num_reads,
            "num_fell_behind": views[v].stats.num_fell_behind,
        },
        "hammer": lambda v, seconds, copy: _hammer(views[v], descriptors[v], seconds, copy),
        "await_latest": lambda v, step, timeout: _await_latest(views[v], step, timeout),
        "ping": lambda: "pong",
    }
    while True:
        try:
            command, args = cmd_conn.recv()
        except EOFError:
            return
        if command == "exit":
            return
        try:
            cmd_conn.send(("ok", handlers[command](*args)))
        except Exception as exc:
            cmd_conn.send(("err", type(exc).__name__, str(exc)))


class RemoteError(Exception):
    """An exception raised in the reader process, re-raised here as its own class when the
    class is one of the ring's errors."""


def _reraise(name: str, message: str) -> None:
    from pagekeeper_client import ring

    if name == "ReaderFellBehind":
        raise ring.ReaderFellBehind(message, step_seq=-1, found_step=-1)
    cls = getattr(ring, name, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        raise cls(message)
    if name in ("ValueError", "TimeoutError", "KeyError"):
        raise {"ValueError": ValueError, "TimeoutError": TimeoutError, "KeyError": KeyError}[name](
            message
        )
    raise RemoteError(f"{name}: {message}")


class RemoteReader:
    """A reader process: ``open(descriptor)`` then ``wait(step)`` etc., errors re-raised."""

    _next_id = 0

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self._cmd, child_cmd = ctx.Pipe()
        child_feed, self._feed = ctx.Pipe(duplex=False)
        self._process = ctx.Process(target=_serve, args=(child_cmd, child_feed), daemon=True)
        self._process.start()
        child_cmd.close()
        child_feed.close()
        self._pending = False
        self.call("ping")

    @property
    def pid(self) -> int:
        assert self._process.pid is not None
        return self._process.pid

    def call(self, command: str, *args: Any, timeout: float = 60.0) -> Any:
        self.send(command, *args)
        return self.result(timeout)

    def send(self, command: str, *args: Any) -> None:
        assert not self._pending, "a command is still running"
        self._cmd.send((command, args))
        self._pending = True

    def is_done(self) -> bool:
        """Whether the running command has answered (without taking the answer)."""
        return bool(self._cmd.poll(0))

    def result(self, timeout: float = 60.0) -> Any:
        if not self._cmd.poll(timeout):
            raise TimeoutError("the reader process did not answer")
        self._pending = False
        reply = self._cmd.recv()
        if reply[0] == "ok":
            return reply[1]
        _reraise(reply[1], reply[2])
        return None

    def open(self, descriptor: Any, **options: Any) -> int:
        RemoteReader._next_id += 1
        view_id = RemoteReader._next_id
        self.call("open", view_id, descriptor, options)
        return view_id

    def feed(self, view_id: int, payload: bytes | None) -> None:
        self._feed.send((view_id, payload))

    def shutdown(self) -> None:
        try:
            if self._pending:
                self.result(timeout=30)
            self._cmd.send(("exit", ()))
        except (OSError, EOFError, TimeoutError):
            pass
        self._process.join(10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)
