#!/usr/bin/env python3
"""``Step`` round trip through the real service, beside a bare ``grpc.aio`` echo.

Both servers run as separate processes on loopback; one ``grpc.aio`` client in this process
sends the same serialized ``StepRequest`` to each, interleaved A B B A … so machine drift
hits both alike. The echo server answers with the request bytes untouched (no protobuf
parsing, no work): the floor of one Python gRPC round trip carrying that payload.

Rows:

* ``decode B=N fits``: N running requests, one decode token each (growths in column form,
  as ``PagekeeperClient`` sends them with ``hold_decodes=False``), every one still fitting
  in its last page (unmeasured steps between samples step over page boundaries); at B=256
  also with one ``Growth`` message per row;
* ``same, held (as sent)`` (B=64, 256): the same decode steps as ``PagekeeperClient`` sends
  them by default: every decode needs no page and completes none, so it is held back and
  the step carries only the batch with each row's count (``Batch.num_computed_tokens``);
  unmeasured steps between samples send the held tokens (carrier growths) and the decodes
  that complete or take a page;
* ``decode B=N new page``: every row crosses into a new page this step (unmeasured filler
  steps bring the rows to a page boundary between samples);
* ``decode B=256, 16 fill``: 256 decodes of staggered lengths, 16 of whose tokens fill
  their page each step (hashed and cached by the service); ``same, pages named``: those
  16 carry the client's hash of the page they fill (``GrowthColumns.packed_page_hashes``,
  what the vLLM plugin sends when the engine hashes unlike the service); ``same, as sent
  (held)`` and ``same, named, as sent``: the same decode steps planned by the client's own
  ``SchedulerState`` (what ``PagekeeperClient.allocate_decodes`` + ``step(batch)`` send):
  the 224 rows that need nothing are held back, the 16 crossing rows and the 16 filling
  rows travel (the latter with their 14 held tokens), the batch carries every row;
* ``admit 8x2000``: 8 new 2,000-token prompts (no cache hit: hashing + allocation), freed
  again by an unmeasured step; ``same, hashes sent``: with each prompt's page hashes
  computed before the step (where vLLM computes them: when the request arrives) and sent
  with it as the client sends them (``packed_page_hashes``: one field per prompt), so the
  service checks and uses them instead of hashing; ``same, field per hash``: the
  same hashes as repeated ``page_hashes`` (what a client that predates the packed field
  sends);
* ``sched step``: the core benchmark's scheduling step — 256 decodes (staggered lengths:
  about 16 cross into a new page) + 4 admissions of 2,000 tokens sharing a 1,024-token
  prefix (hashed by the service) + 4 frees — in one ``Step``.

``ratio`` = step p50 / echo p50 (goal: <= 1.5). ``in-proc`` is the server's own work for
the same Step before its answer goes out (parse, convert, apply, convert back, serialize)
measured on an in-process ``ServiceState`` that mirrors the service's (every request is
applied to both), so ``transport`` = step p50 - in-proc is what the process boundary
costs. ``after`` is the work the service does once the answer is on its way, as it does
(admissions' prefix caching: hashing past the first miss, indexing, their events; see
``ServiceState.defer_caching``), timed on the mirror.

``local p50``: the same steps sent over the service's same-node socket
(``--local-socket``; what ``PagekeeperClient`` uses on the service's host) instead of gRPC:
the samples of a row alternate in pairs between the two transports (G G L L ...), each
beside its own echo, so a row takes twice the samples. ``--no-local`` leaves it out.

The service runs at its default durability (``process``: each step journaled before it is
answered); ``--durability none`` measures it without the journal. ``--no-defer`` runs it
with ``--defer-caching=false`` (admissions cached before the answer; the mirror likewise,
``after`` then 0).

The admission rows run on a service whose KV event buffer (the events kept for
``WatchEvents`` resumption and ``/v1/events``) is full, as on a service that has run a
while: unmeasured admission steps fill it first. Until then each admission step's events
grow the service's heap (~140 KB, ~36 page faults, ~40 us of the step); ``--young``
measures a fresh service instead.

Each timed call (step or echo) starts after 3 ms of idle time (``--gap-ms``), as a
scheduler's steps come between forward passes: the work the service does after an answer
then never falls inside the next call's time, whichever server that call goes to (back to
back, ``--gap-ms 0``, on a 2-core machine it lands in the echo after the step). Run::

    .venv/bin/python bench/bench_step_rpc.py [--samples 200] [--quick] [--no-local]
                                             [--durability none|process|fsync] [--no-defer]
                                             [--gap-ms 3] [--young]
                                             [--only decode,admit,fill,sched]

``--only`` runs some of the rows' families (the decode rows, the admission rows, the four
page-filling decode rows, the scheduling step), e.g. ``--only admit`` to repeat the
admission rows alone. The fill rows run after the admission rows, on a service whose event
buffer is full (see below), each on fresh requests of the same lengths.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
for _sub in ("client", "service"):
    if str(REPO_ROOT / _sub) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT / _sub))

from pagekeeper.core.hashing import hash_pages  # noqa: E402
from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2 as pb  # noqa: E402

STEP_METHOD = "/pagekeeper.v1.PagekeeperService/Step"
PAGE_SIZE = 16
NUM_PAGES = 131072
MAX_MODEL_LEN = 8192
MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MESSAGE_BYTES),
    ("grpc.max_send_message_length", MESSAGE_BYTES),
]


def i32(values: np.ndarray | list[int]) -> bytes:
    return np.asarray(values, dtype="<i4").tobytes()


# -- the echo server (run as a subprocess of this script) ---------------------------------


async def _echo_server(port_file: str) -> None:
    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    handler = grpc.method_handlers_generic_handler(
        "pagekeeper.v1.PagekeeperService", {"Step": grpc.unary_unary_rpc_method_handler(echo)}
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    Path(port_file).write_text(str(port))
    await server.wait_for_termination()


def _wait_file(path: Path, process: subprocess.Popen[bytes], what: str) -> str:
    deadline = time.monotonic() + 60
    while not path.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{what} did not start")
        time.sleep(0.02)
    time.sleep(0.05)  # the echo's port file is written in one go, but be safe
    return path.read_text()


def start_processes(
    workdir: Path, local: bool, durability: str | None = None, defer: bool = True
) -> tuple[list[subprocess.Popen[bytes]], str, str, str | None, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEKEEPER_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT / "service"), str(REPO_ROOT / "client")])
    ready = workdir / "ready.json"
    service = subprocess.Popen(
        [
            sys.executable, "-m", "pagekeeper", "serve",
            "--grpc-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0",
            "--ready-file", str(ready), "--publish-transport", "none",
            # The default durability (process): what a deployment runs; a fresh data dir.
            "--data-dir", str(workdir / "data"),
            *(["--durability", durability] if durability else []),
            *([] if defer else ["--defer-caching=false"]),
            "--num-pages", str(NUM_PAGES), "--max-model-len", str(MAX_MODEL_LEN),
            "--page-size", str(PAGE_SIZE), "--lease-ttl-s", "600", "--max-lease-ttl-s", "600",
            "--log-level", "warning",
            *(["--local-socket", str(workdir / "step.sock")] if local else []),
        ],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    port_file = workdir / "echo.port"
    echo = subprocess.Popen(
        [sys.executable, __file__, "--echo-server", str(port_file)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    info = json.loads(_wait_file(ready, service, "the service"))
    echo_port = _wait_file(port_file, echo, "the echo server")
    return (
        [service, echo],
        info["grpc_address"],
        f"127.0.0.1:{echo_port}",
        info["local_socket"],
        info["http_address"],
    )


# -- scenarios ----------------------------------------------------------------------------


class Driver:
    """One registered scheduler; builds StepRequests with increasing step ids."""

    def __init__(self, stub_call: Callable, client_id: str, generation: int) -> None:
        self.call = stub_call
        self.client_id = client_id
        self.generation = generation
        self.step_id = 0
        self.rng = np.random.default_rng(0)
        self.next_request = 0

    def request(self, **fields: object) -> pb.StepRequest:
        self.step_id += 1
        # As PagekeeperClient asks: growths granted pages come back in columns.
        return pb.StepRequest(
            client_id=self.client_id,
            generation=self.generation,
            step_id=self.step_id,
            grants_in_columns=True,
            **fields,
        )

    async def step(self, **fields: object) -> pb.StepResponse:
        return await self.call(self.request(**fields))

    def new_ids(self, n: int) -> list[str]:
        ids = [f"req-{self.next_request + i}" for i in range(n)]
        self.next_request += n
        return ids

    def prompt(self, n: int) -> np.ndarray:
        return self.rng.integers(0, 50_000, n, dtype=np.int32)

    async def admit(self, ids: list[str], length: int) -> None:
        admissions = [pb.Admission(request_id=r, token_ids=i32(self.prompt(length))) for r in ids]
        for start in range(0, len(admissions), 64):
            reply = await self.step(admissions=admissions[start : start + 64])
            assert all(r.status == pb.ALLOCATION_STATUS_OK for r in reply.results)


def decodes(driver: Driver, ids: list[str], lengths: dict[str, int], columns: bool = True):
    """One plain decode per row (a token appended, one more slot), in column form (what
    ``PagekeeperClient`` sends) or as one ``Growth`` message per row."""
    token = int(driver.rng.integers(0, 50_000))
    for r in ids:
        lengths[r] += 1
    if columns:
        columns_msg = pb.GrowthColumns(request_ids=ids, new_token_ids=i32([token] * len(ids)))
        return {"growth_columns": columns_msg}
    tok = i32([token])
    return {"growths": [pb.Growth(request_id=r, num_new_tokens=1, new_token_ids=tok) for r in ids]}


def fits_step(driver: Driver, ids: list[str], lengths: dict[str, int], columns: bool = True):
    """Samples where every row's new token fits in its last page; an unmeasured step
    between samples moves rows off a page boundary (so no sample allocates)."""

    def make() -> pb.StepRequest:
        return driver.request(
            **decodes(driver, ids, lengths, columns), batch=pb.Batch(request_ids=ids)
        )

    async def skip_boundaries() -> None:
        pending = [r for r in ids if lengths[r] % PAGE_SIZE == 0]
        if pending:
            await driver.step(**decodes(driver, pending, lengths))

    return make, skip_boundaries


def held_fits_step(driver: Driver, ids: list[str], lengths: dict[str, int]):
    """The same decode step as ``PagekeeperClient`` sends it (``hold_decodes``): no row
    needs a page or completes one, so no growth travels; the batch carries each row's count
    as the client has it (``Batch.num_computed_tokens``, ahead of the service's). Between
    samples an unmeasured step sends the held tokens as carrier growths before a row would
    complete its page."""
    held: dict[str, list[int]] = {r: [] for r in ids}

    def make() -> pb.StepRequest:
        token = int(driver.rng.integers(0, 50_000))
        for r in ids:
            held[r].append(token)
        ends = [lengths[r] + len(held[r]) for r in ids]
        return driver.request(batch=pb.Batch(request_ids=ids, num_computed_tokens=i32(ends)))

    async def carry() -> None:
        # Rows whose next decode would take a page or complete one are not held: send their
        # held tokens (carrier growths), then plain decodes until each sits one token into
        # a fresh page.
        due = [r for r in ids if (lengths[r] + len(held[r])) % PAGE_SIZE in (0, PAGE_SIZE - 1)]
        carriers = [r for r in due if held[r]]
        if carriers:
            cols = pb.GrowthColumns(
                request_ids=carriers,
                new_token_ids=i32([t for r in carriers for t in held[r]]),
                num_new_token_ids=i32([len(held[r]) for r in carriers]),
                num_computed_tokens=i32([lengths[r] + len(held[r]) - 1 for r in carriers]),
            )
            await driver.step(growth_columns=cols)
            for r in carriers:
                lengths[r] += len(held[r])
                held[r] = []
        while pending := [r for r in due if lengths[r] % PAGE_SIZE != 1]:
            await driver.step(**decodes(driver, pending, lengths))

    return make, carry


async def boundary_filler(driver: Driver, ids: list[str], lengths: dict[str, int]) -> None:
    """Unmeasured decode steps until every row sits exactly at a page boundary."""
    while True:
        pending = [r for r in ids if lengths[r] % PAGE_SIZE != 0]
        if not pending:
            return
        await driver.step(**decodes(driver, pending, lengths))


def crossing_step(driver: Driver, ids: list[str], lengths: dict[str, int]):
    """Samples where every row crosses into a new page (fillers between samples)."""

    def make() -> pb.StepRequest:
        return driver.request(**decodes(driver, ids, lengths), batch=pb.Batch(request_ids=ids))

    async def refill() -> None:
        await boundary_filler(driver, ids, lengths)

    return make, refill


class ClientPlanned:
    """Steps planned by the client's own ``SchedulerState`` (the queue, held-back decodes
    and wire form ``PagekeeperClient`` has), sent through the driver; ``answered`` applies
    the service's answer to it, as the client does."""

    def __init__(self, driver: Driver, pool: pb.PoolConfig) -> None:
        from pagekeeper_client.client import SchedulerState, pool_from_pb

        self.driver = driver
        self.state = SchedulerState(pool_from_pb(pool), hold_decodes=True)
        self.prepared: object = None

    def request(self, batch: list[str] | None) -> pb.StepRequest:
        d = self.driver
        d.step_id += 1
        self.prepared = self.state.prepare_step(
            client_id=d.client_id,
            generation=d.generation,
            step_id=d.step_id,
            batch=batch,
            num_scheduled_tokens=None,
        )
        return self.prepared.request  # type: ignore[attr-defined]

    def answered(self, response: pb.StepResponse) -> None:
        self.state.apply_step(self.prepared, response)  # type: ignore[arg-type]
        self.prepared = None

    async def step(self, batch: list[str] | None = None) -> None:
        request = self.request(batch)
        self.answered(await self.driver.call(request))

    async def admit(self, ids: list[str], length: int) -> None:
        for start in range(0, len(ids), 64):
            for r in ids[start : start + 64]:
                self.state.queue_admission(
                    self.state.plan_admission(
                        r,
                        self.driver.prompt(length),
                        num_new_tokens=length,
                        extra_keys=None,
                        page_hashes=None,
                        num_lookahead_tokens=0,
                        enable_cache_read=True,
                    )
                )
            await self.step()

    def decode_step(self, ids: list[str], named: bool):
        """``allocate_decodes`` for every row (with ``named``, the rows completing a page
        name it), then the step publishing all of them."""
        serial = [0]
        state = self.state

        def make() -> pb.StepRequest:
            token = int(self.driver.rng.integers(0, 50_000))
            hashes = None
            if named:
                hashes = {}
                for r in ids:
                    if (state.view(r).num_computed_tokens + 1) % PAGE_SIZE == 0:
                        serial[0] += 1
                        hashes[r] = hashlib.sha256(f"{r}/{serial[0]}".encode()).digest()
            plan = state.plan_decodes(ids, [token] * len(ids), 0, hashes)
            state.queue_decodes(plan)
            return self.request(ids)

        return make


def fill_step(driver: Driver, ids: list[str], lengths: dict[str, int], named: bool):
    """A plain decode per row; with ``named``, each row whose token fills its page carries
    a hash for it (the client's, not the service's: an engine hashing otherwise)."""
    serial = [0]

    def make() -> pb.StepRequest:
        fields = decodes(driver, ids, lengths)
        if named:
            counts = [int(lengths[r] % PAGE_SIZE == 0) for r in ids]
            hashes = []
            for r, c in zip(ids, counts, strict=True):
                if c:
                    serial[0] += 1
                    hashes.append(hashlib.sha256(f"{r}/{serial[0]}".encode()).digest())
            cols = fields["growth_columns"]
            cols.packed_page_hashes = b"".join(hashes)
            cols.num_page_hashes = i32(counts)
        return driver.request(**fields, batch=pb.Batch(request_ids=ids))

    return make


# -- the in-process mirror ----------------------------------------------------------------


class Mirror:
    """A ``ServiceState`` in this process that applies every request the service gets, so it
    stays identical to the service's; timing it on the measured requests gives what the
    server does per Step without the transport (parse, convert, apply, convert, serialize)."""

    def __init__(self, defer: bool = True) -> None:
        from pagekeeper.core.config import GroupConfig, PoolConfig
        from pagekeeper.rpc import convert
        from pagekeeper.state import ClientRole, Limits, RegisterCommand, ServiceState

        self.convert = convert
        self.state = ServiceState(
            PoolConfig(
                num_pages=NUM_PAGES,
                groups=(GroupConfig(page_size=PAGE_SIZE),),
                max_model_len=MAX_MODEL_LEN,
            ),
            Limits(lease_ttl_s=600.0, max_lease_ttl_s=600.0),
        )
        self.state.register(RegisterCommand(now=0.0, role=ClientRole.SCHEDULER))
        if defer:
            self.state.defer_caching(lambda: None)  # as the service: settled after the answer
        self.settle_times: list[float] = []

    def apply(self, request: pb.StepRequest) -> float:
        """The work before the answer; what follows it goes to ``settle_times``."""
        data = request.SerializeToString()
        started = time.perf_counter()
        parsed = pb.StepRequest.FromString(data)
        command = self.convert.step_from_pb(parsed, 0.0)
        result = self.state.step(command)
        self.convert.step_result_to_pb(result, parsed, command).SerializeToString()
        answered = time.perf_counter()
        self.state.settle()
        self.settle_times.append(time.perf_counter() - answered)
        return answered - started


def _event_buffer_full(http_address: str) -> bool:
    """Whether the service's KV events kept for resumption fill 95% of its default byte
    budget (``event_buffer_bytes``: what admissions' events reach first), from /metrics."""
    from pagekeeper.state import Limits

    with urllib.request.urlopen(f"http://{http_address}/metrics", timeout=10) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith("pagekeeper_event_buffer_bytes "):
                return float(line.split()[1]) >= 0.95 * Limits().event_buffer_bytes
    raise SystemExit("the service's /metrics has no pagekeeper_event_buffer_bytes")


# -- timing -------------------------------------------------------------------------------


GAP_S = 0.003
"""Idle time before each timed call (``--gap-ms``): a scheduler runs a forward pass between
its steps, so the work a service does after an answer (and the echo's teardown) never
lands inside the next call's time; back to back on a 2-core machine it would."""


async def timed(call: Callable, request: pb.StepRequest, answered: Callable | None = None) -> float:
    if GAP_S:
        await asyncio.sleep(GAP_S)
    started = time.perf_counter()
    response = await call(request)
    elapsed = time.perf_counter() - started
    if answered is not None:
        answered(response)
    return elapsed


def summary(values: list[float]) -> tuple[float, float]:
    ms = sorted(v * 1000 for v in values)
    return statistics.median(ms), ms[int(0.9 * (len(ms) - 1))]


Row = tuple[str, int, float, float, float, float, float, float | None]
ROW_FAMILIES = frozenset({"decode", "admit", "fill", "sched"})


async def run(
    samples: int,
    workdir: Path,
    use_local: bool,
    durability: str | None = None,
    defer: bool = True,
    young: bool = False,
    only: frozenset[str] = ROW_FAMILIES,
) -> list[Row]:
    from pagekeeper_client.local import LocalChannel

    processes, service_address, echo_address, local_path, http_address = start_processes(
        workdir, use_local, durability, defer
    )
    local = LocalChannel(local_path, timeout=60) if local_path else None
    rows: list[Row] = []
    try:
        service = grpc.aio.insecure_channel(service_address, options=CHANNEL_OPTIONS)
        echo = grpc.aio.insecure_channel(echo_address, options=CHANNEL_OPTIONS)
        step_call = service.unary_unary(
            STEP_METHOD,
            request_serializer=pb.StepRequest.SerializeToString,
            response_deserializer=pb.StepResponse.FromString,
        )
        # The echo returns the request's bytes: parse them as what they are.
        echo_call = echo.unary_unary(
            STEP_METHOD,
            request_serializer=pb.StepRequest.SerializeToString,
            response_deserializer=pb.StepRequest.FromString,
        )
        register = service.unary_unary(
            "/pagekeeper.v1.PagekeeperService/RegisterClient",
            request_serializer=pb.RegisterClientRequest.SerializeToString,
            response_deserializer=pb.RegisterClientResponse.FromString,
        )
        reg = await register(pb.RegisterClientRequest(role=pb.CLIENT_ROLE_SCHEDULER, name="bench"))
        mirror = Mirror(defer)

        async def service_step(request: pb.StepRequest) -> pb.StepResponse:
            mirror.apply(request)
            if local is not None:
                return await local_call(request)
            return await step_call(request)

        driver = Driver(service_step, reg.client_id, reg.generation)

        async def local_call(request: pb.StepRequest) -> pb.StepResponse:
            assert local is not None
            return local.call("Step", request, pb.StepResponse, 60.0)

        async def measure(
            name: str,
            make: Callable[[], pb.StepRequest],
            between: Callable[[], object] | None = None,
            count: int = samples,
            answered: Callable[[pb.StepResponse], None] | None = None,
        ) -> None:
            for k in range(10):  # warm-up every path
                request = make()
                mirror.apply(request)
                response = await (local_call if local is not None and k % 2 else step_call)(request)
                if answered is not None:
                    answered(response)
                await echo_call(request)
                if between is not None:
                    await between()
            step_times, echo_times, mirror_times = [], [], []
            mirror.settle_times.clear()
            local_times: list[float] = []
            for i in range(count * 2 if local is not None else count):
                request = make()
                mirror_times.append(mirror.apply(request))
                over_local = local is not None and (i // 2) % 2 == 1
                call, times = (local_call, local_times) if over_local else (step_call, step_times)
                if i % 2:
                    echo_times.append(await timed(echo_call, request))
                    times.append(await timed(call, request, answered))
                else:
                    times.append(await timed(call, request, answered))
                    echo_times.append(await timed(echo_call, request))
                if between is not None:
                    await between()
            step_p50, step_p90 = summary(step_times)
            echo_p50, _ = summary(echo_times)
            local_p50 = summary(local_times)[0] if local_times else None
            size = request.ByteSize()
            in_proc = summary(mirror_times)[0]
            after = summary(mirror.settle_times)[0]
            rows.append((name, size, step_p50, step_p90, echo_p50, in_proc, after, local_p50))
            print(f"  {name}: step {step_p50:.3f} ms, echo {echo_p50:.3f} ms", file=sys.stderr)

        prompt_len = 33  # 3 pages; the 34th token's slot is in the third page
        for batch_size in (1, 64, 256) if "decode" in only else ():
            ids = driver.new_ids(batch_size)
            await driver.admit(ids, prompt_len)
            lengths = dict.fromkeys(ids, prompt_len)
            make, between = fits_step(driver, ids, lengths)
            await measure(f"decode B={batch_size} fits", make, between)
            if batch_size > 1:
                make, between = held_fits_step(driver, ids, lengths)
                await measure("  same, held (as sent)", make, between)
                # Tokens still held are dropped: the service never saw them.
            if batch_size == 256:
                make, between = fits_step(driver, ids, lengths, columns=False)
                await measure("  same, as messages", make, between)
            make, between = crossing_step(driver, ids, lengths)
            await boundary_filler(driver, ids, lengths)
            # Rows grow one page per sample: keep the sample count within max_model_len.
            count = min(samples, (MAX_MODEL_LEN - max(lengths.values())) // PAGE_SIZE - 20)
            await measure(f"decode B={batch_size} new page", make, between, count)
            await driver.step(free_request_ids=ids)

        # Admissions: 8 new 2,000-token prompts, freed by an unmeasured step after each.
        admitted: list[str] = []

        def make_admissions() -> pb.StepRequest:
            ids = driver.new_ids(8)
            admitted[:] = ids
            return driver.request(
                admissions=[
                    pb.Admission(request_id=r, token_ids=i32(driver.prompt(2000))) for r in ids
                ]
            )

        async def free_admitted() -> None:
            await driver.step(free_request_ids=list(admitted))

        if ("admit" in only or "fill" in only) and not young:
            # A service that has run a while holds as many KV events as its buffer keeps
            # (event_buffer_size / _bytes) and drops the oldest as new ones come, so its
            # heap no longer grows. A fresh one grows it by every admission's events
            # (~140 KB a step of these: ~36 page faults, ~40 us of the step) until the
            # buffer is full. Unmeasured steps fill it first: the rows below measure a
            # service in its steady state (--young: a fresh one).
            filled = 0
            while not _event_buffer_full(http_address):
                for _ in range(20):
                    await driver.call(make_admissions())
                    await free_admitted()
                filled += 20
            print(f"  (event buffer full after {filled} unmeasured admissions)", file=sys.stderr)
        if "admit" in only:
            await measure("admit 8x2000", make_admissions, free_admitted)

        # The same with each prompt's page hashes computed before the step, where vLLM
        # computes them (when the request arrives): the service checks and uses them.
        def make_hashed_admissions(packed: bool) -> pb.StepRequest:
            ids = driver.new_ids(8)
            admitted[:] = ids
            prompts = [driver.prompt(2000) for _ in ids]
            admissions = []
            for r, p in zip(ids, prompts, strict=True):
                hashes = hash_pages(p, PAGE_SIZE)
                if packed:
                    admission = pb.Admission(
                        request_id=r, token_ids=i32(p), packed_page_hashes=b"".join(hashes)
                    )
                else:
                    admission = pb.Admission(request_id=r, token_ids=i32(p), page_hashes=hashes)
                admissions.append(admission)
            return driver.request(admissions=admissions)

        if "admit" in only:
            await measure(
                "  same, hashes sent", lambda: make_hashed_admissions(True), free_admitted
            )
            await measure(
                "  same, field per hash", lambda: make_hashed_admissions(False), free_admitted
            )

        if "fill" in only:
            # 256 rows of staggered lengths: 16 fill their page each step. Fresh requests
            # of the same lengths for each row (the rows see the same work), after the
            # admission rows (the event buffer full: a steady heap).
            for named in (False, True):
                ids = driver.new_ids(256)
                fill_lengths: dict[str, int] = {}
                for k in range(PAGE_SIZE):
                    group = ids[k::PAGE_SIZE]
                    await driver.admit(group, prompt_len + k)
                    fill_lengths.update(dict.fromkeys(group, prompt_len + k))
                make = fill_step(driver, ids, fill_lengths, named)
                name = "  same, pages named" if named else "decode B=256, 16 fill"
                await measure(name, make)
                await driver.step(free_request_ids=ids)
            # The same steps as the client plans and sends them (held-back decodes).
            for named in (False, True):
                planner = ClientPlanned(driver, reg.pool)
                ids = driver.new_ids(256)
                for k in range(PAGE_SIZE):
                    await planner.admit(ids[k::PAGE_SIZE], prompt_len + k)
                name = "  same, named, as sent" if named else "  same, as sent (held)"
                await measure(name, planner.decode_step(ids, named), answered=planner.answered)
                await driver.step(free_request_ids=ids)

        if "sched" in only:
            # The scheduling step of the core benchmark: 256 running requests of staggered
            # lengths (about 16 cross into a new page each step), 4 admissions, 4 frees.
            running = driver.new_ids(256)
            sched_lengths: dict[str, int] = {}
            for k in range(16):
                group = running[k::16]
                await driver.admit(group, prompt_len + k)
                sched_lengths.update(dict.fromkeys(group, prompt_len + k))
            shared = driver.prompt(1024)
            cycle: list[str] = []

            def make_sched_step() -> pb.StepRequest:
                new = driver.new_ids(4)
                frees = cycle[:4]
                cycle[:] = cycle[4:] + new
                admissions = [
                    pb.Admission(
                        request_id=r,
                        token_ids=i32(np.concatenate([shared, driver.prompt(976)])),
                    )
                    for r in new
                ]
                return driver.request(
                    free_request_ids=frees,
                    **decodes(driver, running, sched_lengths),
                    admissions=admissions,
                    batch=pb.Batch(request_ids=running + new),
                )

            # Each step frees the 4 requests the previous one admitted.
            await measure("sched step 256+4+4", make_sched_step)
        await service.close()
        await echo.close()
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            # The service snapshots its state as it stops (~1-2 s after a full run).
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if local is not None:
            local.close()
    return rows


def main() -> int:
    global GAP_S
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="40 samples per row")
    parser.add_argument(
        "--no-local", action="store_true", help="leave out the same-node socket column"
    )
    parser.add_argument("--durability", help="the service's durability (default: its own, process)")
    parser.add_argument(
        "--no-defer", action="store_true", help="cache admissions before answering (the A/B)"
    )
    parser.add_argument(
        "--gap-ms",
        type=float,
        default=GAP_S * 1000,
        help="idle time before each timed call, as a forward pass between steps (0: back to back)",
    )
    parser.add_argument(
        "--young",
        action="store_true",
        help="measure the admission rows on a fresh service (its KV event buffer still filling)",
    )
    parser.add_argument(
        "--only",
        default=",".join(sorted(ROW_FAMILIES)),
        help="comma-separated row families to run: decode, admit, fill, sched (default: all)",
    )
    parser.add_argument("--echo-server", metavar="PORT_FILE", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    only = frozenset(ns.only.split(","))
    if not only or not only <= ROW_FAMILIES:
        parser.error(f"--only takes some of {', '.join(sorted(ROW_FAMILIES))}; got {ns.only!r}")
    GAP_S = ns.gap_ms / 1000
    if ns.echo_server:
        asyncio.run(_echo_server(ns.echo_server))
        return 0
    samples = 40 if ns.quick else ns.samples
    with tempfile.TemporaryDirectory(prefix="pk-bench-") as tmp:
        rows = asyncio.run(
            run(samples, Path(tmp), not ns.no_local, ns.durability, not ns.no_defer, ns.young, only)
        )
    print(
        f"Step round trip vs bare grpc.aio echo of the same request bytes ({samples} samples; "
        f"service durability: {ns.durability or 'default (process)'}; "
        f"{ns.gap_ms:g} ms idle before each call"
        f"{'; caching before the answer' if ns.no_defer else ''}"
        f"{'; admissions on a fresh service' if ns.young else ''})"
    )
    print(
        f"{'row':<22} {'req KB':>6} {'step p50':>9} {'step p90':>9} {'echo p50':>9} "
        f"{'ratio':>6} {'in-proc':>9} {'after':>8} {'transport':>9} {'local p50':>9} {'ratio':>6}"
    )
    for name, size, p50, p90, echo_p50, in_proc, after, local_p50 in rows:
        local_cols = (
            f" {local_p50:>7.3f}ms {local_p50 / echo_p50:>6.2f}" if local_p50 is not None else ""
        )
        print(
            f"{name:<22} {size / 1024:>6.1f} {p50:>7.3f}ms {p90:>7.3f}ms {echo_p50:>7.3f}ms "
            f"{p50 / echo_p50:>6.2f} {in_proc:>7.3f}ms {after:>6.3f}ms {p50 - in_proc:>7.3f}ms"
            f"{local_cols}"
        )
    print(
        "ratio = step p50 / echo p50 (goal <= 1.5); in-proc = the server's own work per Step "
        "before its answer (parse, convert, apply, convert, serialize) measured on an "
        "identical in-process state; after = its work once the answer is out (deferred "
        "prefix caching); transport = step p50 - in-proc; local p50 = the same steps over the "
        "same-node socket, its ratio against the same gRPC echo."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
