"""Helpers for the client tests: call-counting and fault-injecting gRPC interceptors."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from typing import Any

import grpc
import grpc.aio
import numpy as np


class CountingInterceptor(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Counts every unary call that leaves the client, by method name."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        self.calls[details.method.rsplit("/", 1)[-1]] += 1
        return continuation(details, request)

    @property
    def total(self) -> int:
        return sum(self.calls.values())


class AsyncCountingInterceptor(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """The ``grpc.aio`` twin of :class:`CountingInterceptor`."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        name = details.method
        name = name.decode() if isinstance(name, bytes) else name
        self.calls[name.rsplit("/", 1)[-1]] += 1
        return await continuation(details, request)

    @property
    def total(self) -> int:
        return sum(self.calls.values())


class _FailedCall(grpc.RpcError, grpc.Call, grpc.Future):  # type: ignore[misc]
    """What a call that failed with ``code`` looks like to the channel."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def result(self, timeout: float | None = None) -> Any:
        raise self

    def exception(self, timeout: float | None = None) -> Any:
        return self

    def traceback(self, timeout: float | None = None) -> Any:
        return None

    def initial_metadata(self) -> Any:
        return ()

    def trailing_metadata(self) -> Any:
        return ()

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> Any:
        return None

    def cancel(self) -> bool:
        return False

    def cancelled(self) -> bool:
        return False

    def running(self) -> bool:
        return False

    def done(self) -> bool:
        return True

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        fn(self)

    def add_callback(self, callback: Any) -> bool:
        return False


class DropStepReplies(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Make the next ``drops`` Step calls fail with ``code`` (UNAVAILABLE); with
    ``deliver=True`` the request still reaches the service (the reply is what gets lost)."""

    def __init__(self) -> None:
        self.drops = 0
        self.deliver = True
        self.code = grpc.StatusCode.UNAVAILABLE
        self.step_ids: list[int] = []

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        if not details.method.endswith("/Step"):
            return continuation(details, request)
        self.step_ids.append(request.step_id)
        if self.drops <= 0:
            return continuation(details, request)
        self.drops -= 1
        if self.deliver:
            continuation(details, request).result()
        return _FailedCall(self.code, "injected: no answer")


class LeaseFaults(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Heartbeats fail UNAVAILABLE while ``block_heartbeats``; the next ``lose_registers``
    RegisterClient calls reach the service and their replies are lost (DEADLINE_EXCEEDED)."""

    def __init__(self) -> None:
        self.block_heartbeats = False
        self.lose_registers = 0

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        method = details.method
        if method.endswith("/Heartbeat") and self.block_heartbeats:
            return _FailedCall(grpc.StatusCode.UNAVAILABLE, "injected: network down")
        if method.endswith("/RegisterClient") and self.lose_registers > 0:
            self.lose_registers -= 1
            continuation(details, request).result()
            return _FailedCall(grpc.StatusCode.DEADLINE_EXCEEDED, "injected: no answer")
        return continuation(details, request)


class SlowSteps(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Every Step waits ``delay`` seconds before it is sent (so others queue behind it)."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.step_ids: list[int] = []

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        name = details.method
        name = name.decode() if isinstance(name, bytes) else name
        if name.endswith("/Step"):
            self.step_ids.append(request.step_id)
            await asyncio.sleep(self.delay)
        return await continuation(details, request)


class CancelStepAfterDelivery(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """The ``grpc.aio`` fault: the next ``drops`` Step calls reach the service (``deliver``)
    and then the calling task is cancelled before it reads the answer."""

    def __init__(self) -> None:
        self.drops = 0
        self.deliver = True
        self.step_ids: list[int] = []

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        name = details.method
        name = name.decode() if isinstance(name, bytes) else name
        if not name.endswith("/Step"):
            return await continuation(details, request)
        self.step_ids.append(request.step_id)
        if self.drops <= 0:
            return await continuation(details, request)
        self.drops -= 1
        if self.deliver:
            await (await continuation(details, request))
        raise asyncio.CancelledError()


def tokens(seed: int, n: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(1, 50_000, n)]


class HeartbeatsDownUntilAStep(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """While ``down``, heartbeats fail UNAVAILABLE (the lease runs out unrenewed); the first
    Step that then goes out brings them back once it has its answer, so the step is the
    first to learn that the lease ran out (not the lease renewal on its own)."""

    def __init__(self) -> None:
        self.down = False
        self.step_codes: list[grpc.StatusCode] = []

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        method = details.method
        if method.endswith("/Heartbeat") and self.down:
            return _FailedCall(grpc.StatusCode.UNAVAILABLE, "injected: network down")
        if not method.endswith("/Step"):
            return continuation(details, request)
        call = continuation(details, request)
        exc = call.exception()
        self.step_codes.append(grpc.StatusCode.OK if exc is None else exc.code())
        self.down = False
        return call


class AsyncHeartbeatsDownUntilAStep(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """:class:`HeartbeatsDownUntilAStep` for ``grpc.aio``."""

    def __init__(self) -> None:
        self.down = False
        self.step_codes: list[grpc.StatusCode] = []

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        name = details.method
        name = name.decode() if isinstance(name, bytes) else name
        if name.endswith("/Heartbeat") and self.down:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(),
                details="injected: network down",
            )
        if not name.endswith("/Step"):
            return await continuation(details, request)
        call = await continuation(details, request)
        self.step_codes.append(await call.code())
        self.down = False
        return call
