"""The asyncio twin of :class:`~pagekeeper_client.client.PagekeeperClient` (``grpc.aio``).

Same method names, same semantics, awaited::

    async with AsyncPagekeeperClient("127.0.0.1:50051") as client:
        await client.register("scheduler")
        await client.admit("r1", prompt_ids)
        got = await client.allocate_slots("r1", 1, new_token_ids=[tok])   # local: no call
        await client.step(batch=["r1"])

The lease is renewed by a background task (stopped by :meth:`close`). The scheduling API
(``admit``, ``allocate_slots``, ``free_later``, ``step``) is meant for one task; steps are
serialised by a lock so two tasks can never send overlapping queues.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import grpc
import grpc.aio

from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2 as pb
from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2_grpc as pb_grpc
from pagekeeper_client.client import (
    _LOCAL_METHODS,
    _LOCAL_RETRY_S,
    _RESPONSES,
    _RETRY_CODES,
    SchedulerState,
    _check_int32,
    _ClientCore,
    _role,
    block_table_from_pb,
    counters_from_pb,
    default_client_name,
    encode_i32,
    event_batch_from_pb,
    limits_from_pb,
    local_ticket,
    lookup_from_pb,
    pool_from_pb,
    put_page_hashes,
    register_request,
    registration_from_pb,
    resend_was_refused,
    ring_from_pb,
    step_was_refused,
)
from pagekeeper_client.errors import (
    AbortedError,
    AlreadyExistsError,
    DeadlineExceededError,
    FailedPreconditionError,
    NotFoundError,
    NotRegisteredError,
    PagekeeperError,
    UnauthenticatedError,
    UnavailableError,
    error_from_rpc,
)
from pagekeeper_client.extra_keys import extra_keys_to_pb
from pagekeeper_client.local import AsyncLocalChannel
from pagekeeper_client.types import (
    Admission,
    AllocationResult,
    AllocationStatus,
    BackendSpec,
    BlockTable,
    ClientRole,
    EventBatch,
    ExtraKeys,
    Growth,
    LookupResult,
    PoolInfo,
    Registration,
    SlotAllocation,
    StepResult,
    TokenIds,
)

log = logging.getLogger("pagekeeper_client")


class AsyncEventStream:
    """A ``WatchEvents`` subscription: ``async for batch in stream``; ``cancel()`` ends it."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self._is_cancelled = False

    async def __aiter__(self) -> AsyncIterator[EventBatch]:
        try:
            async for msg in self._call:
                yield event_batch_from_pb(msg)
        except grpc.RpcError as exc:
            if self._is_cancelled and exc.code() == grpc.StatusCode.CANCELLED:
                return
            raise error_from_rpc(exc, "WatchEvents") from None
        except asyncio.CancelledError:
            if self._is_cancelled:
                return
            raise

    def cancel(self) -> None:
        self._is_cancelled = True
        self._call.cancel()

    async def __aenter__(self) -> AsyncEventStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()


class AsyncPagekeeperClient(_ClientCore[AsyncLocalChannel]):
    """Asyncio client of a pagekeeper service; see :class:`PagekeeperClient` for every
    method's contract (the names and arguments are the same, the calls are awaited),
    ``local_socket`` included (the same-node socket, over asyncio streams)."""

    def _open_channel(self, options: list[tuple[str, Any]], interceptors: Sequence[Any]) -> None:
        if self.tls is None:
            self._channel = grpc.aio.insecure_channel(
                self.address, options=options, interceptors=list(interceptors) or None
            )
        else:
            self._channel = grpc.aio.secure_channel(
                self.address,
                self.tls.credentials(),
                options=options,
                interceptors=list(interceptors) or None,
            )
        self._stub = pb_grpc.PagekeeperServiceStub(self._channel)  # type: ignore[no-untyped-call]
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._step_lock = asyncio.Lock()
        self._wake = asyncio.Event()
        """Ends the lease renewal's wait early: a step asking for a renewal."""

    # -- the same-node socket -------------------------------------------------------------
    async def _connect_local(self, *, required: bool) -> None:
        path = self._local_path
        if not path or self._is_closed:
            return
        try:
            channel = await AsyncLocalChannel.connect(
                path,
                token=self._token,
                timeout=self.timeout,
                max_message_bytes=self._max_message_bytes,
                ticket=local_ticket(self._registration),
            )
        except PagekeeperError as exc:
            if required:
                raise
            log.info("staying on gRPC: %s", exc)
            self._local_retry_at = time.monotonic() + _LOCAL_RETRY_S
            return
        old, self._local = self._local, channel
        if old is not None:
            old.close()

    async def _local_channel(self, method: str) -> AsyncLocalChannel | None:
        if method not in _LOCAL_METHODS:
            return None
        local = self._local
        if local is not None and local.is_open:
            return local
        if self._local_path and time.monotonic() >= self._local_retry_at:
            await self._connect_local(required=False)  # a failure sets the next try's time
            local = self._local
            if local is not None and local.is_open:
                return local
        return None

    # -- plumbing -----------------------------------------------------------------------
    async def _call(self, method: str, request: Any) -> Any:
        used = self._token
        try:
            return await self._call_once(method, request)
        except UnauthenticatedError:
            if not self._reread_token(used):
                raise
        return await self._call_once(method, request)

    async def _call_once(self, method: str, request: Any) -> Any:
        self._check_open(method)
        stats = self.stats
        stats.num_rpcs += 1
        stats.by_method[method] = stats.by_method.get(method, 0) + 1
        local = await self._local_channel(method)
        if local is not None:
            stats.num_local_calls += 1
            try:
                return await local.call(method, request, _RESPONSES[method], self.timeout)
            except UnavailableError:
                if self._local is local:
                    raise
                # Swapped under this call (a new token): these reads are safe to send again.
                return await self._call_once(method, request)
        try:
            return await getattr(self._stub, method)(
                request, metadata=self._metadata, timeout=self.timeout
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, method) from None

    async def register(
        self,
        role: ClientRole | str = ClientRole.SCHEDULER,
        *,
        name: str = "",
        lease_ttl: float | None = None,
        device: str = "",
        kernel_support: (
            Mapping[int, Sequence[BackendSpec]] | Sequence[Sequence[BackendSpec]] | None
        ) = None,
        client_id: str = "",
        renew: bool = True,
        fresh_kv_cache: bool = False,
    ) -> Registration:
        """See :meth:`PagekeeperClient.register`; the lease is renewed by a task."""
        role = _role(role)
        if self._forgotten is not None:
            self._drop_forgotten()  # forgotten by the service: register anew
        if self._registration is not None:
            raise AlreadyExistsError(f"already registered as {self._registration.client_id}")
        args: dict[str, Any] = {
            "name": name or default_client_name(role),
            "lease_ttl": lease_ttl,
            "device": device,
            "kernel_support": kernel_support,
        }
        request = register_request(role, client_id=client_id, fresh_kv_cache=fresh_kv_cache, **args)
        if self._local_mode not in (None, "auto"):
            await self._connect_local(required=True)  # a named socket: before registering
        registration = registration_from_pb(await self._call("RegisterClient", request))
        self._register_args = args
        self._role = role
        self._accept_registration(registration)
        if role is ClientRole.SCHEDULER:
            self._state = SchedulerState(registration.pool, hold_decodes=self.hold_decodes)
        if self._local_mode == "auto":
            self._local_path = registration.local_socket
            await self._connect_local(required=False)
        elif registration.local_ticket and self._local is not None:
            # A named socket opened before registering: reopen it with the ticket a
            # registration bound to a certificate needs there.
            await self._connect_local(required=True)
        await self._adopt(registration)
        if renew:
            await self._stop_heartbeat()  # a loop of an earlier registration
            self._lease_epoch += 1
            self._heartbeat_task = asyncio.create_task(
                self._heartbeat_loop(self._lease_epoch), name="pagekeeper-lease"
            )
        return registration

    async def _adopt(self, registration: Registration) -> None:
        """See :meth:`PagekeeperClient._adopt`."""
        state = self._state
        if state is None or not registration.request_ids:
            return
        groups = range(len(registration.pool.groups))
        for request_id in state.to_adopt(registration.request_ids):
            try:
                tables = [await self.block_table(request_id, g) for g in groups]
            except NotFoundError:
                continue  # freed meanwhile (an admin's force-free)
            state.adopt(request_id, tables)

    async def heartbeat(self) -> float:
        registration = self._require()
        reply = await self._call(
            "Heartbeat",
            pb.HeartbeatRequest(
                client_id=registration.client_id,
                generation=registration.generation,
                state_id=registration.state_id,
            ),
        )
        self.stats.num_heartbeats += 1
        self._last_renewal = time.monotonic()
        if reply.HasField("ring"):
            self._set_ring(ring_from_pb(reply.ring))
        elif self._role is ClientRole.WORKER:
            self._set_ring(None)
        return float(reply.lease_ttl_ms) / 1000.0

    async def reregister(self) -> Registration:
        registration = self._require()
        assert self._role is not None
        request = register_request(
            self._role, client_id=registration.client_id, **self._register_args
        )
        fresh = registration_from_pb(await self._call("RegisterClient", request))
        self._accept_registration(fresh)
        await self._adopt(fresh)
        if self._local_mode == "auto" and fresh.local_socket != self._local_path:
            self._local_path = fresh.local_socket
            await self._connect_local(required=False)
        elif fresh.local_ticket != registration.local_ticket and self._local is not None:
            await self._connect_local(required=self._local_mode != "auto")
        self.stats.num_reregistrations += 1
        return fresh

    async def _heartbeat_loop(self, epoch: int) -> None:
        """See :meth:`PagekeeperClient._heartbeat_loop`."""
        must_register = False
        while not self._is_closed:
            registration = self._registration
            if registration is None or epoch != self._lease_epoch:
                return
            period = max(registration.lease_ttl_s / 3.0, 0.05)
            wait = self._last_renewal + period - time.monotonic()
            if wait > 0 and not must_register and self._renew_asked == self._renew_served:
                await self._lease_sleep(wait)
                continue
            self._wake.clear()
            ticket = self._renew_asked
            alive = False
            backoff = 0.0
            try:
                if must_register:
                    await self.reregister()
                    must_register = False
                else:
                    await self.heartbeat()
                self.lease_error = None
                alive = True
            except NotRegisteredError:
                return
            except (NotFoundError, AbortedError) as exc:
                # See PagekeeperClient._heartbeat_loop: forgotten, or taken over.
                if isinstance(exc, AbortedError) and self._generation_moved(registration):
                    continue
                if not self._is_closed:
                    self.lease_error = exc
                    log.error("lease renewal stopped: %s", exc)
                    if not isinstance(exc, AbortedError):
                        self._forget_if_gone(exc)
                return
            except FailedPreconditionError as exc:
                log.warning("lease lost (%s); registering again", exc.reason)
                try:
                    await self.reregister()
                    self.lease_error = None
                    alive = True
                except PagekeeperError as again:
                    self.lease_error = again
                    must_register = not step_was_refused(again)  # see the sync loop
                    backoff = min(period, 1.0)
            except PagekeeperError as exc:
                if self._is_closed:
                    return
                self.lease_error = exc
                log.warning("lease renewal failed: %s", exc)
                backoff = min(period, 1.0)
            finally:
                self._lease_alive = alive
                self._renew_served = ticket
            if backoff:
                await self._lease_sleep(backoff)

    async def _lease_sleep(self, seconds: float) -> None:
        """The lease renewal's wait: ``seconds``, or until a step asks for a renewal."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wake.wait(), seconds)
        self._wake.clear()

    async def _lease_renewed(self, generation: int, deadline: float) -> bool:
        """See :meth:`PagekeeperClient._lease_renewed`."""
        task = self._heartbeat_task
        if task is None or task.done():
            return False
        self._renew_asked += 1
        ticket = self._renew_asked
        self._wake.set()
        while time.monotonic() < deadline:
            registration = self._registration
            if registration is None or self._is_closed:
                return False
            if registration.generation != generation:
                return True
            if self._renew_served >= ticket:
                return self._lease_alive
            if task.done():
                return False
            await asyncio.sleep(0.005)
        return False

    async def _stop_heartbeat(self) -> None:
        task, self._heartbeat_task = self._heartbeat_task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def unregister(self) -> int:
        registration = self._require()
        await self._stop_heartbeat()
        reply = await self._call(
            "Unregister",
            pb.UnregisterRequest(
                client_id=registration.client_id,
                generation=registration.generation,
                state_id=registration.state_id,
            ),
        )
        self._registration = None
        self._state = None
        self._unanswered = None  # its requests are freed: nothing to learn
        self._forgotten = None
        self._lease_epoch += 1
        return int(reply.num_freed_requests)

    # -- reads --------------------------------------------------------------------------
    async def pool_info(self) -> PoolInfo:
        reply = await self._call("GetPoolInfo", pb.GetPoolInfoRequest())
        return PoolInfo(
            config=pool_from_pb(reply.config),
            limits=limits_from_pb(reply.limits),
            counters=counters_from_pb(reply.counters),
            server_version=reply.server_version,
        )

    async def lookup(
        self,
        token_ids: TokenIds,
        *,
        extra_keys: ExtraKeys | None = None,
        page_hashes: Sequence[bytes] | None = None,
    ) -> LookupResult:
        request = pb.LookupRequest(token_ids=encode_i32(token_ids))
        if extra_keys is not None:
            request.extra_keys.CopyFrom(extra_keys_to_pb(extra_keys))
        if page_hashes:
            state = self._state
            put_page_hashes(request, page_hashes, 0 if state is None else state.page_hash_size)
        return lookup_from_pb(await self._call("Lookup", request))

    async def block_table(
        self, request_id: str, group_id: int = 0, kernel_block_size: int = 0
    ) -> BlockTable:
        _check_int32("group_id", group_id)
        _check_int32("kernel_block_size", kernel_block_size)
        return block_table_from_pb(
            await self._call(
                "GetBlockTable",
                pb.GetBlockTableRequest(
                    request_id=request_id, group_id=group_id, kernel_block_size=kernel_block_size
                ),
            )
        )

    def watch_events(self, since: int = 0, *, max_events_per_message: int = 0) -> AsyncEventStream:
        """See :meth:`PagekeeperClient.watch_events` (the token file's current token is
        adopted when the stream opens)."""
        self._check_open("WatchEvents")
        if self._token_file is not None:
            self._reread_token(self._token)
        self.stats.num_rpcs += 1
        call = self._stub.WatchEvents(
            pb.WatchEventsRequest(since_seq=since, max_events_per_message=max_events_per_message),
            metadata=self._metadata,
        )
        return AsyncEventStream(call)

    async def reset_prefix_cache(self) -> int:
        reply = await self._call("ResetPrefixCache", pb.ResetPrefixCacheRequest())
        return int(reply.num_dropped_pages)

    # -- the scheduler's API ------------------------------------------------------------
    async def admit(
        self,
        request_id: str,
        token_ids: TokenIds,
        *,
        num_new_tokens: int = 0,
        extra_keys: ExtraKeys | None = None,
        page_hashes: Sequence[bytes] | None = None,
        num_lookahead_tokens: int = 0,
        enable_cache_read: bool = True,
        sync: bool = True,
    ) -> AllocationResult:
        """See :meth:`PagekeeperClient.admit`."""
        state = self._scheduler()
        admission = state.plan_admission(
            request_id,
            token_ids,
            num_new_tokens=num_new_tokens,
            extra_keys=extra_keys,
            page_hashes=page_hashes,
            num_lookahead_tokens=num_lookahead_tokens,
            enable_cache_read=enable_cache_read,
        )
        state.queue_admission(admission)
        if not sync:
            return AllocationResult(request_id, AllocationStatus.PENDING)
        self.stats.num_sync_steps += 1
        admission.is_sync = True
        try:
            await self._send_for(admission)
        except BaseException as exc:  # see PagekeeperClient.admit
            if not self._keeps_failed_entry(admission, exc):
                state.withdraw_admission(admission)
            raise
        assert admission.result is not None
        return admission.result

    async def allocate_decodes(
        self,
        request_ids: Sequence[str],
        token_ids: TokenIds,
        *,
        num_lookahead_tokens: int = 0,
        page_hashes: Mapping[str, bytes] | None = None,
    ) -> list[str]:
        """See :meth:`PagekeeperClient.allocate_decodes` (never awaits a call unless the
        queue must be sent first for ordering)."""
        state = self._scheduler()
        while True:  # checked again after every flush (other tasks may queue meanwhile)
            if not state.must_flush_before_decodes(request_ids):
                plan = state.plan_decodes(request_ids, token_ids, num_lookahead_tokens, page_hashes)
                if not state.decodes_need_ordering_flush(plan):
                    break
                state.unplan_decodes(plan)
            self.stats.num_ordering_flushes += 1
            await self._send_step(None, None)
        need_pages = state.queue_decodes(plan)
        self.stats.num_local_answers += len(request_ids) - len(need_pages)
        return need_pages

    async def allocate_slots(
        self,
        request_id: str,
        num_new_tokens: int,
        *,
        new_token_ids: TokenIds = (),
        num_computed_tokens: int | None = None,
        num_lookahead_tokens: int = 0,
        sync: bool = False,
        page_hashes: Sequence[bytes] | None = None,
    ) -> SlotAllocation:
        """See :meth:`PagekeeperClient.allocate_slots` (local answers never await a call)."""
        state = self._scheduler()
        revoked = state.revoked_answer(request_id)
        if revoked is not None:
            return revoked
        # Checked again after every flush: other tasks may queue meanwhile (a flush of
        # theirs can queue this request's held-back decodes as a growth).
        while True:
            if state.must_flush_before_growth(request_id):
                growth = None
            else:
                growth = state.plan_growth(
                    request_id,
                    num_new_tokens,
                    new_token_ids,
                    num_computed_tokens,
                    num_lookahead_tokens,
                    page_hashes,
                )
                if not state.growth_needs_ordering_flush(growth):
                    break
                state.unplan_growth(growth)
            self.stats.num_ordering_flushes += 1
            await self._send_step(None, None)
            revoked = state.revoked_answer(request_id)  # the answer may have said so
            if revoked is not None:
                return revoked
        defer = sync and self.defer_page_ids and growth.needs_pages and state.can_defer(growth)
        state.queue_growth(growth)
        if growth.is_local:
            self.stats.num_local_answers += 1
            return SlotAllocation(request_id, AllocationStatus.OK, is_local=True)
        if defer:
            # The pool surely has the pages: answer now, hand the ids out with the step.
            growth.is_deferred = True
            self.stats.num_deferred_answers += 1
            return SlotAllocation(request_id, AllocationStatus.OK, is_deferred=True)
        if not sync:
            return SlotAllocation(request_id, AllocationStatus.PENDING)
        self.stats.num_sync_steps += 1
        growth.is_sync = True
        try:
            await self._send_for(growth)
        except BaseException as exc:  # as for an admission
            if not self._keeps_failed_entry(growth, exc):
                state.withdraw_growth(growth)
            raise
        result = growth.result
        if result is None:
            return SlotAllocation(request_id, AllocationStatus.OK)
        return SlotAllocation(request_id, result.status, result.new_page_ids, reason=result.reason)

    async def free_later(self, *request_ids: str) -> None:
        """See :meth:`PagekeeperClient.free_later` (awaits only when the queue must be sent
        first to keep the apply order)."""
        state = self._scheduler()
        for request_id in request_ids:
            while state.must_flush_before_free(request_id):  # again after each flush
                self.stats.num_ordering_flushes += 1
                await self._send_step(None, None)
            state.queue_free(request_id)

    async def free(self, *request_ids: str) -> StepResult:
        await self.free_later(*request_ids)
        return await self._send_step(None, None, explicit=True)

    async def step(
        self,
        batch: Sequence[str] | None = None,
        *,
        num_scheduled_tokens: TokenIds | None = None,
        frees: Sequence[str] = (),
        growths: Sequence[Growth] = (),
        admissions: Sequence[Admission] = (),
    ) -> StepResult:
        """See :meth:`PagekeeperClient.step`."""
        if frees:
            await self.free_later(*frees)
        for g in growths:
            await self.allocate_slots(
                g.request_id,
                g.num_new_tokens,
                new_token_ids=g.new_token_ids,
                num_computed_tokens=g.num_computed_tokens,
                num_lookahead_tokens=g.num_lookahead_tokens,
                page_hashes=g.page_hashes,
            )
        for a in admissions:
            await self.admit(
                a.request_id,
                a.token_ids,
                num_new_tokens=a.num_new_tokens,
                extra_keys=a.extra_keys,
                page_hashes=a.page_hashes,
                num_lookahead_tokens=a.num_lookahead_tokens,
                enable_cache_read=a.enable_cache_read,
                sync=False,
            )
        return await self._send_step(batch, num_scheduled_tokens, explicit=True)

    async def flush(self) -> StepResult | None:
        """Send the queue now (no batch), with every held-back decode; None when there is
        nothing to send."""
        state = self._scheduler()
        state.queue_held()
        if not state.has_queued and self._unanswered is None:
            return None
        return await self._send_step(None, None, explicit=True)

    async def _send_step(
        self,
        batch: Sequence[str] | None,
        num_scheduled_tokens: TokenIds | None,
        *,
        explicit: bool = False,
    ) -> StepResult:
        async with self._step_lock:
            return await self._send_step_locked(batch, num_scheduled_tokens, explicit=explicit)

    async def _send_for(self, entry: Any) -> None:
        """Send the queue for a synchronous call, unless its entry was answered while it
        waited (it rode in another caller's step, or in the unanswered one sent again
        first): no step of its own then."""
        self._num_sync_waiting += 1
        try:
            async with self._step_lock:
                state = self._scheduler()
                if not state.is_queued(entry):
                    return
                if self._unanswered is not None:
                    await self._send_unanswered()
                    if not state.is_queued(entry):
                        return
                await self._send_step_locked(None, None)
        finally:
            self._num_sync_waiting -= 1

    async def _send_step_locked(
        self,
        batch: Sequence[str] | None,
        num_scheduled_tokens: TokenIds | None,
        *,
        explicit: bool = False,
    ) -> StepResult:
        """:meth:`_send_step` with the step lock held."""
        state = self._scheduler()
        registration = self._require()
        if self._unanswered is not None:
            # First learn what it did (its answers come with this step's results).
            resent = await self._send_unanswered()
            if batch is None and not state.has_queued:
                # It was all there was to send (a flush): no second round trip.
                return state.release_carried(resent) if explicit else resent
        prepared = self._begin_step(state, registration, batch, num_scheduled_tokens, explicit)
        try:
            response = await self._step_with_retry(prepared.request)
        except BaseException as exc:  # a cancelled task too: the step may be applied
            if self._step_failed(prepared, exc) and await self._registration_gone():
                raise self._drop_forgotten() from exc
            raise
        return self._step_answered(prepared, response)

    async def _registration_gone(self) -> bool:
        """See :meth:`PagekeeperClient._registration_gone`."""
        try:
            await self.heartbeat()
        except NotFoundError as exc:
            return self._forget_if_gone(exc)
        except PagekeeperError:
            pass
        return False

    async def _send_unanswered(self) -> StepResult:
        """See :meth:`PagekeeperClient._send_unanswered`."""
        unanswered = self._unanswered
        assert unanswered is not None
        try:
            # The same id and content; each try goes under the current generation (a
            # takeover since keeps the client's last step and answer).
            response = await self._step_with_retry(unanswered.request)
        except BaseException as exc:
            if isinstance(exc, NotFoundError) and await self._registration_gone():
                raise self._drop_forgotten() from exc
            if resend_was_refused(exc):
                self._unanswered = None
            raise
        return self._answered(response)

    async def _step_with_retry(self, request: pb.StepRequest) -> pb.StepResponse:
        deadline = time.monotonic() + self.retry_s
        delay = 0.02
        stats = self.stats
        may_reread = True
        num_moved = 0
        may_renew = True
        while True:
            stats.num_rpcs += 1
            stats.by_method["Step"] = stats.by_method.get("Step", 0) + 1
            used = self._token
            # The current generation: the lease renewal may have registered again since
            # the step was built (the same client: its last step and answer are kept).
            generation = self._refresh_generation(request)
            try:
                local = await self._local_channel("Step")
                if local is not None:
                    stats.num_local_calls += 1
                    return await local.call("Step", request, pb.StepResponse, self.timeout)  # type: ignore[no-any-return]
                response: pb.StepResponse = await self._stub.Step(
                    request, metadata=self._metadata, timeout=self.timeout
                )
                return response
            except (
                grpc.RpcError,
                UnavailableError,
                DeadlineExceededError,
                UnauthenticatedError,
                AbortedError,
                FailedPreconditionError,
            ) as exc:
                if isinstance(exc, grpc.RpcError):
                    error = error_from_rpc(exc, "Step")
                else:
                    error = exc  # the same-node socket broke (it is closed now), or refused
                if isinstance(error, UnauthenticatedError) and may_reread:
                    may_reread = False  # once a step: a file that keeps changing ends here
                    if self._reread_token(used):
                        continue  # refused before anything was applied: the same id again
                if isinstance(error, FailedPreconditionError) and may_renew:
                    # The lease may have run out while the client could not renew it (the
                    # service unreachable, the process stalled): the renewal registers
                    # again (its grace period keeps the requests), then the same id goes.
                    may_renew = False
                    if await self._lease_renewed(generation, deadline):
                        continue
                    raise error from None
                if isinstance(error, AbortedError) and num_moved < 3:
                    registration = self._registration
                    if registration is not None and registration.generation != generation:
                        num_moved += 1  # registered again meanwhile: under the new one
                        continue
                if error.code not in _RETRY_CODES or self._is_closed:
                    raise error from None
                if time.monotonic() + delay > deadline:
                    raise error from None
                stats.num_retries += 1
                log.info("step %d: %s; retrying with the same id", request.step_id, error.reason)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    # -- life cycle ---------------------------------------------------------------------
    async def close(self, *, unregister: bool = True) -> None:
        """Stop lease renewal, unregister (best effort) and close the channel."""
        if self._is_closed:
            return
        await self._stop_heartbeat()
        if unregister and self._registration is not None:
            try:
                await self.unregister()
            except PagekeeperError as exc:
                log.info("unregister on close failed: %s", exc)
        self._is_closed = True
        local, self._local = self._local, None
        if local is not None:
            local.close()
        await self._channel.close()

    async def __aenter__(self) -> AsyncPagekeeperClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


__all__ = ["AsyncEventStream", "AsyncPagekeeperClient"]
