"""The one interface every table transport implements (shared memory, CUDA IPC, stream).

The service calls :meth:`TablePublisher.publish` once per step with the batch's tables
(one :class:`pagekeeper.core.types.BatchTables` per group and per distinct kernel block
size that registered workers use). A worker learns where to read from the transport's
:class:`RingDescriptor`, which travels to it inside ``RegisterClientResponse`` (converted to
and from protobuf by the rpc layer; never pickled).

:class:`RingGeometry` and :class:`RingDescriptor` are defined once, next to the ring's byte
layout, in ``pagekeeper_client.ring`` (a worker reads them without the service installed);
they are re-exported here unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pagekeeper.core.types import BatchTables
from pagekeeper_client.ring import RingDescriptor, RingGeometry

__all__ = ["RingDescriptor", "RingGeometry", "TablePublisher"]


class TablePublisher(Protocol):
    """Writes published batches into a ring a worker reads."""

    def publish(self, step_seq: int, tables: Sequence[BatchTables]) -> int:
        """Write step ``step_seq``'s tables into the next slot in turn (one per published
        step, so the last ``depth`` published steps stay readable); returns the slot.
        Raises ``pagekeeper.core.errors.ResourceExhausted`` when a batch exceeds the geometry
        (nothing is written)."""
        ...

    def descriptor(self) -> RingDescriptor: ...

    def close(self) -> None:
        """Release the ring (unlink / free); readers that still map it keep their mapping."""
        ...
