"""pagekeeper's client package: what schedulers and GPU workers import.

- Schedulers: :class:`PagekeeperClient` (sync) and :class:`AsyncPagekeeperClient`
  (``grpc.aio``) -- register, one ``step()`` per scheduling iteration, local answers for
  decodes that need no page (see :mod:`pagekeeper_client.client`).
- Workers: :func:`register_worker` -> :class:`WorkerHandle` with the chosen kernel block size
  per group and a view of the published tables as torch tensors.
- Everything else: typed results (:mod:`pagekeeper_client.types`), typed exceptions
  (:mod:`pagekeeper_client.errors`), the table ring's byte layout
  (:mod:`pagekeeper_client.ring`) and its transports.

Dependencies: grpcio, protobuf, numpy; torch only for tensor views (imported when used).
Names are imported lazily, so ``import pagekeeper_client.ring`` stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    # clients
    "PagekeeperClient": "pagekeeper_client.client",
    "AsyncPagekeeperClient": "pagekeeper_client.aio",
    "RequestView": "pagekeeper_client.client",
    "ClientTLS": "pagekeeper_client.client",
    # workers
    "register_worker": "pagekeeper_client.worker",
    "WorkerHandle": "pagekeeper_client.worker",
    "WorkerTableView": "pagekeeper_client.worker",
    "WorkerTables": "pagekeeper_client.worker",
    # types
    "Admission": "pagekeeper_client.types",
    "AllocationResult": "pagekeeper_client.types",
    "AllocationStatus": "pagekeeper_client.types",
    "BlockTable": "pagekeeper_client.types",
    "ClientRole": "pagekeeper_client.types",
    "ClientStats": "pagekeeper_client.types",
    "EventBatch": "pagekeeper_client.types",
    "ExtraKeys": "pagekeeper_client.types",
    "GroupInfo": "pagekeeper_client.types",
    "GroupKind": "pagekeeper_client.types",
    "Growth": "pagekeeper_client.types",
    "KernelBackend": "pagekeeper_client.types",
    "Limits": "pagekeeper_client.types",
    "LookupResult": "pagekeeper_client.types",
    "MultiModalKey": "pagekeeper_client.types",
    "PageRemoved": "pagekeeper_client.types",
    "PageStored": "pagekeeper_client.types",
    "AllCleared": "pagekeeper_client.types",
    "PoolConfig": "pagekeeper_client.types",
    "PoolCounters": "pagekeeper_client.types",
    "PoolInfo": "pagekeeper_client.types",
    "Registration": "pagekeeper_client.types",
    "SlotAllocation": "pagekeeper_client.types",
    "StepResult": "pagekeeper_client.types",
    # errors
    "PagekeeperError": "pagekeeper_client.errors",
    "InvalidArgumentError": "pagekeeper_client.errors",
    "NotFoundError": "pagekeeper_client.errors",
    "AlreadyExistsError": "pagekeeper_client.errors",
    "PermissionDeniedError": "pagekeeper_client.errors",
    "FailedPreconditionError": "pagekeeper_client.errors",
    "AbortedError": "pagekeeper_client.errors",
    "ResourceExhaustedError": "pagekeeper_client.errors",
    "UnauthenticatedError": "pagekeeper_client.errors",
    "UnavailableError": "pagekeeper_client.errors",
    "DeadlineExceededError": "pagekeeper_client.errors",
    "UnimplementedError": "pagekeeper_client.errors",
    "InternalError": "pagekeeper_client.errors",
    "NotRegisteredError": "pagekeeper_client.errors",
    # ring
    "RingDescriptor": "pagekeeper_client.ring",
}

__all__ = [
    "AbortedError",
    "Admission",
    "AllCleared",
    "AllocationResult",
    "AllocationStatus",
    "AlreadyExistsError",
    "AsyncPagekeeperClient",
    "BlockTable",
    "ClientRole",
    "ClientStats",
    "ClientTLS",
    "DeadlineExceededError",
    "EventBatch",
    "ExtraKeys",
    "FailedPreconditionError",
    "GroupInfo",
    "GroupKind",
    "Growth",
    "InternalError",
    "InvalidArgumentError",
    "KernelBackend",
    "Limits",
    "LookupResult",
    "MultiModalKey",
    "NotFoundError",
    "NotRegisteredError",
    "PageRemoved",
    "PageStored",
    "PagekeeperClient",
    "PagekeeperError",
    "PermissionDeniedError",
    "PoolConfig",
    "PoolCounters",
    "PoolInfo",
    "Registration",
    "RequestView",
    "ResourceExhaustedError",
    "RingDescriptor",
    "SlotAllocation",
    "StepResult",
    "UnauthenticatedError",
    "UnavailableError",
    "UnimplementedError",
    "WorkerHandle",
    "WorkerTableView",
    "WorkerTables",
    "register_worker",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pagekeeper_client' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:  # pragma: no cover - static names for type checkers and IDEs
    from pagekeeper_client.aio import AsyncPagekeeperClient
    from pagekeeper_client.client import ClientTLS, PagekeeperClient, RequestView
    from pagekeeper_client.errors import (
        AbortedError,
        AlreadyExistsError,
        DeadlineExceededError,
        FailedPreconditionError,
        InternalError,
        InvalidArgumentError,
        NotFoundError,
        NotRegisteredError,
        PagekeeperError,
        PermissionDeniedError,
        ResourceExhaustedError,
        UnauthenticatedError,
        UnavailableError,
        UnimplementedError,
    )
    from pagekeeper_client.ring import RingDescriptor
    from pagekeeper_client.types import (
        Admission,
        AllCleared,
        AllocationResult,
        AllocationStatus,
        BlockTable,
        ClientRole,
        ClientStats,
        EventBatch,
        ExtraKeys,
        GroupInfo,
        GroupKind,
        Growth,
        KernelBackend,
        Limits,
        LookupResult,
        MultiModalKey,
        PageRemoved,
        PageStored,
        PoolConfig,
        PoolCounters,
        PoolInfo,
        Registration,
        SlotAllocation,
        StepResult,
    )
    from pagekeeper_client.worker import (
        WorkerHandle,
        WorkerTables,
        WorkerTableView,
        register_worker,
    )
