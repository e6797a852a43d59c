"""The publication hub: the service's side of table publication.

It is the :class:`pagekeeper.state.TableSink` the state publishes into. It owns the
transport's :class:`~pagekeeper.publish.api.TablePublisher` (a shared-memory or CUDA IPC
ring), creates it when the first worker registers, re-creates it (a new generation) when the
set of published (group, kernel block size) tables changes and releases it when the last
worker leaves. Every published batch is also kept briefly for ``WatchTables`` streams
(workers on another host), whatever the transport.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagekeeper.core.config import PoolConfig
from pagekeeper.core.errors import ConfigError
from pagekeeper.core.types import BatchTables
from pagekeeper.notify import ChangeNotifier
from pagekeeper.publish.api import RingDescriptor, RingGeometry, TablePublisher

log = logging.getLogger(__name__)

PublisherFactory = Callable[[str, RingGeometry], TablePublisher]
"""``(kind, geometry) -> publisher``; kind is "shm", "cpu_ipc" or "cuda_ipc". The publisher
picks its generation (unique across restarts, so a worker never confuses two rings)."""

STREAM_KIND = "stream"


@dataclass(frozen=True, slots=True)
class PublishedBatch:
    step_seq: int
    epoch: int
    tables: tuple[BatchTables, ...]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def resolve_publisher_factory(transport: str, device: str = "") -> PublisherFactory | None:
    """The factory of a configured transport; None for "none" (WatchTables stream only)."""
    if transport == "none":
        return None
    from pagekeeper.publish import PUBLISHER_KINDS, create_publisher

    if transport not in PUBLISHER_KINDS:
        raise ConfigError("publish.transport", f"unknown transport {transport!r}")

    def factory(kind: str, geometry: RingGeometry) -> TablePublisher:
        if kind == "cuda_ipc":
            return create_publisher(kind, geometry, device=device)
        return create_publisher(kind, geometry)

    return factory


class PublicationHub:
    """Ring lifecycle + recent batches for streams. Synchronous: called inside a step."""

    def __init__(
        self,
        pool: PoolConfig,
        *,
        transport: str,
        depth: int,
        max_num_reqs: int,
        max_num_tokens: int,
        factory: PublisherFactory | None,
        keep: int = 8,
    ) -> None:
        self.pool = pool
        self.transport = transport
        self.depth = depth
        self.max_num_reqs = max_num_reqs
        self.max_num_tokens = max_num_tokens
        self._factory = factory
        self._publisher: TablePublisher | None = None
        self._descriptor: RingDescriptor | None = None
        self._generation = 0
        self._recent: deque[PublishedBatch] = deque(maxlen=max(keep, depth))
        self._last_dropped_step_seq = 0
        self.notifier = ChangeNotifier()

    def geometry(self, tables: tuple[tuple[int, int], ...]) -> RingGeometry:
        rows = []
        for group_id, kbs in tables:
            page_size = self.pool.groups[group_id].page_size
            max_pages = _cdiv(self.pool.max_model_len, page_size)
            rows.append((group_id, kbs, max_pages * (page_size // kbs)))
        return RingGeometry(
            depth=self.depth,
            max_num_reqs=self.max_num_reqs,
            max_num_tokens=self.max_num_tokens,
            tables=tuple(rows),
        )

    # -- TableSink ---------------------------------------------------------------------
    def configure(self, tables: tuple[tuple[int, int], ...]) -> RingDescriptor | None:
        if not tables:
            self.close()
            return None
        geometry = self.geometry(tables)
        if self._factory is None:
            new_publisher = None
            # Like the rings' generations: unique across restarts of the service.
            generation = max(time.time_ns(), self._generation + 1)
            descriptor = RingDescriptor(
                kind=STREAM_KIND, generation=generation, geometry=geometry, size_bytes=0
            )
        else:
            # Create the new ring before closing the old one: a failure keeps the old.
            new_publisher = self._factory(self.transport, geometry)
            descriptor = new_publisher.descriptor()
            generation = descriptor.generation
        self.close()
        self._publisher, self._descriptor, self._generation = new_publisher, descriptor, generation
        log.info(
            "publication ring generation %d: %s tables %s",
            generation,
            descriptor.kind,
            [(g, k) for g, k, _ in geometry.tables],
        )
        return descriptor

    def descriptor(self) -> RingDescriptor | None:
        return self._descriptor

    def publish(self, step_seq: int, tables: Sequence[BatchTables]) -> int:
        slot = -1
        if self._publisher is not None:
            slot = self._publisher.publish(step_seq, tables)
        if len(self._recent) == self._recent.maxlen:
            self._last_dropped_step_seq = self._recent[0].step_seq
        self._recent.append(PublishedBatch(step_seq, self._generation, tuple(tables)))
        self.notifier.notify()
        return slot

    # -- streams -----------------------------------------------------------------------
    def batches_after(self, step_seq: int) -> tuple[list[PublishedBatch], bool]:
        """Kept batches with a larger step_seq, and whether one after ``step_seq`` was
        already dropped (the reader fell behind)."""
        newer = [b for b in self._recent if b.step_seq > step_seq]
        return newer, step_seq < self._last_dropped_step_seq

    @property
    def last_step_seq(self) -> int:
        return self._recent[-1].step_seq if self._recent else 0

    def close(self) -> None:
        publisher, self._publisher, self._descriptor = self._publisher, None, None
        if publisher is not None:
            publisher.close()
