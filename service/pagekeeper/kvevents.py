"""KV events over ZeroMQ in vLLM's wire format, for routers built for vLLM engines.

vLLM's engines publish their prefix-cache changes with a ZeroMQ PUB socket: each message is
three frames — the topic, the batch's sequence number (8 bytes, big-endian, from 0), and a
msgpack-encoded ``KVEventBatch`` ``[ts, events, data_parallel_rank]`` whose events are
maps tagged by ``type``: ``BlockStored`` (``block_hashes``, ``parent_block_hash``,
``token_ids``, ``block_size``, ``lora_id``, ``medium``, ``lora_name``, ``extra_keys``,
``group_idx``, ``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``),
``BlockRemoved`` (``block_hashes``, ``medium``, ``group_idx``) and ``AllBlocksCleared``.
An optional ROUTER socket answers a replay request (an 8-byte big-endian start sequence)
with every kept batch from there on, each as ``[topic, seq, payload]``, then an end marker
``[b"", -1, b""]``. KV-aware routers (NVIDIA Dynamo's, llm-d's) subscribe to that.

:class:`KvEventPublisher` publishes the service's own KV events the same way, so such a
router subscribes to a pagekeeper pool as it would to the engine that owns it. The structs
below have vLLM 0.33's names, order and types, and decode alike with its own decoder
(``tests/service/test_kvevents.py`` runs it where vLLM is installed; the bytes differ
only where msgspec picks a shorter map header for the fields left out). Hashes are the low
64 bits of each page hash as an int (vLLM's default) or the whole digest
(``hash_format="bytes"``). A batch holds the events that arrived since the previous one:
those of one step, or of several when steps come faster than the loop gets round to
publishing. ``extra_keys`` is vLLM's per-page list (LoRA name, ``(mm identifier,
offset)`` pairs, cache salt, untagged as vLLM publishes them; None for a page without);
``lora_id`` is always null (pagekeeper knows adapters by name: ``lora_name``).

A subscriber's view must never hold pages the pool no longer has. So the first batch after
start-up opens with an ``AllBlocksCleared`` (whatever a router learned from an earlier run
is void: the events of that run's last moments may not have gone out, and sequence numbers
restart at 0 as vLLM's do), and so does the first batch after events the publisher could
not send (the service's event buffer dropped them: a single step past
``event_buffer_bytes``): the view then only lacks pages, which costs a router some hits,
never a wrong route. A pool recovered from its data directory keeps its cache and its event
buffer: after the clear go ``stored`` events for the cached pages the buffer tells of
(:func:`cached_pages_events`: its stored events cut down to the pages still cached, each
hash once), so a router re-learns them at once, and whatever prefix of those batches it has
seen is a subset of the cache; pages stored before the buffer's reach
(``event_buffer_bytes``) are learned again only as they are stored anew.

The sockets are bound (never connected): routers connect to the service. PUB drops
batches for a subscriber that falls more than ``hwm`` behind, as vLLM's does; a subscriber
tells from the sequence numbers, and replays.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec
import numpy as np
import zmq
import zmq.asyncio
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from pagekeeper.core.config import GroupKind, PoolConfig
from pagekeeper.core.events import AllCleared, PageRemoved, PageStored, TokenRun
from pagekeeper.core.hashing import input_pages, narrow_extra_keys
from pagekeeper.files import clear_stale_socket
from pagekeeper.notify import ChangeNotifier
from pagekeeper.settings import Settings
from pagekeeper.state import ServiceState

log = logging.getLogger("pagekeeper")

MEDIUM_GPU = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_EVENTS_PER_READ = 4096
_BATCHES_PER_TURN = 4
_LOW_64 = (1 << 64) - 1


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """The tag (``"type"``) is the class name, as vLLM's."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def _token_list(token_ids: Sequence[int]) -> list[int]:
    return token_ids.tolist() if isinstance(token_ids, TokenRun) else list(token_ids)


def _int_hash(digest: bytes) -> int:
    return int.from_bytes(digest, "big") & _LOW_64


def _int_hashes(digests: Sequence[bytes]) -> list[int | bytes]:
    """Each digest's low 64 bits (its last 8 bytes, big-endian); a long list in one numpy
    pass when all are one length that is a multiple of 8 (every page hash algorithm's are)."""
    if len(digests) < 16:  # a decode's one page: numpy's fixed cost would dominate
        return [_int_hash(h) for h in digests]
    size = len(digests[0])
    joined = b"".join(digests)
    if size % 8 == 0 and len(joined) == size * len(digests):
        words = size // 8
        ints: list[int | bytes] = np.frombuffer(joined, dtype=">u8")[words - 1 :: words].tolist()
        return ints
    return [_int_hash(h) for h in digests]


# vLLM's KVCacheSpecKind values for pagekeeper's group kinds.
_SPEC_KINDS = {
    GroupKind.FULL: "full_attention",
    GroupKind.SLIDING_WINDOW: "sliding_window",
    GroupKind.CHUNKED_LOCAL: "chunked_local_attention",
    GroupKind.MAMBA: "mamba",
}


def group_specs(pool: PoolConfig) -> tuple[tuple[str, int | None], ...]:
    """Per group, what vLLM puts in ``kv_cache_spec_kind`` and ``..._sliding_window``."""
    return tuple(
        (_SPEC_KINDS[g.kind], g.window if g.kind is GroupKind.SLIDING_WINDOW else None)
        for g in pool.groups
    )


def vllm_extra_keys(event: PageStored) -> list[tuple[Any, ...] | None]:
    """The event's pages' extra keys as vLLM publishes them (``to_event_extra_keys``): per
    page, None or a tuple, untagged — a LoRA as its name, a multimodal input as
    ``(identifier, offset in the page)``, a salt as itself (a page without any: None, so a
    request without keys sends a list of Nones, as vLLM does)."""
    keys, n = event.extra_keys, len(event.page_hashes)
    if keys is None:
        return [None] * n
    # Most pages carry the LoRA alone (or nothing): one shared tuple; then the pages an
    # image overlaps, and page 0's salt (what run_extra_keys gives, untagged, without a
    # tuple built and taken apart per page: a LoRA request's 125-page event cost 0.07 ms).
    lora: tuple[Any, ...] = () if keys.lora_name is None else (keys.lora_name,)
    out: list[tuple[Any, ...] | None] = [lora or None] * n
    first, ps = event.first_page, event.page_size
    special: dict[int, list[Any]] = {}
    for mm in keys.mm_inputs:
        for page in input_pages(mm.offset, mm.offset + mm.length, first, first + n, ps):
            special.setdefault(page, [*lora]).append((mm.identifier, mm.offset - page * ps))
    if first == 0 and keys.cache_salt:
        special.setdefault(0, [*lora]).append(keys.cache_salt)
    for page, items in special.items():
        out[page - first] = tuple(items)
    return out


def to_vllm_events(
    events: Sequence[PageStored | PageRemoved | AllCleared],
    hash_format: str = "int",
    specs: Sequence[tuple[str, int | None]] = (),
) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
    """pagekeeper's events as vLLM's event structs (``specs``: :func:`group_specs`)."""
    as_int = hash_format == "int"
    out: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    for event in events:
        if isinstance(event, PageStored):
            parent = event.parent_page_hash
            out.append(
                BlockStored(
                    block_hashes=_int_hashes(event.page_hashes)
                    if as_int
                    else list(event.page_hashes),
                    parent_block_hash=None
                    if parent is None
                    else (_int_hash(parent) if as_int else parent),
                    token_ids=_token_list(event.token_ids),
                    block_size=event.page_size,
                    lora_id=None,
                    medium=MEDIUM_GPU,
                    lora_name=event.lora_name,
                    extra_keys=vllm_extra_keys(event),
                    group_idx=event.group_id,
                    kv_cache_spec_kind=specs[event.group_id][0] if specs else None,
                    kv_cache_spec_sliding_window=specs[event.group_id][1] if specs else None,
                )
            )
        elif isinstance(event, PageRemoved):
            out.append(
                BlockRemoved(
                    block_hashes=_int_hashes(event.page_hashes)
                    if as_int
                    else list(event.page_hashes),
                    medium=MEDIUM_GPU,
                    group_idx=event.group_id,
                )
            )
        else:
            out.append(AllBlocksCleared())
    return out


def cached_pages_events(state: ServiceState) -> list[PageStored]:
    """``stored`` events for the cached pages the state's event buffer tells of: every
    stored event it holds, in order, cut down to the pages still cached under their hash
    (each hash once), split where pages were cut out (a run's parent is the page before
    it). What a router that starts empty may learn of a recovered pool: whatever prefix of
    it arrives, its view is a subset of the cache (removals and clears in the buffer are
    already applied by leaving those pages out). Pages stored before the buffer's reach
    are not in it."""
    first = state.event_buffer()[2]
    held = state.events_since(first - 1, max(0, state.last_event_seq - first + 1)).events
    announced: set[tuple[int, bytes]] = set()
    out: list[PageStored] = []
    for event in held:
        if type(event) is not PageStored:
            continue
        group, hashes = event.group_id, event.page_hashes
        keep = [(group, h) not in announced and state.is_cached(group, h) for h in hashes]
        if not any(keep):
            continue
        ps = event.page_size
        whole = all(keep)
        if not whole and len(event.token_ids) != len(hashes) * ps:
            # A run with null pages left out (never seen): its tokens cannot be cut per
            # page; its pages stay unannounced here (a later event may announce them).
            continue
        announced.update((group, h) for h, k in zip(hashes, keep, strict=True) if k)
        if whole:
            out.append(event)
            continue
        a = 0
        while a < len(hashes):
            if not keep[a]:
                a += 1
                continue
            b = a
            while b < len(hashes) and keep[b]:
                b += 1
            keys = event.extra_keys
            out.append(
                dataclasses.replace(
                    event,
                    page_hashes=hashes[a:b],
                    parent_page_hash=hashes[a - 1] if a else event.parent_page_hash,
                    token_ids=event.token_ids[a * ps : b * ps],
                    page_ids=event.page_ids[a:b],
                    extra_keys=None
                    if keys is None
                    else narrow_extra_keys(keys, event.first_page + a, b - a, ps),
                    first_page=event.first_page + a,
                )
            )
            a = b
    return out


class KvEventPublisher:
    """Publishes the state's KV events on a PUB socket and answers replays on a ROUTER one.

    :meth:`run` (a task on the service's loop) first sends the cache the state's event
    buffer tells of at start-up (a recovered pool's), then follows the buffer. Sockets are
    bound in the constructor (raises OSError naming the endpoint when one cannot be);
    :attr:`endpoint` / :attr:`replay_endpoint` are the bound ones (port 0 resolved)."""

    def __init__(
        self,
        state: ServiceState,
        notifier: ChangeNotifier,
        *,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        hash_format: str = "int",
        buffer_steps: int = 10_000,
        data_parallel_rank: int = 0,
        hwm: int = 100_000,
        buffer_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        self.state = state
        self.notifier = notifier
        self.topic = topic.encode()
        self.hash_format = hash_format
        self.data_parallel_rank = data_parallel_rank
        self.specs = group_specs(state.pool_config)
        # Kept for replays only (none without a replay socket): the last buffer_steps
        # batches, and at most buffer_bytes of them.
        self.buffer: deque[tuple[int, bytes]] = deque()
        self.buffer_steps = buffer_steps if replay_endpoint is not None else 0
        self.buffer_bytes = buffer_bytes
        self.buffered_bytes = 0
        self.next_seq = 0
        self.num_events = 0
        self.num_lost_events = 0
        self.num_replays = 0
        self.num_reannounced = 0
        self._since = state.last_event_seq
        # A recovered pool's cache, as far as its event buffer tells (after the clear that
        # voids what routers knew of an earlier run): sent before the events that follow.
        self._backlog: deque[PageStored] = deque(cached_pages_events(state))
        self._needs_clear = True
        self._encoder = msgspec.msgpack.Encoder()
        self._ipc_paths: list[str] = []
        # PUB is a plain socket (its sends never wait, and need no loop); the ROUTER one
        # awaits requests on the loop, through an asyncio view of the same context.
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.asyncio.Socket | None = None
        try:
            self._pub.set_hwm(hwm)
            self.endpoint = self._bind(self._pub, endpoint)
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._replay = zmq.asyncio.Context.shadow(self._ctx).socket(zmq.ROUTER)
                # A whole replay plus its end marker fits in the queue of a slow reader, and
                # a reader gone mid-replay is an error (EHOSTUNREACH), not silent drops.
                self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
                self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
                self.replay_endpoint = self._bind(self._replay, replay_endpoint)
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_settings(
        cls, settings: Settings, state: ServiceState, notifier: ChangeNotifier
    ) -> KvEventPublisher | None:
        if settings.kv_events_endpoint is None:
            return None
        return cls(
            state,
            notifier,
            endpoint=settings.kv_events_endpoint,
            replay_endpoint=settings.kv_events_replay_endpoint,
            topic=settings.kv_events_topic,
            hash_format=settings.kv_events_hash_format,
            buffer_steps=settings.kv_events_buffer_steps,
            data_parallel_rank=settings.kv_events_data_parallel_rank,
            buffer_bytes=settings.event_buffer_bytes,
        )

    # -- publishing -------------------------------------------------------------------------
    def publish_pending(self, max_batches: int | None = None) -> int:
        """Publish the events since the last batch (one batch per 4,096; at most
        ``max_batches`` of them); returns how many of the service's events went out."""
        state = self.state
        count = 0
        reads = 0
        backlog = self._backlog
        while backlog and (max_batches is None or reads < max_batches):
            reads += 1
            chunk = [backlog.popleft() for _ in range(min(len(backlog), _EVENTS_PER_READ))]
            self._send(self._converted(chunk), 0)
            self.num_reannounced += len(chunk)
        while state.last_event_seq != self._since:
            if max_batches is not None and reads >= max_batches:
                break
            reads += 1
            page = state.events_since(self._since, _EVENTS_PER_READ)
            if page.fell_behind:
                # The buffer dropped events this publisher had not sent: a router's view
                # would keep pages the pool no longer has. It is cleared instead.
                lost = page.first_retained_seq - 1 - self._since
                self.num_lost_events += lost
                log.warning(
                    "KV-event publisher fell behind by %d events: subscribers are told to "
                    "clear their view (AllBlocksCleared)",
                    lost,
                )
                self._since = page.first_retained_seq - 1
                self._needs_clear = True
                continue
            if not page.events:
                break
            self._send(self._converted(page.events), len(page.events))
            self._since = page.events[-1].seq
            count += len(page.events)
        return count

    def _converted(
        self, events: Sequence[PageStored | PageRemoved | AllCleared]
    ) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
        """The next batch's events as vLLM's structs, after the clear when one is due: in
        the batch with the events that follow it, so a subscriber that connects (or
        reconnects) after start-up gets it with its first batch."""
        out = to_vllm_events(events, self.hash_format, self.specs)
        if self._needs_clear:
            self._needs_clear = False
            out.insert(0, AllBlocksCleared())
        return out

    def _send(self, events: list[BlockStored | BlockRemoved | AllBlocksCleared], n: int) -> None:
        batch = KVEventBatch(
            ts=time.time(), events=list(events), data_parallel_rank=self.data_parallel_rank
        )
        payload = self._encoder.encode(batch)
        seq = self.next_seq
        # PUB never blocks: past its high-water mark a slow subscriber's copy is dropped.
        self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
        self.next_seq = seq + 1
        self.num_events += n
        if self.buffer_steps:
            buffer = self.buffer
            buffer.append((seq, payload))
            self.buffered_bytes += len(payload)
            while len(buffer) > self.buffer_steps or (
                self.buffered_bytes > self.buffer_bytes and len(buffer) > 1
            ):
                self.buffered_bytes -= len(buffer.popleft()[1])

    async def run(self) -> None:
        """Publish as events arrive, until cancelled."""
        notifier = self.notifier
        while True:
            version = notifier.version
            self.publish_pending(_BATCHES_PER_TURN)
            if self._backlog or self.state.last_event_seq != self._since:
                # A long backlog (a recovered pool's buffer) leaves the loop to the calls
                # between its batches.
                await asyncio.sleep(0)
                continue
            await notifier.wait(version)

    # -- replay -------------------------------------------------------------------------------
    async def serve_replays(self) -> None:
        """Answer replay requests until cancelled (nothing to do without a replay socket)."""
        replay = self._replay
        if replay is None:
            return
        while True:
            frames = await replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("ignored a malformed KV-event replay request (%d frames)", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            self.num_replays += 1
            try:
                for k, (seq, payload) in enumerate(list(self.buffer)):
                    if seq >= start_seq:
                        await replay.send_multipart(
                            (client, b"", self.topic, seq.to_bytes(8, "big"), payload)
                        )
                    if k % 64 == 63:
                        await asyncio.sleep(0)  # a long replay leaves the loop to the steps
                await replay.send_multipart((client, b"", b"", END_SEQ, b""))
            except zmq.ZMQError as exc:  # that subscriber went away: the next one is served
                log.warning("a KV-event replay was cut short: %s", exc)

    def close(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()
        for path in self._ipc_paths:
            with contextlib.suppress(OSError):
                os.unlink(path)

    def _bind(self, sock: zmq.Socket[Any], endpoint: str) -> str:
        """Bind ``endpoint``; the bound one comes back (a tcp port of 0 resolved). An ipc
        path a live socket answers on is refused (zmq would silently take it over), and one
        a dead process left is cleared."""
        if endpoint.startswith("tcp://"):
            host = endpoint[len("tcp://") :].rpartition(":")[0]
            if ":" in host.strip("[]"):
                sock.setsockopt(zmq.IPV6, 1)
        else:
            if clear_stale_socket(endpoint[len("ipc://") :], "the KV-event ipc path"):
                raise OSError(f"cannot bind KV events to {endpoint}: a live socket is there")
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            raise OSError(f"cannot bind KV events to {endpoint}: {exc}") from None
        if not endpoint.startswith("tcp://"):
            self._ipc_paths.append(endpoint[len("ipc://") :])
            return endpoint
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)


class KvEventCollector(Collector):
    """The publisher's counters, read at scrape time."""

    def __init__(self, publisher: KvEventPublisher) -> None:
        self.publisher = publisher

    def collect(self) -> Iterator[Metric]:
        p = self.publisher
        for name, doc, value in (
            ("batches", "KV-event batches published on the ZeroMQ socket.", p.next_seq),
            ("events", "KV events in those batches.", p.num_events),
            (
                "lost_events",
                "KV events the buffer dropped before the publisher sent them.",
                p.num_lost_events,
            ),
            ("replays", "Replay requests answered.", p.num_replays),
            (
                "reannounced_events",
                "Stored events sent at start-up for the cache a recovered pool's event buffer "
                "tells of.",
                p.num_reannounced,
            ),
        ):
            yield CounterMetricFamily(f"pagekeeper_kv_events_zmq_{name}", doc, value=value)


async def run_publisher(publisher: KvEventPublisher) -> None:
    """The publisher's two loops as one task."""
    await asyncio.gather(publisher.run(), publisher.serve_replays())


__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEventBatch",
    "KvEventCollector",
    "KvEventPublisher",
    "run_publisher",
    "to_vllm_events",
]
