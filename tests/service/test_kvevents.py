"""KV events over ZeroMQ in vLLM's wire format: the encoding (checked against vLLM's own
decoder where vLLM is installed), the publisher on a state, and the real service with a
router-like subscriber (PUB/SUB, replay over ROUTER/DEALER)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from pagekeeper import kvevents
from pagekeeper.core.config import GroupConfig, GroupKind, PoolConfig
from pagekeeper.core.errors import ConfigError
from pagekeeper.core.events import AllCleared, PageRemoved, PageStored, TokenRun
from pagekeeper.core.hashing import run_extra_keys
from pagekeeper.core.types import ExtraKeys, MultiModalKey
from pagekeeper.kvevents import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KvEventPublisher,
    group_specs,
    to_vllm_events,
    vllm_extra_keys,
)
from pagekeeper.notify import ChangeNotifier
from pagekeeper.settings import Settings
from pagekeeper.state import (
    Admission,
    ClientRole,
    Limits,
    RegisterCommand,
    ResetPrefixCacheCommand,
    ServiceState,
    StepCommand,
)
from tests.helpers.keys import extra_keys as request_keys
from tests.helpers.props import examples
from tests.helpers.server import RunningServer

VLLM_PYTHON = Path("/opt/vllm-anchor/bin/python")
DIGEST_A, DIGEST_B = bytes(range(32)), bytes(range(32, 64))

EVENTS = [
    PageStored(7, 1, (DIGEST_A, DIGEST_B), None, TokenRun(range(8)), 4, (3, 4), "adapter"),
    PageRemoved(8, 0, (DIGEST_B,), (4,)),
    AllCleared(9),
]
# Pages 0-3 of a LoRA request with a salt and an image over tokens [20, 40) (pages of 16).
KEYS = ExtraKeys(
    lora_name="adapter", lora_path="/a", mm_inputs=(MultiModalKey("img", 20, 20),), cache_salt="s"
)
KEYED = PageStored(
    10, 0, (DIGEST_A,) * 4, None, TokenRun(range(64)), 16, (5, 6, 7, 8), "adapter", KEYS, 0
)
# What vLLM 0.33 publishes for them (``to_event_extra_keys`` of its per-block keys).
KEYED_WIRE = [("adapter", "s"), ("adapter", ("img", 4)), ("adapter", ("img", -12)), ("adapter",)]


def decode(payload: bytes) -> KVEventBatch:
    return msgspec.msgpack.Decoder(KVEventBatch).decode(payload)


def test_events_become_vllm_structs() -> None:
    stored, removed, cleared = to_vllm_events(EVENTS, "int")
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [
        int.from_bytes(DIGEST_A[-8:], "big"),
        int.from_bytes(DIGEST_B[-8:], "big"),
    ]
    assert stored.parent_block_hash is None and stored.token_ids == list(range(8))
    assert (stored.block_size, stored.medium, stored.lora_name) == (4, "GPU", "adapter")
    assert stored.group_idx == 1 and stored.lora_id is None
    assert isinstance(removed, BlockRemoved) and removed.group_idx == 0
    assert removed.block_hashes == [int.from_bytes(DIGEST_B[-8:], "big")]
    assert isinstance(cleared, AllBlocksCleared)
    raw = to_vllm_events(EVENTS, "bytes")
    assert raw[0].block_hashes == [DIGEST_A, DIGEST_B]  # type: ignore[union-attr]


def test_extra_keys_go_out_per_page_as_vllm_publishes_them() -> None:
    (stored,) = to_vllm_events([KEYED], "int")
    assert isinstance(stored, BlockStored) and stored.extra_keys == KEYED_WIRE
    # The same request's pages 4 and 5 (a later event): the LoRA alone; page 0 alone: the
    # salt too. The event says where its pages sit in the request.
    later = dataclasses.replace(KEYED, page_hashes=(DIGEST_B,) * 2, first_page=4)
    assert to_vllm_events([later])[0].extra_keys == [("adapter",), ("adapter",)]  # type: ignore[union-attr]


@given(
    keys=request_keys(max_inputs=8),
    first_page=st.integers(0, 20),
    num_pages=st.integers(1, 10),
    page_size=st.sampled_from([1, 4, 16]),
)
@settings(max_examples=examples(300))
def test_the_wire_keys_are_the_hashed_keys_untagged(
    keys: ExtraKeys, first_page: int, num_pages: int, page_size: int
) -> None:
    """Per page, what goes on the wire is what the page hashed (hashing.run_extra_keys),
    untagged as vLLM's to_event_extra_keys does."""
    event = PageStored(
        1, 0, (DIGEST_A,) * num_pages, None, TokenRun(), page_size, (1,) * num_pages, None,
        keys, first_page,
    )  # fmt: skip
    hashed = run_extra_keys(keys, first_page, num_pages, page_size)
    assert vllm_extra_keys(event) == [
        None if k is None else tuple(x[1:] if x[0] == "mm" else x[1] for x in k) for k in hashed
    ]


def test_the_core_says_which_pages_an_event_holds() -> None:
    """Events carry their request's keys and first page, whichever path cached the pages:
    an admission, a decode filling a page (the C loop for a request without keys, Python
    with keys), a chunk growing by several pages."""
    from pagekeeper.core.manager import PageManager

    pm = PageManager(PoolConfig(num_pages=64, groups=(GroupConfig(page_size=16),)))
    pm.admit("k", list(range(64)), extra_keys=KEYS)
    pm.admit("plain", list(range(100, 120)))
    pm.take_events()
    for t in range(12):  # plain: 20 + 12 tokens fill its page 1
        assert None not in pm.allocate_decodes(["plain"], [500 + t]).values()
    for t in range(16):  # k: 64 + 16 tokens fill its page 4
        assert None not in pm.allocate_decodes(["k"], [600 + t]).values()
    assert pm.allocate("k", 40, new_token_ids=list(range(700, 740))) is not None  # pages 5, 6
    events = [e for e in pm.take_events() if isinstance(e, PageStored)]
    got = [(e.first_page, e.extra_keys, len(e.page_hashes)) for e in events]
    # Each event keeps the keys that fall on its pages: past the image and page 0, the LoRA.
    lora = ExtraKeys(lora_name="adapter", lora_path="/a")
    assert got == [(1, None, 1), (4, lora, 1), (5, lora, 2)]
    wire = to_vllm_events(events)
    assert [e.extra_keys for e in wire] == [[None], [("adapter",)], [("adapter",)] * 2]  # type: ignore[union-attr]


def test_the_wire_layout() -> None:
    """An array ``[ts, events, rank]``; each event a map tagged ``type`` by class name."""
    batch = KVEventBatch(ts=1.5, events=to_vllm_events(EVENTS, "int"), data_parallel_rank=2)
    plain = msgspec.msgpack.decode(msgspec.msgpack.encode(batch))
    assert plain[0] == 1.5 and plain[2] == 2
    assert [e["type"] for e in plain[1]] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert set(plain[1][0]) == {
        "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
        "medium", "lora_name", "extra_keys", "group_idx",
    }  # fmt: skip
    assert plain[1][0]["extra_keys"] == [None, None]  # a request without keys: a None a page
    assert decode(msgspec.msgpack.encode(batch)) == batch


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="vLLM's side virtualenv is not here")
def test_vllms_own_decoder_reads_the_batches() -> None:
    payload = msgspec.msgpack.encode(
        KVEventBatch(ts=3.25, events=to_vllm_events([*EVENTS, KEYED], "int"), data_parallel_rank=0)
    )
    script = (
        "import sys, msgspec\n"
        "from vllm.distributed.kv_events import KVEventBatch, BlockStored, BlockRemoved, "
        "AllBlocksCleared\n"
        "b = msgspec.msgpack.Decoder(KVEventBatch).decode(sys.stdin.buffer.read())\n"
        "s, r, c, k = b.events\n"
        "assert isinstance(s, BlockStored) and isinstance(r, BlockRemoved)\n"
        "assert isinstance(c, AllBlocksCleared)\n"
        "print(b.ts, b.data_parallel_rank, s.block_hashes, s.parent_block_hash, s.token_ids,"
        " s.block_size, s.lora_name, s.medium, s.group_idx, r.block_hashes, r.group_idx)\n"
        "print(s.extra_keys, k.extra_keys)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["VLLM_TARGET_DEVICE"] = "cpu"
    result = subprocess.run(
        [str(VLLM_PYTHON), "-c", script],
        input=payload,
        capture_output=True,
        timeout=240,
        env=env,
    )
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    a, b = int.from_bytes(DIGEST_A[-8:], "big"), int.from_bytes(DIGEST_B[-8:], "big")
    expected = f"3.25 0 [{a}, {b}] None {list(range(8))} 4 adapter GPU 1 [{b}] 0"
    *_, line, keys = result.stdout.decode().strip().splitlines()
    assert line == expected
    # Its struct types each page's keys as a tuple; the (identifier, offset) pairs inside
    # come back as lists (msgpack has only arrays).
    assert keys == "[None, None] [('adapter', 's'), ('adapter', ['img', 4]), " + (
        "('adapter', ['img', -12]), ('adapter',)]"
    )


def test_settings() -> None:
    for bad in ("tcp://nohost", "tcp://h:70000", "udp://h:1", "ipc://", 5):
        with pytest.raises(ConfigError) as exc:
            Settings(kv_events_endpoint=bad)  # type: ignore[arg-type]
        assert exc.value.field == "server.kv_events_endpoint"
    with pytest.raises(ConfigError, match="replay needs kv_events_endpoint"):
        Settings(kv_events_replay_endpoint="tcp://127.0.0.1:0")
    with pytest.raises(ConfigError) as exc:
        Settings(kv_events_hash_format="hex")
    assert exc.value.field == "server.kv_events_hash_format"
    Settings(kv_events_endpoint="tcp://*:5557", kv_events_replay_endpoint="ipc:///tmp/r")


# -- the publisher on a state ------------------------------------------------------------------


def _state() -> tuple[ServiceState, str]:
    state = ServiceState(
        PoolConfig(
            num_pages=64,
            groups=(
                GroupConfig(page_size=4),
                GroupConfig(kind=GroupKind.SLIDING_WINDOW, page_size=4, window=8),
            ),
            max_model_len=256,
        ),
        Limits(),
    )
    client = state.register(RegisterCommand(now=0.0, role=ClientRole.SCHEDULER)).client_id
    return state, client


def _step(state: ServiceState, client: str, step_id: int, **parts: object) -> None:
    state.step(StepCommand(now=0.0, client_id=client, generation=1, step_id=step_id, **parts))  # type: ignore[arg-type]


def test_the_publisher_sends_what_the_state_emits_and_replays_it(tmp_path: Path) -> None:
    state, client = _state()

    # A sliding-window pool: stored and removed events in two groups.
    async def scenario() -> None:
        notifier = ChangeNotifier()
        state.add_listener(notifier.notify)
        publisher = KvEventPublisher(
            state,
            notifier,
            endpoint="tcp://127.0.0.1:0",
            replay_endpoint=f"ipc://{tmp_path}/replay",
            topic="kv-events",
            buffer_steps=2,
            data_parallel_rank=3,
        )
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
        sub.connect(publisher.endpoint)
        task = asyncio.create_task(publisher.run())
        replays = asyncio.create_task(publisher.serve_replays())
        try:
            await asyncio.sleep(0.2)  # the subscription reaches the PUB socket
            prompt = np.arange(1, 21, dtype=np.int32)
            _step(state, client, 1, admissions=(Admission("a", prompt),))
            await asyncio.sleep(0.05)
            _step(state, client, 2, frees=("a",))
            _step(state, client, 3, admissions=(Admission("b", prompt + 100),))
            await asyncio.sleep(0.05)
            _step(state, client, 4, frees=("b",))
            state.reset_prefix_cache(ResetPrefixCacheCommand(now=0.0))
            await asyncio.sleep(0.05)

            received = []
            while await asyncio.to_thread(sub.poll, 1000):
                topic, seq, payload = sub.recv_multipart()
                assert topic == b"kv-events"
                received.append((int.from_bytes(seq, "big"), decode(payload)))
                if len(received) > 1 and isinstance(received[-1][1].events[-1], AllBlocksCleared):
                    break
            assert [s for s, _ in received] == list(range(len(received)))
            assert all(b.data_parallel_rank == 3 for _, b in received)
            events = [e for _, b in received for e in b.events]
            # The first batch opens with a clear (void what routers knew of an earlier run).
            expected = to_vllm_events(
                state.events_since(0, 10_000).events, "int", group_specs(state.pool_config)
            )
            assert events == [AllBlocksCleared(), *expected]
            stored = [e for e in events if isinstance(e, BlockStored)]
            kinds = {
                (e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in stored
            }
            assert kinds == {(0, "full_attention", None), (1, "sliding_window", 8)}
            assert isinstance(events[-1], AllBlocksCleared)
            assert publisher.num_events == len(expected)

            # Replay from seq 1: the kept batches (buffer_steps=2) from there, then the end.
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(publisher.replay_endpoint or "")
            dealer.send_multipart((b"", (1).to_bytes(8, "big")))
            replayed = []
            while True:
                assert await asyncio.to_thread(dealer.poll, 5000)
                frames = dealer.recv_multipart()
                if frames[2] == END_SEQ:
                    assert frames[1:] == [b"", END_SEQ, b""]
                    break
                _, topic, seq, payload = frames
                replayed.append(int.from_bytes(seq, "big"))
                assert decode(payload) == dict(received)[replayed[-1]]
            last = received[-1][0]
            assert replayed == [s for s in (last - 1, last) if s >= 1]
            assert publisher.num_replays == 1
            dealer.close(linger=0)
        finally:
            task.cancel()
            replays.cancel()
            await asyncio.gather(task, replays, return_exceptions=True)
            sub.close(linger=0)
            ctx.term()
            publisher.close()

    asyncio.run(scenario())


def test_a_taken_endpoint_is_an_os_error() -> None:
    state, _ = _state()
    ctx = zmq.Context()
    holder = ctx.socket(zmq.PUB)
    port = holder.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(OSError, match=f"cannot bind KV events to tcp://127.0.0.1:{port}"):
            KvEventPublisher(state, ChangeNotifier(), endpoint=f"tcp://127.0.0.1:{port}")
    finally:
        holder.close(linger=0)
        ctx.term()


# -- the service ---------------------------------------------------------------------------------


def test_the_service_publishes_for_a_router(
    server_factory: Callable[..., RunningServer], tmp_path: Path
) -> None:
    from pagekeeper_client import PagekeeperClient

    server = server_factory(
        "--kv-events-endpoint", "tcp://127.0.0.1:0",
        "--kv-events-replay-endpoint", "tcp://127.0.0.1:0",
        "--kv-events-hash-format", "bytes", "--num-pages", "64", "--page-size", "16",
        "--durability", "none",
    )  # fmt: skip
    endpoint = server.info["kv_events_endpoint"]
    assert endpoint.startswith("tcp://127.0.0.1:") and not endpoint.endswith(":0")
    pool = server.http().get("/v1/pool").json()["kv_events"]
    assert pool["endpoint"] == endpoint and pool["hash_format"] == "bytes"
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    time.sleep(0.3)
    client = PagekeeperClient(server.grpc_address, local_socket=None)
    try:
        client.register("scheduler", name="router-test")
        prompt = list(range(1000, 1064))
        client.admit("a", prompt)
        client.admit("b", prompt + [1, 2])  # a hit: no new stored pages for the shared 64
        client.free_later("a", "b")
        client.step()
        # 60 of the 63 usable pages: the last fills evict a's cached pages.
        for i in range(4):
            client.admit(f"fill-{i}", list(range(10_000 * (i + 1), 10_000 * (i + 1) + 240)))
        events = []
        deadline = time.monotonic() + 10
        rest = server.http().get("/v1/events", params={"since": 0, "limit": 1000}).json()
        want = len(rest["events"])
        while len(events) < want + 1 and time.monotonic() < deadline:
            if sub.poll(200):
                _, _, payload = sub.recv_multipart()
                events.extend(decode(payload).events)
        assert len(events) == want + 1 and want > 0
        assert isinstance(events[0], AllBlocksCleared)  # opens the first batch
        for mine, theirs in zip(events[1:], rest["events"], strict=True):
            assert type(mine).__name__ == {
                "stored": "BlockStored", "removed": "BlockRemoved", "all_cleared":
                "AllBlocksCleared",
            }[theirs["type"]]  # fmt: skip
            if isinstance(mine, BlockStored | BlockRemoved):
                assert [h.hex() for h in mine.block_hashes] == theirs["page_hashes"]  # type: ignore[union-attr]
                assert mine.group_idx == theirs["group_id"]
            if isinstance(mine, BlockStored):
                assert mine.token_ids == theirs["token_ids"] and mine.block_size == 16
        assert any(isinstance(e, BlockRemoved) for e in events)
        metrics = server.http().get("/metrics").text
        assert f"pagekeeper_kv_events_zmq_events_total {float(want)}" in metrics
    finally:
        client.close()
        sub.close(linger=0)
        ctx.term()


def test_extra_keys_reach_routers_watchers_and_rest(
    server_factory: Callable[..., RunningServer],
) -> None:
    """A LoRA request with a salt and an image: its stored pages' keys go out over ZeroMQ
    (vLLM's per-page form), ``WatchEvents`` and ``/v1/events`` (the request's keys and the
    event's first page)."""
    from pagekeeper_client import PagekeeperClient
    from pagekeeper_client.types import ExtraKeys as ClientKeys
    from pagekeeper_client.types import MultiModalKey as ClientMM

    server = server_factory(
        "--kv-events-endpoint", "tcp://127.0.0.1:0", "--num-pages", "64", "--page-size", "16",
        "--durability", "none",
    )  # fmt: skip
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(server.info["kv_events_endpoint"])
    time.sleep(0.3)
    client = PagekeeperClient(server.grpc_address, local_socket=None)
    try:
        client.register("scheduler", name="keys-test")
        keys = ClientKeys(
            lora_name="adapter",
            lora_path="/a",
            mm_inputs=(ClientMM("img", 20, 20),),
            cache_salt="s",
        )
        client.admit("k", list(range(64)), extra_keys=keys)
        client.admit("plain", list(range(100, 132)))
        client.step()
        stored: list[BlockStored] = []
        deadline = time.monotonic() + 10
        while len(stored) < 2 and time.monotonic() < deadline:
            if sub.poll(200):
                _, _, payload = sub.recv_multipart()
                stored += [e for e in decode(payload).events if isinstance(e, BlockStored)]
        # Decoded, the (identifier, offset) pairs are lists (msgpack has only arrays).
        decoded = [("adapter", "s"), ("adapter", ["img", 4]), ("adapter", ["img", -12])]
        assert [e.extra_keys for e in stored] == [[*decoded, ("adapter",)], [None, None]]
        rest = server.http().get("/v1/events", params={"since": 0}).json()["events"]
        assert rest[0]["extra_keys"] == {
            "lora_name": "adapter", "lora_path": "/a", "cache_salt": "s",
            "mm_inputs": [{"identifier": "img", "offset": 20, "length": 20}],
        }  # fmt: skip
        assert rest[0]["first_page_index"] == 0
        assert rest[1]["extra_keys"] is None and rest[1]["first_page_index"] == 0
        with client.watch_events(0) as stream:
            batch = next(iter(stream))
        first, second = batch.events[:2]
        assert first.extra_keys == keys and first.first_page_index == 0  # type: ignore[union-attr]
        assert second.extra_keys is None  # type: ignore[union-attr]
    finally:
        client.close()
        sub.close(linger=0)
        ctx.term()


def test_the_first_batches_announce_the_cache_the_state_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A publisher started on a state that already holds events (a recovered pool) sends a
    clear, then stored events for exactly the cached pages its buffer tells of (each once,
    none evicted since), in batches that leave the loop to the calls, then what follows."""
    monkeypatch.setattr(kvevents, "_EVENTS_PER_READ", 8)  # batches of 8 events
    state, client = _state()
    for i in range(30):  # 64 pages: later prompts evict earlier ones' cached pages
        prompt = np.arange(1, 41, dtype=np.int32) + 1_000 * (i % 12)
        _step(state, client, 2 * i + 1, admissions=(Admission(f"r{i}", prompt),))
        _step(state, client, 2 * i + 2, frees=(f"r{i}",))
    held = state.events_since(0, 100_000).events
    assert any(isinstance(e, PageRemoved) for e in held)
    told = {(e.group_id, h) for e in held if isinstance(e, PageStored) for h in e.page_hashes}
    cached = {key for key in told if state.is_cached(*key)}
    assert 0 < len(cached) < len(told)
    backlog = kvevents.cached_pages_events(state)
    announced = [(e.group_id, h) for e in backlog for h in e.page_hashes]
    assert len(announced) == len(set(announced)) and set(announced) == cached
    for event in backlog:  # each as it was stored, or a run of it with its own parent
        assert len(event.token_ids) == len(event.page_hashes) * event.page_size
    last_before = state.last_event_seq

    async def scenario() -> list[list[object]]:
        notifier = ChangeNotifier()
        state.add_listener(notifier.notify)
        publisher = KvEventPublisher(state, notifier, endpoint="tcp://127.0.0.1:0")
        sent: list[list[object]] = []
        publisher._send = lambda events, n: sent.append(list(events))  # type: ignore[method-assign]
        turns = 0

        async def other_calls() -> None:
            nonlocal turns
            while True:
                turns += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(publisher.run())
        other = asyncio.create_task(other_calls())
        try:
            await asyncio.sleep(0.2)
            assert len(sent) == -(-len(backlog) // 8) and turns >= 2
            assert publisher.num_reannounced == len(backlog) and publisher.num_events == 0
            prompt = np.arange(1, 9, dtype=np.int32) + 900_000
            _step(state, client, 1_000, admissions=(Admission("late", prompt),))
            await asyncio.sleep(0.05)
        finally:
            task.cancel()
            other.cancel()
            await asyncio.gather(task, other, return_exceptions=True)
            publisher.close()
        return sent

    sent = asyncio.run(scenario())
    specs = group_specs(state.pool_config)
    events = [e for batch in sent for e in batch]
    later = state.events_since(last_before, 100).events
    assert later and events == [
        AllBlocksCleared(),
        *to_vllm_events(backlog, "int", specs),
        *to_vllm_events(later, "int", specs),
    ]


def test_the_announced_cache_is_cut_where_pages_left_it() -> None:
    """A stored run whose middle page was evicted goes out as two runs, the second with its
    own parent, tokens, pages and first page; a hash stored twice goes out once; removed
    and cleared pages not at all."""
    h = [bytes([i]) * 32 for i in range(8)]
    keys = ExtraKeys(lora_name="l", cache_salt="s")
    buffer = [
        PageStored(1, 0, tuple(h[:4]), None, TokenRun(range(16)), 4, (1, 2, 3, 4), "l", keys),
        PageRemoved(2, 0, (h[1],), (2,)),
        PageStored(3, 0, (h[0], h[4]), b"p", TokenRun(range(8)), 4, (5, 6), None, None, 7),
        AllCleared(4),
        PageStored(5, 0, (h[5],), h[4], TokenRun(range(4)), 4, (9,), None, None, 2),
        # A leading null page's tokens too (12 for 2 pages): cannot be cut, so h[6] waits
        # for the next event that stores it.
        PageStored(6, 0, (h[6], h[7]), None, TokenRun(range(12)), 4, (10, 11), None),
        PageStored(7, 0, (h[6],), None, TokenRun(range(4)), 4, (12,), None),
    ]

    class Held:
        last_event_seq = 7

        def event_buffer(self) -> tuple[int, int, int]:
            return len(buffer), 0, 1

        def events_since(self, since: int, limit: int) -> object:
            return dataclasses.make_dataclass("Page", ["events"])(buffer[since : since + limit])

        def is_cached(self, group: int, page_hash: bytes) -> bool:
            return page_hash in (h[0], h[2], h[3], h[4], h[6])

    out = kvevents.cached_pages_events(Held())  # type: ignore[arg-type]
    assert [(e.page_hashes, e.parent_page_hash, e.page_ids, e.first_page) for e in out] == [
        ((h[0],), None, (1,), 0),
        ((h[2], h[3]), h[1], (3, 4), 2),
        ((h[4],), h[0], (6,), 8),
        ((h[6],), None, (12,), 0),
    ]
    assert [list(e.token_ids) for e in out] == [
        [0, 1, 2, 3], list(range(8, 16)), [4, 5, 6, 7], [0, 1, 2, 3]
    ]  # fmt: skip
    # Each run keeps the keys that fall on it: the salt only with page 0.
    assert out[0].extra_keys == keys and out[1].extra_keys == ExtraKeys(lora_name="l")


def test_a_restarted_service_re_announces_its_recovered_cache(
    server_factory: Callable[..., RunningServer], tmp_path: Path
) -> None:
    """Stopped and started again on its data dir, the service's first KV-event batch is a
    clear, then stored events for the cached pages its recovered buffer tells of: a router
    that replays from seq 0 knows the recovered cache's pages."""
    from pagekeeper_client import PagekeeperClient

    flags = (
        "--num-pages", "64", "--page-size", "16", "--data-dir", str(tmp_path / "data"),
        "--kv-events-endpoint", "tcp://127.0.0.1:0",
        "--kv-events-replay-endpoint", "tcp://127.0.0.1:0", "--kv-events-hash-format", "bytes",
    )  # fmt: skip
    first = server_factory(*flags)
    client = PagekeeperClient(first.grpc_address, local_socket=None)
    try:
        client.register("scheduler", name="before")
        client.admit("a", list(range(1000, 1064)))
        client.admit("b", list(range(2000, 2100)))
        client.free_later("a")
        client.step()
    finally:
        client.close()
    before = first.http().get("/v1/events", params={"since": 0}).json()["events"]
    assert first.stop() == 0
    second = server_factory(*flags)
    assert second.http().get("/v1/events", params={"since": 0}).json()["events"] == before
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    try:
        dealer.connect(second.info["kv_events_replay_endpoint"])
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        events = []
        while True:
            assert dealer.poll(10_000)
            _, _, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                break
            events.extend(decode(payload).events)
    finally:
        dealer.close(linger=0)
        ctx.term()
    assert isinstance(events[0], AllBlocksCleared)
    assert len(events) == len(before) + 1
    for mine, theirs in zip(events[1:], before, strict=True):
        assert isinstance(mine, BlockStored) and theirs["type"] == "stored"
        assert [h.hex() for h in mine.block_hashes] == theirs["page_hashes"]
        assert mine.token_ids == theirs["token_ids"]


def test_a_bad_kv_events_endpoint_stops_start_up(tmp_path: Path) -> None:
    from tests.helpers.server import clean_env, server_command

    result = subprocess.run(
        server_command(tmp_path / "ready.json", ["--kv-events-endpoint", "tcp://h:99999"]),
        env=clean_env({"PAGEKEEPER_DURABILITY": "none"}),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "server.kv_events_endpoint: must be tcp://HOST:PORT" in result.stderr


def test_int_hashes_are_the_low_64_bits_of_any_digest() -> None:
    from pagekeeper.kvevents import _int_hash, _int_hashes

    rng = np.random.default_rng(5)
    for size in (32, 16, 8):
        digests = [rng.bytes(size) for _ in range(50)]
        expected = [int.from_bytes(d, "big") & ((1 << 64) - 1) for d in digests]
        assert _int_hashes(digests) == expected == [_int_hash(d) for d in digests]
    mixed = [rng.bytes(32), rng.bytes(12), rng.bytes(5)]  # the per-digest fallback
    assert _int_hashes(mixed) == [int.from_bytes(d, "big") & ((1 << 64) - 1) for d in mixed]
    assert _int_hashes([]) == []


def _subscribe(
    publisher: KvEventPublisher,
) -> tuple[zmq.Context[zmq.Socket[bytes]], zmq.Socket[bytes]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(publisher.endpoint)
    time.sleep(0.2)
    return ctx, sub


def _drain(sub: zmq.Socket[bytes]) -> list[tuple[int, KVEventBatch]]:
    out = []
    while sub.poll(300):
        _, seq, payload = sub.recv_multipart()
        out.append((int.from_bytes(seq, "big"), decode(payload)))
    return out


def test_events_the_buffer_dropped_clear_the_view() -> None:
    """Events trimmed from the service's buffer before they went out: the next batch opens
    with AllBlocksCleared, so no subscriber keeps pages the pool may no longer have."""
    state = ServiceState(
        PoolConfig(num_pages=256, groups=(GroupConfig(page_size=4),), max_model_len=64),
        Limits(event_buffer_size=4),
    )
    client = state.register(RegisterCommand(now=0.0, role=ClientRole.SCHEDULER)).client_id
    publisher = KvEventPublisher(state, ChangeNotifier(), endpoint="tcp://127.0.0.1:0")
    ctx, sub = _subscribe(publisher)
    try:
        prompt = np.arange(1, 9, dtype=np.int32)
        _step(state, client, 1, admissions=(Admission("r0", prompt),))
        assert publisher.publish_pending() == 1
        admissions = tuple(Admission(f"r{i}", prompt + 100 * i) for i in range(1, 11))
        _step(state, client, 2, admissions=admissions)  # 10 events: 6 trimmed unsent
        assert publisher.publish_pending() == 4
        assert publisher.num_lost_events == 6
        batches = _drain(sub)
        assert [s for s, _ in batches] == [0, 1]
        first, second = batches[0][1].events, batches[1][1].events
        assert isinstance(first[0], AllBlocksCleared) and len(first) == 2  # start-up clear
        assert isinstance(second[0], AllBlocksCleared) and len(second) == 5
        assert all(isinstance(e, BlockStored) for e in second[1:])
    finally:
        sub.close(linger=0)
        ctx.term()
        publisher.close()


def test_large_backlogs_go_out_in_batches_and_replay_keeps_a_bounded_buffer(
    tmp_path: Path,
) -> None:
    state = ServiceState(
        PoolConfig(num_pages=8192, groups=(GroupConfig(page_size=4),), max_model_len=64),
        Limits(max_requests_per_step=1024),
    )
    client = state.register(RegisterCommand(now=0.0, role=ClientRole.SCHEDULER)).client_id
    publisher = KvEventPublisher(
        state,
        ChangeNotifier(),
        endpoint="tcp://127.0.0.1:0",
        replay_endpoint=f"ipc://{tmp_path}/replay",
        buffer_bytes=100_000,
    )
    no_replay = KvEventPublisher(state, ChangeNotifier(), endpoint="tcp://127.0.0.1:0")
    ctx, sub = _subscribe(publisher)
    try:
        for step in range(5):  # 5,000 admissions of one page: 5,000 stored events
            admissions = tuple(
                Admission(f"s{step}-{i}", np.array([step, i, 7, 7], dtype=np.int32))
                for i in range(1000)
            )
            _step(state, client, step + 1, admissions=admissions)
        assert publisher.publish_pending() == 5000
        batches = _drain(sub)
        assert [s for s, _ in batches] == [0, 1]  # 4,096 events a batch at most
        assert [len(b.events) for _, b in batches] == [4097, 904]  # + the start-up clear
        # The replay buffer holds at most buffer_bytes (the newest batch always stays).
        assert publisher.buffered_bytes == sum(len(p) for _, p in publisher.buffer)
        assert [s for s, _ in publisher.buffer] == [1]
        assert no_replay.publish_pending() == 5000 and not no_replay.buffer
    finally:
        sub.close(linger=0)
        ctx.term()
        publisher.close()
        no_replay.close()
    assert not (tmp_path / "replay").exists()  # the ipc socket file is removed on close


def test_endpoint_rules(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="must differ"):
        Settings(
            kv_events_endpoint="tcp://127.0.0.1:5", kv_events_replay_endpoint="tcp://127.0.0.1:5"
        )
    with pytest.raises(ConfigError, match="at most 107 bytes"):
        Settings(kv_events_endpoint="ipc:///" + "x" * 120)
    state, _ = _state()
    live = KvEventPublisher(state, ChangeNotifier(), endpoint=f"ipc://{tmp_path}/pub")
    try:
        with pytest.raises(OSError, match="a live socket is there"):
            KvEventPublisher(state, ChangeNotifier(), endpoint=f"ipc://{tmp_path}/pub")
    finally:
        live.close()


def test_malformed_replay_requests_change_nothing(tmp_path: Path) -> None:
    """Whatever a peer sends the ROUTER socket, the publisher goes on publishing and answers
    the next well-formed replay."""
    state, client = _state()

    async def scenario() -> None:
        notifier = ChangeNotifier()
        state.add_listener(notifier.notify)
        publisher = KvEventPublisher(
            state, notifier, endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0"
        )
        task = asyncio.create_task(publisher.run())
        replays = asyncio.create_task(publisher.serve_replays())
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(publisher.replay_endpoint or "")
        try:
            _step(state, client, 1, admissions=(Admission("a", np.arange(1, 21, dtype=np.int32)),))
            await asyncio.sleep(0.05)
            for frames in (
                [b""],
                [b"", b"1234567"],  # 7 bytes
                [b"", b"12345678", b"extra"],
                [b"x" * 100_000],
                [b"", b"\xff" * 8],  # a start past every batch
            ):
                dealer.send_multipart(frames)
            await asyncio.sleep(0.2)
            # The start past every batch was well-formed: just the end marker came back.
            assert await asyncio.to_thread(dealer.poll, 2000)
            assert dealer.recv_multipart() == [b"", b"", END_SEQ, b""]
            assert not await asyncio.to_thread(dealer.poll, 200)
            _step(state, client, 2, frees=("a",))
            await asyncio.sleep(0.05)
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            seqs = []
            while True:
                assert await asyncio.to_thread(dealer.poll, 2000)
                frames = dealer.recv_multipart()
                if frames[2] == END_SEQ:
                    break
                seqs.append(int.from_bytes(frames[2], "big"))
            assert seqs == list(range(publisher.next_seq)) and seqs
            assert not task.done() and not replays.done()
            assert publisher.num_replays == 2
        finally:
            task.cancel()
            replays.cancel()
            await asyncio.gather(task, replays, return_exceptions=True)
            dealer.close(linger=0)
            ctx.term()
            publisher.close()

    asyncio.run(scenario())
