"""KV events over ZeroMQ in vLLM's wire format, for routers built for vLLM engines.

vLLM's engines publish their prefix-cache changes with a ZeroMQ PUB socket: each message is
three frames — the topic, the batch's sequence number (8 bytes, big-endian, from 0), and a
msgpack-encoded ``KVEventBatch`` ``[ts, events, data_parallel_rank]`` whose events are
maps tagged by ``type``: ``BlockStored`` (``block_hashes``, ``parent_block_hash``,
``token_ids``, ``block_size``, ``lora_id``, ``medium``, ``lora_name``, ``group_idx``),
``BlockRemoved`` (``block_hashes``, ``medium``, ``group_idx``) and ``AllBlocksCleared``.
An optional ROUTER socket answers a replay request (an 8-byte big-endian start sequence)
with every kept batch from there on, each as ``[topic, seq, payload]``, then an end marker
``[b"", -1, b""]``. KV-aware routers (NVIDIA Dynamo's, llm-d's) subscribe to that.

:class:`KvEventPublisher` publishes the service's own KV events the same way, so such a
router subscribes to a pagekeeper pool as it would to the engine that owns it. The structs
below encode to the same bytes as vLLM 0.33's (``tests/service/test_kvevents.py`` decodes
them with vLLM's own decoder where vLLM is installed). Hashes are the low 64 bits of each
page hash as an int (vLLM's default) or the whole digest (``hash_format="bytes"``). A batch
holds the events that arrived since the previous one: those of one step, or of several
when steps come faster than the loop gets round to publishing. ``extra_keys`` (vLLM's
per-block LoRA / multimodal / salt keys) are not sent: pagekeeper's events do not keep them.

The sockets are bound (never connected): routers connect to the service. PUB drops
batches for a subscriber that falls more than ``hwm`` behind, as vLLM's does; a subscriber
tells from the sequence numbers, and replays.
"""

from __future__ import annotations

import asyncio
import logging
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

from pagekeeper.core.events import AllCleared, PageRemoved, PageStored, TokenRun
from pagekeeper.notify import ChangeNotifier
from pagekeeper.settings import Settings
from pagekeeper.state import ServiceState

log = logging.getLogger("pagekeeper")

MEDIUM_GPU = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_EVENTS_PER_READ = 4096
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
    group_idx: int | None = None


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


def _int_hashes(digests: Sequence[bytes]) -> list[int]:
    """Each digest's low 64 bits (its last 8 bytes, big-endian), in one numpy pass when all
    are one length that is a multiple of 8 (every page hash algorithm's are)."""
    if not digests:
        return []
    size = len(digests[0])
    joined = b"".join(digests)
    if size % 8 == 0 and len(joined) == size * len(digests):
        words = size // 8
        ints: list[int] = np.frombuffer(joined, dtype=">u8")[words - 1 :: words].tolist()
        return ints
    return [_int_hash(h) for h in digests]


def to_vllm_events(
    events: Sequence[PageStored | PageRemoved | AllCleared], hash_format: str = "int"
) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
    """pagekeeper's events as vLLM's event structs."""
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
                    group_idx=event.group_id,
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


class KvEventPublisher:
    """Publishes the state's KV events on a PUB socket and answers replays on a ROUTER one.

    :meth:`run` (a task on the service's loop) follows the state's event buffer from the
    last event at start-up. Sockets are bound in the constructor (raises OSError naming
    the endpoint when one cannot be); :attr:`endpoint` / :attr:`replay_endpoint` are the
    bound ones (port 0 resolved)."""

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
    ) -> None:
        self.state = state
        self.notifier = notifier
        self.topic = topic.encode()
        self.hash_format = hash_format
        self.data_parallel_rank = data_parallel_rank
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.next_seq = 0
        self.num_events = 0
        self.num_lost_events = 0
        self.num_replays = 0
        self._since = state.last_event_seq
        self._encoder = msgspec.msgpack.Encoder()
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.asyncio.Socket | None = None
        try:
            self._pub.set_hwm(hwm)
            self.endpoint = _bind(self._pub, endpoint)
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                # A whole replay plus its end marker fits in the queue of a slow reader.
                self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
                self.replay_endpoint = _bind(self._replay, replay_endpoint)
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
        )

    # -- publishing -------------------------------------------------------------------------
    def publish_pending(self) -> int:
        """Publish every event since the last batch as one batch; returns how many."""
        state = self.state
        count = 0
        while True:
            page = state.events_since(self._since, _EVENTS_PER_READ)
            if page.fell_behind:
                # The buffer dropped events this publisher had not sent (only when the loop
                # was held past event_buffer_size events): counted, logged, skipped.
                lost = page.first_retained_seq - 1 - self._since
                self.num_lost_events += lost
                log.warning("KV-event publisher fell behind: %d events not published", lost)
                self._since = page.first_retained_seq - 1
                continue
            if not page.events:
                return count
            self._send(page.events)
            self._since = page.events[-1].seq
            count += len(page.events)
            if len(page.events) < _EVENTS_PER_READ:
                return count

    def _send(self, events: Sequence[PageStored | PageRemoved | AllCleared]) -> None:
        batch = KVEventBatch(
            ts=time.time(),
            events=to_vllm_events(events, self.hash_format),
            data_parallel_rank=self.data_parallel_rank,
        )
        payload = self._encoder.encode(batch)
        seq = self.next_seq
        # PUB never blocks: past its high-water mark a slow subscriber's copy is dropped.
        self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
        self.buffer.append((seq, payload))
        self.next_seq = seq + 1
        self.num_events += len(events)

    async def run(self) -> None:
        """Publish as events arrive, until cancelled."""
        notifier = self.notifier
        while True:
            version = notifier.version
            self.publish_pending()
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
                for seq, payload in list(self.buffer):
                    if seq >= start_seq:
                        await replay.send_multipart(
                            (client, b"", self.topic, seq.to_bytes(8, "big"), payload)
                        )
                await replay.send_multipart((client, b"", b"", END_SEQ, b""))
            except zmq.ZMQError as exc:  # that subscriber went away: the next one is served
                log.warning("a KV-event replay was cut short: %s", exc)

    def close(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()


def _bind(sock: zmq.Socket[Any], endpoint: str) -> str:
    """Bind ``endpoint``; the bound one comes back (a tcp port of 0 resolved)."""
    if endpoint.startswith("tcp://"):
        host = endpoint[len("tcp://") :].rpartition(":")[0]
        if ":" in host.strip("[]"):
            sock.setsockopt(zmq.IPV6, 1)
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise OSError(f"cannot bind KV events to {endpoint}: {exc}") from None
    bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return bound if endpoint.startswith("tcp://") else endpoint


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
