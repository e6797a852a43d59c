"""Simulated schedulers and workers that drive a real pagekeeper over gRPC and check it.

:class:`SimScheduler` keeps its own model of every request it runs, built only from the
answers it was *acknowledged*: tokens, computed tokens and page ids. After a service crash
it takes its client id over (generation + 1), learns from the registration which step was
the last one applied, retries its in-flight step with the same step id (the stored answer
when it had been applied, a fresh application when not) and compares the service's tables
with its model (:meth:`SimScheduler.verify_tables`).

:class:`SimWorker` is a worker with a real KV cache (:class:`pagekeeper_client.attention.
ReferencePagedAttention`) that survives service crashes, as a GPU worker's memory does. For
every published step it reads the tables from the shared-memory ring, writes the scheduled
tokens' K/V at their slots and compares paged attention through the published tables with
dense attention over each request's true K/V. Pages written before a crash are read through
the tables recovered after it: a recovered table that points at another page, or a prefix
hit on a page whose content changed, shows as a mismatch.

K/V are a deterministic function of (token id, position), so a shared prefix has the same
K/V whichever request wrote it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import torch

from pagekeeper.core.hashing import hash_pages
from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2 as pb
from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2_grpc as pb_grpc
from pagekeeper_client.attention import ReferencePagedAttention, dense_attention
from pagekeeper_client.client import ring_from_pb
from pagekeeper_client.transports import open_table_view

PAGE_SIZE = 16
KERNEL_BLOCK_SIZE = 8
NUM_KV_HEADS = 2
NUM_Q_HEADS = 4
HEAD_DIM = 8
VOCAB = 997
MAX_POSITIONS = 1024
CHANNEL_OPTIONS = [("grpc.enable_retries", 0)]


def i32(values: Any) -> bytes:
    return np.asarray(values, dtype="<i4").tobytes()


def from_i32(data: bytes) -> list[int]:
    return np.frombuffer(data, dtype="<i4").tolist()


class KV:
    """True K/V of any (token, position): shared by schedulers' models and workers."""

    def __init__(self, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        shape = (NUM_KV_HEADS, HEAD_DIM)
        self.k_tok = torch.randn((VOCAB, *shape), generator=gen)
        self.v_tok = torch.randn((VOCAB, *shape), generator=gen)
        self.k_pos = torch.randn((MAX_POSITIONS, *shape), generator=gen)
        self.v_pos = torch.randn((MAX_POSITIONS, *shape), generator=gen)

    def of(self, tokens: list[int], start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor(tokens[start:stop], dtype=torch.long) % VOCAB
        pos = torch.arange(start, stop)
        return self.k_tok[ids] + self.k_pos[pos], self.v_tok[ids] + self.v_pos[pos]


@dataclass
class Request:
    tokens: list[int]
    computed: int
    pages: list[int]


@dataclass
class Scheduled:
    """One row of a published batch, as the scheduler knows it."""

    request_id: str
    tokens: list[int]
    seq_len: int
    query_len: int


@dataclass
class StepCounter:
    """Step ids shared by the schedulers of one pool (published ids increase pool-wide)."""

    value: int = 0

    def next(self) -> int:
        self.value += 1
        return self.value


@dataclass
class Pending:
    request: pb.StepRequest
    growths: dict[str, int]
    """request id -> token appended."""
    admissions: dict[str, list[int]]


class SimScheduler:
    def __init__(
        self,
        address: str,
        *,
        seed: int,
        counter: StepCounter,
        name: str = "sim",
        max_running: int = 6,
        max_tokens: int = 160,
        metadata: tuple[tuple[str, str], ...] = (),
        local_socket: str | None = None,
    ) -> None:
        """``local_socket``: send steps in frames on the service's same-node socket
        (everything else stays on gRPC)."""
        self.rng = np.random.default_rng(seed)
        self.local_socket = local_socket
        self._local: Any = None
        self.counter = counter
        self.name = name
        self.max_running = max_running
        self.max_tokens = max_tokens
        self.metadata = metadata
        self.requests: dict[str, Request] = {}
        self.preempted: list[str] = []
        self.client_id = ""
        self.generation = 0
        self.last_acked_step = 0
        self.num_acked_steps = 0
        self.num_requests = 0
        self.num_retried = 0
        self.pending: Pending | None = None
        self.last_request: pb.StepRequest | None = None
        self.last_reply: pb.StepResponse | None = None
        self.connect(address)

    # -- connection ----------------------------------------------------------------------
    def connect(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.PagekeeperServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()
        if self._local is not None:
            self._local.close()

    def register(self) -> pb.RegisterClientResponse:
        """Register, or take our id over after a restart (keeps our requests)."""
        reply = self.stub.RegisterClient(
            pb.RegisterClientRequest(
                role=pb.CLIENT_ROLE_SCHEDULER,
                name=self.name,
                client_id=self.client_id,
                lease_ttl_ms=60_000,
            ),
            metadata=self.metadata,
            timeout=10,
        )
        self.client_id, self.generation = reply.client_id, reply.generation
        self.counter.value = max(self.counter.value, reply.last_published_step_seq)
        return reply

    # -- steps ---------------------------------------------------------------------------
    def plan(self) -> Pending:
        rng = self.rng
        frees = list(self.preempted)
        self.preempted = []
        growths: dict[str, int] = {}
        for rid, req in self.requests.items():
            if rid in frees:
                continue
            if len(req.tokens) >= self.max_tokens or rng.random() < 0.03:
                frees.append(rid)
                continue
            growths[rid] = int(rng.integers(0, VOCAB))
        admissions: dict[str, list[int]] = {}
        room = self.max_running - len(growths)
        for _ in range(min(room, int(rng.integers(0, 3)))):
            rid = f"{self.name}-r{self.num_requests}"
            self.num_requests += 1
            prefix = int(rng.integers(0, 3))
            shared = [(prefix * 101 + i) % VOCAB for i in range(16 * int(rng.integers(1, 4)))]
            tail = rng.integers(0, VOCAB, int(rng.integers(1, 30))).tolist()
            admissions[rid] = shared + tail
        request = pb.StepRequest(
            client_id=self.client_id,
            generation=self.generation,
            step_id=self.counter.next(),
            free_request_ids=frees,
            growths=[self._growth(rid, token) for rid, token in growths.items()],
            admissions=[self._admission(rid, tokens) for rid, tokens in admissions.items()],
            batch=pb.Batch(request_ids=[*growths, *admissions]),
        )
        self.pending = Pending(request, growths, admissions)
        return self.pending

    def _growth(self, rid: str, token: int) -> pb.Growth:
        """A decode; one that completes a page names it for half of them (the hash the
        service would make, so the model stays exact; the record is the version that
        carries growth hashes)."""
        growth = pb.Growth(request_id=rid, num_new_tokens=1, new_token_ids=i32([token]))
        tokens = [*self.requests[rid].tokens, token]
        if len(tokens) % PAGE_SIZE == 0 and self.rng.integers(0, 2):
            growth.packed_page_hashes = hash_pages(tokens, PAGE_SIZE)[-1]
        return growth

    def _admission(self, rid: str, tokens: list[int]) -> pb.Admission:
        hashes = self._hashes(tokens)
        if hashes and self.rng.integers(0, 2):
            # As the client sends them to a service that says its page-hash size.
            return pb.Admission(
                request_id=rid, token_ids=i32(tokens), packed_page_hashes=b"".join(hashes)
            )
        return pb.Admission(request_id=rid, token_ids=i32(tokens), page_hashes=hashes)

    def _hashes(self, tokens: list[int]) -> list[bytes]:
        """Page hashes sent with an admission, as vLLM's engine sends them: for a third of
        them every full page's, for a third the first half's (the service completes the
        chain), none for the rest (the service hashes)."""
        kind = int(self.rng.integers(0, 3))
        if kind == 0:
            return []
        hashes = hash_pages(tokens, PAGE_SIZE)
        return hashes if kind == 1 else hashes[: len(hashes) // 2]

    def send(self, pending: Pending) -> pb.StepResponse:
        if self.local_socket is not None:
            from pagekeeper_client.local import LocalChannel

            if self._local is None or not self._local.is_open:
                token = dict(self.metadata).get("authorization", "").removeprefix("Bearer ")
                self._local = LocalChannel(self.local_socket, token=token or None, timeout=10)
            return self._local.call("Step", pending.request, pb.StepResponse, 10)  # type: ignore[no-any-return]
        return self.stub.Step(pending.request, metadata=self.metadata, timeout=10)

    def acknowledge(self, pending: Pending, reply: pb.StepResponse) -> list[Scheduled]:
        """Update the model from an acknowledged answer; returns the published rows."""
        request = pending.request
        assert reply.step_id == request.step_id
        for rid in request.free_request_ids:
            self.requests.pop(rid, None)
        outcomes = {r.request_id: r for r in reply.results}
        for rid, token in pending.growths.items():
            outcome = outcomes.get(rid)
            if outcome is not None and outcome.status != pb.ALLOCATION_STATUS_OK:
                self.preempted.append(rid)
                continue
            req = self.requests[rid]
            req.tokens.append(token)
            req.computed += 1
            if outcome is not None:
                req.pages += from_i32(outcome.new_page_ids[0])
        scheduled_from: dict[str, int] = {rid: 1 for rid in pending.growths}
        for rid, tokens in pending.admissions.items():
            outcome = outcomes[rid]
            if outcome.status != pb.ALLOCATION_STATUS_OK:
                continue
            hit = from_i32(outcome.hit_page_ids[0]) if outcome.hit_page_ids else []
            self.requests[rid] = Request(
                list(tokens), len(tokens), hit + from_i32(outcome.new_page_ids[0])
            )
            scheduled_from[rid] = len(tokens) - outcome.num_cached_tokens
        left_out = set(reply.unscheduled_request_ids)
        rows = [
            Scheduled(rid, list(self.requests[rid].tokens), self.requests[rid].computed, n)
            for rid, n in scheduled_from.items()
            if rid not in left_out and rid in self.requests
        ]
        self.pending = None
        self._acked(request, reply)
        return rows

    def _acked(self, request: pb.StepRequest, reply: pb.StepResponse) -> None:
        self.last_acked_step = request.step_id
        self.num_acked_steps += 1
        if reply.is_retry:
            self.num_retried += 1
        self.last_request, self.last_reply = request, reply

    def resync(self, rows: list[Scheduled]) -> pb.StepResponse:
        """Republish ``rows`` (the tokens a step scheduled) in a new step, for workers that
        may not have run a step whose answer came back from memory after a restart."""
        request = pb.StepRequest(
            client_id=self.client_id,
            generation=self.generation,
            step_id=self.counter.next(),
            batch=pb.Batch(
                request_ids=[r.request_id for r in rows],
                num_scheduled_tokens=i32([r.query_len for r in rows]),
            ),
        )
        reply = self.stub.Step(request, metadata=self.metadata, timeout=10)
        self._acked(request, reply)
        return reply

    def retry_last(self) -> pb.StepResponse:
        """Send the last acknowledged step again (with the current generation): the stored
        answer must come back, unchanged, and nothing must change."""
        assert self.last_request is not None and self.last_reply is not None
        request = pb.StepRequest()
        request.CopyFrom(self.last_request)
        request.generation = self.generation
        reply = self.stub.Step(request, metadata=self.metadata, timeout=10)
        assert reply.is_retry, "a retried step id was applied again"
        expected = pb.StepResponse()
        expected.CopyFrom(self.last_reply)
        expected.is_retry = True
        assert reply == expected, (reply, expected)
        return reply

    # -- checks --------------------------------------------------------------------------
    def verify_tables(self) -> int:
        """Every request's table on the service is the one the acknowledged answers built;
        returns how many requests were checked."""
        for rid, req in self.requests.items():
            reply = self.stub.GetBlockTable(
                pb.GetBlockTableRequest(request_id=rid, group_id=0),
                metadata=self.metadata,
                timeout=10,
            )
            assert from_i32(reply.page_ids) == req.pages, rid
            assert reply.num_computed_tokens == req.computed, rid
            assert reply.num_tokens == len(req.tokens), rid
            assert reply.owner == self.client_id, rid
        return len(self.requests)


def check_no_page_owned_twice(schedulers: list[SimScheduler]) -> None:
    """A page in two tables must be a shared, full, cached prefix page: the same tokens at
    the same positions in both (anything else is a page handed out twice)."""
    owner: dict[int, tuple[str, tuple[int, ...], int]] = {}
    for sched in schedulers:
        for rid, req in sched.requests.items():
            for index, page in enumerate(req.pages):
                content = tuple(req.tokens[index * PAGE_SIZE : (index + 1) * PAGE_SIZE])
                seen = owner.get(page)
                if seen is None:
                    owner[page] = (rid, content, index)
                    continue
                assert len(content) == PAGE_SIZE and (content, index) == seen[1:], (
                    f"page {page} held by {seen[0]} and {rid} with different content"
                )


@dataclass
class WorkerStats:
    steps: int = 0
    rows: int = 0
    max_error: float = 0.0
    reopened: int = 0
    errors: list[str] = field(default_factory=list)


class SimWorker:
    def __init__(
        self,
        address: str,
        *,
        num_pages: int,
        kv: KV,
        seed: int = 0,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self.kv = kv
        self.metadata = metadata
        # Tiny tensors: torch's intra-op thread pool costs 30x more than the math here (and
        # the service shares these cores).
        torch.set_num_threads(1)
        self.gen = torch.Generator().manual_seed(seed)
        self.cache = ReferencePagedAttention.for_pages(
            num_pages=num_pages,
            page_size=PAGE_SIZE,
            kernel_block_size=KERNEL_BLOCK_SIZE,
            num_kv_heads=NUM_KV_HEADS,
            head_dim=HEAD_DIM,
        )
        self.client_id = ""
        self.generation = 0
        self.view: Any = None
        self.ring_generation = 0
        self.stats = WorkerStats()
        self.connect(address)

    def connect(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.PagekeeperServiceStub(self.channel)

    def register(self) -> pb.RegisterClientResponse:
        reply = self.stub.RegisterClient(
            pb.RegisterClientRequest(
                role=pb.CLIENT_ROLE_WORKER,
                name="sim-worker",
                device="cpu",
                lease_ttl_ms=60_000,
                kernel_support=[
                    pb.GroupKernelSupport(
                        group_id=0,
                        backends=[pb.KernelBackend(name="ref", block_sizes=[KERNEL_BLOCK_SIZE])],
                    )
                ],
            ),
            metadata=self.metadata,
            timeout=10,
        )
        assert reply.kernel_block_sizes[0].kernel_block_size == KERNEL_BLOCK_SIZE
        self.client_id, self.generation = reply.client_id, reply.generation
        self._open(reply.ring)
        return reply

    def heartbeat(self) -> pb.HeartbeatResponse:
        """Renew the lease with the registration we hold; follow a re-created ring."""
        reply = self.stub.Heartbeat(
            pb.HeartbeatRequest(client_id=self.client_id, generation=self.generation),
            metadata=self.metadata,
            timeout=10,
        )
        if reply.HasField("ring") and reply.ring.generation != self.ring_generation:
            self._open(reply.ring)
            self.stats.reopened += 1
        return reply

    def _open(self, ring: pb.RingDescriptor) -> None:
        if self.view is not None:
            self.view.close()
        self.view = open_table_view(ring_from_pb(ring))
        self.ring_generation = ring.generation

    def close(self) -> None:
        if self.view is not None:
            self.view.close()
            self.view = None
        self.channel.close()

    def run_step(self, step_id: int, rows: list[Scheduled], *, timeout: float = 10) -> float:
        """Read step ``step_id``'s tables, write its K/V, check attention; returns the
        largest difference from dense attention (raises when it is not small)."""
        tables = self.view.wait(step_id, timeout=timeout)
        table = tables.table(0)
        assert tables.num_reqs == len(rows), (tables.num_reqs, len(rows))
        if not rows:
            return 0.0
        slots = torch.from_numpy(np.array(table.slot_mapping, dtype=np.int64))
        ks, vs = [], []
        for row in rows:
            k, v = self.kv.of(row.tokens, row.seq_len - row.query_len, row.seq_len)
            ks.append(k)
            vs.append(v)
        self.cache.write_kv(slots, torch.cat(ks), torch.cat(vs))
        num_q = sum(r.query_len for r in rows)
        q = torch.randn((num_q, NUM_Q_HEADS, HEAD_DIM), generator=self.gen)
        block_table = torch.from_numpy(np.array(table.block_table, dtype=np.int32))
        out = self.cache.paged_attention(
            q,
            block_table,
            [r.seq_len for r in rows],
            [r.query_len for r in rows],
            row_lengths=np.array(table.row_lengths).tolist(),
        )
        worst = 0.0
        start = 0
        for row in rows:
            k, v = self.kv.of(row.tokens, 0, row.seq_len)
            want = dense_attention(q[start : start + row.query_len], k, v)
            got = out[start : start + row.query_len]
            error = float((got - want).abs().max())
            if not math.isfinite(error) or error > 1e-4:
                raise AssertionError(
                    f"step {step_id}: attention of {row.request_id} differs by {error} "
                    "(a table points at the wrong page)"
                )
            worst = max(worst, error)
            start += row.query_len
        self.stats.steps += 1
        self.stats.rows += len(rows)
        self.stats.max_error = max(self.stats.max_error, worst)
        return worst
