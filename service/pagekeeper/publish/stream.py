"""Stream publisher: each step packed into bytes for the ``WatchTables`` gRPC stream.

It keeps the last ``depth`` packed steps (the same window the rings keep) and hands new ones
to listeners; the rpc layer's servicer subscribes (``add_listener``, or ``wait_message`` from
a thread) and sends the bytes as they are. The bytes format is ``pack_slot``'s
(``pagekeeper_client.transports.stream``), which a remote worker decodes with
``unpack_slot`` / ``StreamTableView.feed``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from pagekeeper.core.errors import FailedPrecondition
from pagekeeper.core.types import BatchTables
from pagekeeper.publish._ring import RingWriter
from pagekeeper_client.ring import RingDescriptor, RingGeometry
from pagekeeper_client.transports.stream import pack_slot

Listener = Callable[[int, bytes], None]


class StreamPublisher(RingWriter):
    """Packs each published step; holds the last ``depth`` of them for streaming."""

    kind = "stream"

    def __init__(self, geometry: RingGeometry, *, generation: int | None = None) -> None:
        super().__init__(geometry, generation)
        self._messages: list[tuple[int, bytes] | None] = [None] * self._depth
        """The last ``depth`` published steps, in slots taken in turn (as the rings)."""
        self._cond = threading.Condition(self._lock)
        self._listeners: list[Listener] = []

    def publish(self, step_seq: int, tables: Sequence[BatchTables]) -> int:
        """Pack step ``step_seq`` (validated exactly as the rings validate) and notify
        listeners (called outside the lock, in this thread)."""
        with self._cond:
            _num_reqs, checked = self.check_batch(step_seq, tables)
            payload = pack_slot(step_seq, self._generation, [c.tables for c in checked])
            slot = self._next_slot
            self._messages[slot] = (step_seq, payload)
            self._last_step = step_seq
            self._next_slot = (slot + 1) % self._depth
            listeners = list(self._listeners)
            self._cond.notify_all()
        for listener in listeners:
            listener(step_seq, payload)
        return slot

    def message(self, step_seq: int) -> bytes | None:
        """The packed bytes of step ``step_seq`` while it is among the last ``depth``."""
        with self._cond:
            for held in self._messages:
                if held is not None and held[0] == step_seq:
                    return held[1]
            return None

    def wait_message(
        self, after_step: int, timeout: float | None = None
    ) -> tuple[int, bytes] | None:
        """The oldest held step later than ``after_step`` (waiting for one up to
        ``timeout``); ``None`` on timeout. Raises ``FailedPrecondition`` once closed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self._is_closed:
                    raise FailedPrecondition("stream publisher is closed")
                newer = [m for m in self._messages if m is not None and m[0] > after_step]
                if newer:
                    return min(newer, key=lambda m: m[0])
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(remaining)

    def add_listener(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(step_seq, payload)`` after every publish; returns an unsubscribe.
        Listeners must be quick (e.g. ``loop.call_soon_threadsafe(queue.put_nowait, ...)``)."""
        with self._cond:
            self._listeners.append(listener)

        def remove() -> None:
            with self._cond:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return remove

    def descriptor(self) -> RingDescriptor:
        return RingDescriptor(
            kind=self.kind,
            generation=self._generation,
            geometry=self._geometry,
            size_bytes=0,
        )

    def close(self) -> None:
        with self._cond:
            self._is_closed = True
            self._messages = [None] * self._depth
            self._listeners = []
            self._cond.notify_all()

    def __enter__(self) -> StreamPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
