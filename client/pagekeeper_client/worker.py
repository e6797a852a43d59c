"""Worker side: register with the service and read the tables it publishes for each step.

::

    handle = register_worker("127.0.0.1:50051", "cuda:0", {0: [KernelBackend("FLASH_ATTN",
                             multiple_of=(16,))]})
    handle.kernel_block_sizes          # chosen per group, e.g. (16,)
    tables = handle.view.wait(step_seq, timeout=1.0)
    t = tables.table(0)                # group 0, at this worker's kernel block size
    t.block_table                      # int32 [num_reqs, num_cols] kernel block ids
    t.row_lengths                      # int32 [num_reqs]
    t.slot_mapping                     # int64 [num_tokens]

Where the tables come from depends on the ring the service describes at registration:
shared memory (``shm``, and its GPU-less stand-in ``cpu_ipc``) is mapped into this process
and, on a GPU worker, copied to the device once per step from pinned memory without
blocking; ``cuda_ipc`` is read in place on the device; ``stream`` (a worker on another host)
arrives over ``WatchTables`` and is copied into this process's tensors. The view follows the
service when it re-creates the ring (a new generation, e.g. when a worker with other kernel
block sizes joins): a read that finds the old ring closed re-maps and retries.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from pagekeeper_client.client import PagekeeperClient, TableStream
from pagekeeper_client.errors import FailedPreconditionError, PagekeeperError, UnavailableError
from pagekeeper_client.ring import (
    DescriptorError,
    RingClosed,
    RingDescriptor,
    RingError,
    SlotFormatError,
    StepTables,
    StepTimeout,
    TorchTables,
)
from pagekeeper_client.transports import StreamTableView, TableView, open_table_view, pack_slot
from pagekeeper_client.types import BackendSpec, PoolConfig

log = logging.getLogger("pagekeeper_client.worker")

_POLL_MIN_S = 20e-6
_REOPEN_TRIES = 5
_POLL_MAX_S = 1e-3
_FOLLOW_S = 1.0
"""How often a long wait looks for a ring change or a lost registration."""
_RESUME_TRIES = 4
_RESUME_HEALTHY_S = 10.0
"""A stream that served this long before it ended does not count as a failed resume."""
_STREAM_END_WAIT_S = 1.0
_UNAVAILABLE_WAIT_S = 0.05

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class WorkerTables:
    """One published step's tables for this worker: per group, the table at the worker's
    kernel block size, as torch tensors on its device."""

    step_seq: int
    epoch: int
    num_reqs: int
    tables: tuple[TorchTables, ...]
    """Indexed by group id."""

    def table(self, group_id: int = 0) -> TorchTables:
        return self.tables[group_id]


def _check_device(device: str) -> str:
    device = device or "cpu"
    if device == "cpu":
        return device
    if not device.startswith("cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda:N', got {device!r}")
    from pagekeeper_client.transports._torch import cuda_available

    if not cuda_available():
        raise RingError(
            f"device {device!r} asked for, but torch sees no CUDA device (use device='cpu')"
        )
    return device


class WorkerTableView:
    """Reads published steps for one registered worker, across ring re-creations.

    Not thread-safe for reads: one thread (the worker's) calls :meth:`wait`.
    """

    def __init__(
        self,
        client: PagekeeperClient,
        kernel_block_sizes: Sequence[int],
        device: str,
        *,
        pin: str = "staging",
    ) -> None:
        self._client = client
        self.kernel_block_sizes = tuple(kernel_block_sizes)
        self.device = device
        self._pin = pin
        self._lock = threading.Lock()
        self._view: TableView | None = None
        self._descriptor: RingDescriptor | None = None
        self._stream: TableStream | None = None
        self._stream_thread: threading.Thread | None = None
        self._stream_error: BaseException | None = None
        self._num_resumes = 0
        """Stream resumes in a row that delivered no step and ended soon."""
        self._stream_since = client.registration.last_published_step_seq
        """Where a (re-)opened stream starts: after the last step published when this
        worker registered, then after the last one its streams delivered."""
        self._is_closed = False
        self.num_reopens = 0
        descriptor = client.ring
        if descriptor is None:
            raise RingError("the service publishes no tables for this worker (no ring)")
        try:
            self._open(descriptor)
        except DescriptorError:
            # Another worker with other kernel block sizes registered between our registration
            # and this mapping, so the service re-created the ring: open the current one.
            if not self._refresh():
                raise

    # -- opening and following the ring ---------------------------------------------------
    @property
    def descriptor(self) -> RingDescriptor:
        assert self._descriptor is not None
        return self._descriptor

    @property
    def kind(self) -> str:
        return self.descriptor.kind

    def _open(self, descriptor: RingDescriptor) -> None:
        old_view, old_stream = self._view, self._stream
        # A stream re-opened after a ring change resumes after the last step it delivered
        # (the service keeps a few recent batches), so the step that revealed the change
        # is not lost; one that delivered none, after the last step published when this
        # worker registered (never "from now": steps published while it was down would be
        # skipped).
        since = self._stream_since
        if isinstance(old_view, StreamTableView):
            since = max(old_view.latest_step(), since)
        self._stream_since = since
        view: TableView
        if descriptor.kind == "stream":
            stream_view = StreamTableView(descriptor)
            if isinstance(old_view, StreamTableView) and old_view.descriptor == descriptor:
                stream_view.carry(old_view)  # the same ring (a resumed stream): keep its steps
            view = stream_view
        else:
            view = open_table_view(descriptor, pin=self._pin)
        with self._lock:
            self._view, self._descriptor = view, descriptor
        if isinstance(view, StreamTableView):
            self._start_stream(view, since)
        for t in self._tables_needed():
            descriptor.geometry.table_index(*t)  # KeyError: the ring lacks our table
        if old_stream is not None:
            old_stream.cancel()
        if old_view is not None:
            old_view.close()

    def _tables_needed(self) -> list[tuple[int, int]]:
        return list(enumerate(self.kernel_block_sizes))

    def _start_stream(self, view: StreamTableView, since_step_seq: int) -> None:
        stream = self._client.watch_tables(since_step_seq, exact=True)
        self._stream = stream
        generation = view.descriptor.generation

        def consume() -> None:
            opened = time.monotonic()
            try:
                for item in stream:
                    step = item.tables
                    if step.epoch < generation:
                        continue  # published under the previous ring
                    if step.epoch > generation:
                        # The ring was re-created: end this view; the reader re-maps.
                        log.info(
                            "WatchTables: ring generation %d follows %d", step.epoch, generation
                        )
                        break
                    try:
                        view.feed(pack_slot(step.step_seq, step.epoch, step.tables))
                    except SlotFormatError as exc:
                        log.error("WatchTables: %s", exc)
                        break
                    self._num_resumes = 0
            except PagekeeperError as exc:
                self._stream_error = exc
                if time.monotonic() - opened >= _RESUME_HEALTHY_S:
                    # It served a while (an idle stream a proxy cut): not a refused resume.
                    self._num_resumes = 0
            finally:
                view.mark_closed()

        thread = threading.Thread(target=consume, name="pagekeeper-watch-tables", daemon=True)
        self._stream_thread = thread
        thread.start()

    def _refresh(self) -> bool:
        """Ask the service for the current ring; re-open if it changed. Returns whether a
        new ring was opened. A ring replaced again before it could be opened (workers
        joining one after another) is asked for again, a few times."""
        for attempt in range(_REOPEN_TRIES):
            try:
                self._client.heartbeat()
            except FailedPreconditionError:
                self._client.reregister()
            except UnavailableError:
                # The connection was just reset (what may have ended a stream): the channel
                # reconnects; a service that stays away is the caller's error.
                if attempt == _REOPEN_TRIES - 1:
                    raise
                time.sleep(_UNAVAILABLE_WAIT_S * 2**attempt)
                continue
            descriptor = self._client.ring
            if descriptor is None:
                raise RingClosed("the service no longer publishes tables for this worker")
            if descriptor == self._descriptor:
                return self._resume_stream()
            try:
                self._reopen(descriptor)
                return True
            except (RingClosed, DescriptorError):
                if attempt == _REOPEN_TRIES - 1:
                    raise
                time.sleep(_POLL_MIN_S * 2**attempt)
        raise AssertionError("unreachable")

    def _refresh_or_closed(self, closed: RingError) -> bool:
        """:meth:`_refresh` after the view found its ring ``closed``; a service that cannot
        be asked (it stopped) makes that :class:`RingClosed`, a ring error as the read's."""
        try:
            return self._refresh()
        except PagekeeperError as unreachable:
            raise RingClosed(
                f"{closed}; the service could not say which ring follows: {unreachable}"
            ) from unreachable

    def _resume_stream(self) -> bool:
        """The ``WatchTables`` stream of an unchanged ring ended (a network blip, the
        connection reset): open it again after the last step it delivered, keeping the steps
        held. Not after :data:`_RESUME_TRIES` resumes in a row that delivered nothing (the
        service refuses the stream): the caller gets :class:`RingClosed`."""
        thread = self._stream_thread
        view = self._view
        if thread is not None and (
            self._stream_error is not None or (isinstance(view, StreamTableView) and view.has_ended)
        ):
            # The stream's thread records the error and marks the view closed as it ends:
            # let it end, rather than take a thread about to end for one still serving
            # (a stream still serving is not waited for).
            thread.join(timeout=_STREAM_END_WAIT_S)
        if (
            not isinstance(self._view, StreamTableView)
            or thread is None
            or thread.is_alive()
            or self._is_closed
            or self._num_resumes >= _RESUME_TRIES
        ):
            return False
        time.sleep(_POLL_MAX_S * 10 * 2**self._num_resumes)
        self._num_resumes += 1
        log.info(
            "WatchTables ended (%s); resuming after step %d",
            self._stream_error,
            self._view.latest_step(),
        )
        self._stream_error = None
        self._reopen(self.descriptor)
        return True

    def _follow(self) -> bool:
        """Re-open when the client last heard of another ring than the mapped one (its
        lease renewal brings the service's current descriptor): one the service re-created,
        or a restarted service's, whose predecessor never closed the old one. Returns
        whether it did."""
        descriptor = self._client.ring
        if descriptor is None or descriptor == self._descriptor or self._is_closed:
            return False
        try:
            self._reopen(descriptor)
        except (RingClosed, DescriptorError):
            # Re-created again since the client heard of it: ask for the current one.
            return self._refresh()
        return True

    def _reopen(self, descriptor: RingDescriptor) -> None:
        log.info(
            "ring generation %d -> %d (%s)",
            self._descriptor.generation if self._descriptor else 0,
            descriptor.generation,
            descriptor.kind,
        )
        self._open(descriptor)
        self.num_reopens += 1

    def _current(self) -> TableView:
        if self._is_closed:
            raise RingError("this worker's table view is closed")
        view = self._view
        assert view is not None
        return view

    # -- reading --------------------------------------------------------------------------
    def wait(self, step_seq: int, timeout: float | None = None) -> WorkerTables:
        """Block until step ``step_seq`` is published; return this worker's tables as
        tensors on its device (CPU: tensors the caller owns; GPU: device buffers reused
        ``depth`` published steps later). Raises :class:`~pagekeeper_client.ring.StepTimeout`,
        :class:`~pagekeeper_client.ring.ReaderFellBehind`, and
        :class:`~pagekeeper_client.ring.RingClosed` when no step will come (the service
        closed the ring and cannot be reached, or no longer knows this worker)."""

        def read(view: TableView, remaining: float | None) -> WorkerTables:
            if self.device == "cpu":
                step = view.wait_tensors(step_seq, remaining)
            else:
                step = view.wait_tensors(step_seq, remaining, device=self.device)
            tables = tuple(step.table(g, k) for g, k in enumerate(self.kernel_block_sizes))
            return WorkerTables(step.step_seq, step.epoch, step.num_reqs, tables)

        return self._wait_step(timeout, read)

    def wait_arrays(
        self, step_seq: int, timeout: float | None = None, *, copy: bool = True
    ) -> StepTables:
        """Step ``step_seq``'s tables as numpy arrays (every table the ring holds); raises
        as :meth:`wait`."""
        return self._wait_step(
            timeout, lambda view, remaining: view.wait(step_seq, remaining, copy=copy)
        )

    def _wait_step(self, timeout: float | None, read: Callable[[TableView, float | None], T]) -> T:
        """``read(view, seconds)`` across ring changes. A long wait (or one without a
        timeout) looks up every :data:`_FOLLOW_S` whether the client heard of another ring
        (a restarted service's: a killed one never marks its ring closed) or lost its
        registration, so it does not wait on a ring no one writes."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            view = self._current()
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            chunk = _FOLLOW_S if remaining is None else min(remaining, _FOLLOW_S)
            try:
                return read(view, chunk)
            except (RingClosed, DescriptorError) as exc:
                if not self._refresh_or_closed(exc):
                    raise
            except StepTimeout as exc:
                if self._follow():
                    continue
                if deadline is not None and time.monotonic() >= deadline:
                    if timeout is not None and timeout > chunk:
                        raise StepTimeout(f"{exc} (after {timeout:g}s of waiting in all)") from None
                    raise
                lost = self._client.registration_lost
                if lost is not None:
                    raise RingClosed(
                        f"the service no longer publishes for this worker: {lost}"
                    ) from None

    def latest_step(self) -> int:
        """The last step published to the ring (-1 before the first), following the
        service to a new ring as :meth:`wait` does."""
        self._follow()
        view = self._current()
        try:
            return view.latest_step()
        except (RingClosed, DescriptorError) as exc:
            self._refresh_or_closed(exc)
            return self._current().latest_step()

    def wait_next(self, after: int, timeout: float | None = None) -> int:
        """Block until a step later than ``after`` is published; return the latest one.
        (A worker that follows published steps without knowing their ids calls this, then
        :meth:`wait`.)"""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = _POLL_MIN_S
        while True:
            latest = self.latest_step()
            if latest > after:
                return latest
            if self._stream_error is not None and not self._resume_stream():
                raise self._stream_error
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise StepTimeout(f"no step after {after} was published within {timeout}s")
            time.sleep(delay if deadline is None else min(delay, deadline - now))
            delay = min(delay * 2, _POLL_MAX_S)

    def close(self) -> None:
        if self._is_closed:
            return
        self._is_closed = True
        if self._stream is not None:
            self._stream.cancel()
        if self._view is not None:
            self._view.close()
        if self._stream_thread is not None:
            self._stream_thread.join(timeout=5)


@dataclass(eq=False)
class WorkerHandle:
    """A registered worker: its client (lease renewed in the background), the chosen kernel
    block size per group and its table view."""

    client: PagekeeperClient
    kernel_block_sizes: tuple[int, ...]
    view: WorkerTableView
    device: str

    @property
    def pool(self) -> PoolConfig:
        return self.client.pool

    @property
    def client_id(self) -> str:
        return self.client.client_id

    def wait(self, step_seq: int, timeout: float | None = None) -> WorkerTables:
        return self.view.wait(step_seq, timeout)

    def close(self) -> None:
        """Close the view and unregister."""
        self.view.close()
        self.client.close()

    def __enter__(self) -> WorkerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def register_worker(
    address: str | None = None,
    device: str = "cpu",
    backends_per_group: (
        Mapping[int, Sequence[BackendSpec]] | Sequence[Sequence[BackendSpec]] | None
    ) = None,
    *,
    token: str | None = None,
    name: str = "",
    lease_ttl: float | None = None,
    pin: str = "staging",
    client: PagekeeperClient | None = None,
    fresh_kv_cache: bool = True,
    **client_options: Any,
) -> WorkerHandle:
    """Register a worker and open its table view.

    ``backends_per_group``: per group id, the attention backends its layers use, each a
    :class:`~pagekeeper_client.types.KernelBackend`, an exact size or a list of sizes (a
    group left out accepts any size and gets its page size). The service chooses one kernel
    block size per group that every backend supports (:class:`FailedPreconditionError`,
    with the service's reason, when none does). ``device``: "cpu" or "cuda:N" (checked:
    torch must see CUDA). ``pin``: how a shm ring reaches a GPU ("staging" or "register").
    ``fresh_kv_cache``: this worker's KV cache holds nothing yet (it just started), so the
    service forgets the prefix cache (whose pages' KV another process wrote, or one that
    died) and frees and revokes the running requests (whose KV is not here either: their
    schedulers compute them again); pass False for a worker whose KV cache outlived its
    registration, or one that only reads tables.
    """
    device = _check_device(device)
    own = client is None
    if client is None:
        client = PagekeeperClient(address, token=token, **client_options)
    try:
        registration = client.register(
            "worker",
            name=name,
            lease_ttl=lease_ttl,
            device=device,
            kernel_support=backends_per_group,
            fresh_kv_cache=fresh_kv_cache,
        )
        view = WorkerTableView(client, registration.kernel_block_sizes, device, pin=pin)
    except BaseException:
        if own:
            client.close()
        raise
    return WorkerHandle(client, registration.kernel_block_sizes, view, device)


__all__ = ["WorkerHandle", "WorkerTableView", "WorkerTables", "register_worker"]
