"""Snapshots of a :class:`~pagekeeper.core.manager.PageManager`: its whole state as a tree of
plain values, and back. Pure: no I/O, no encoding (the service's durability layer turns the
tree into bytes).

A snapshot is *exact*, not merely equivalent: restoring it gives a manager whose every
future answer is the one the original would have given, page for page. So it keeps what
decides future allocations, hits and evictions:

=====================  ==================================================================
free queue             its run ``buffer[head:tail]`` *with its holes* and both ends (the
                       order is the eviction policy; the positions decide re-centring)
ref counts, cached     per page (int32 / uint8 arrays)
prefix-cache index     per group, hash -> first page in insertion order, and the waiting
                       duplicates in their order (the next one takes over on eviction)
rows                   per group, every table row with its length and liveness, the
                       released-row heap as stored (rows are reused lowest first)
requests               in admission order: tokens, extra keys, owner, page hashes and the
                       computed / cached / scheduled counters
counters               event sequence number, evictions, allocated / freed totals, the
                       prefix-hit counters
=====================  ==================================================================

The tree holds only ``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes``, lists,
``str``-keyed dicts and numpy arrays; bulky per-request data is packed column-wise (one
array of all token ids plus lengths) so encoding it costs a handful of C calls, not one per
token.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Callable, Iterable, Sequence
from itertools import chain
from typing import Any

import numpy as np
import numpy.typing as npt

from pagekeeper.core.config import PoolConfig
from pagekeeper.core.errors import InvalidArgument, InvariantViolation
from pagekeeper.core.events import AllCleared, KVEvent, PageRemoved, PageStored, TokenRun
from pagekeeper.core.types import ExtraKeys, MultiModalKey

SNAPSHOT_VERSION = 1
"""Bumped whenever the tree's shape changes; :func:`restore_manager` refuses other versions."""

Tree = dict[str, Any]

_INT32_MAX = 2**31 - 1


# -- helpers ---------------------------------------------------------------------------------


def _ints(values: list[int] | npt.NDArray[Any]) -> npt.NDArray[np.int32] | npt.NDArray[np.int64]:
    """int32 when every value fits (always, in the service: ids are int32 on the wire),
    else int64."""
    array = np.asarray(values, dtype=np.int64)
    if array.size == 0 or (int(array.min()) >= -_INT32_MAX and int(array.max()) <= _INT32_MAX):
        return array.astype(np.int32)
    return array


def _narrow(array: npt.NDArray[np.int64]) -> npt.NDArray[np.int32] | npt.NDArray[np.int64]:
    """An int64 array as int32 when every value fits (halves token and page columns)."""
    if array.size == 0 or (int(array.min()) >= -_INT32_MAX and int(array.max()) <= _INT32_MAX):
        return array.astype(np.int32)
    return array


def _token_column(runs: Iterable[Sequence[int]]) -> npt.NDArray[Any]:
    """Token runs concatenated into one column: their packed bytes joined (a request's
    ``array('Q')``, an event's ``TokenRun``), not one int object per token; int32 when every
    id fits, as ``_narrow`` would, else unsigned 64-bit (any id the core accepts)."""
    return _token_array(_packed_runs(runs))


def _packed_runs(runs: Iterable[Sequence[int]]) -> bytes:
    """Token runs as one ``array('Q')``'s bytes."""
    return b"".join(
        run.tobytes()
        if type(run) is TokenRun or (type(run) is array and run.typecode == "Q")
        else _packed(run)
        for run in runs
    )


def _token_array(packed: bytes) -> npt.NDArray[Any]:
    column = np.frombuffer(packed, dtype=np.uint64)
    if column.size == 0 or int(column.max()) <= _INT32_MAX:
        return column.astype(np.int32)
    return column.copy()


def _packed(run: Sequence[int]) -> bytes:
    return array("Q", run).tobytes()


def _split(flat: npt.NDArray[Any], lengths: npt.NDArray[Any]) -> list[npt.NDArray[Any]]:
    """The inverse of concatenation: ``flat`` cut into pieces of ``lengths``."""
    if len(lengths) == 0:
        return []
    return np.split(flat, np.cumsum(lengths)[:-1])


def _bytes_list(values: Any) -> list[bytes]:
    out = list(values)
    if any(type(v) is not bytes for v in out):
        raise InvalidArgument("snapshot: expected a list of bytes")
    return out


def extra_keys_to_tree(extra: ExtraKeys) -> list[Any] | None:
    """``None`` for no extra keys, else ``[lora_name, lora_path, cache_salt, mm_inputs]``."""
    if extra == ExtraKeys():
        return None
    return [
        extra.lora_name,
        extra.lora_path,
        extra.cache_salt,
        [[m.identifier, m.offset, m.length] for m in extra.mm_inputs],
    ]


def extra_keys_from_tree(tree: list[Any] | None) -> ExtraKeys:
    if tree is None:
        return ExtraKeys()
    lora_name, lora_path, cache_salt, mm = tree
    return ExtraKeys(
        lora_name=lora_name,
        lora_path=lora_path,
        mm_inputs=tuple(MultiModalKey(str(i), int(o), int(n)) for i, o, n in mm),
        cache_salt=cache_salt,
    )


EVENTS_PER_CHUNK = 4096
"""Events turned into columns at a time by :func:`events_to_tree` (~2-3 ms of work here)."""


def events_to_tree(events: Sequence[KVEvent], pause: Callable[[], None] | None = None) -> Tree:
    """KV events column-wise (a full 65,536-event buffer is a dozen arrays and byte lists,
    built with C-level flattening, not one tagged value per field).

    Built ``EVENTS_PER_CHUNK`` events at a time, calling ``pause()`` after each chunk: a
    caller building it in a worker thread passes one that lets other threads run (a full
    buffer is ~40 ms of work, and C-level flattening keeps the interpreter's own switch
    from happening for milliseconds at a time). The result does not depend on the chunks."""
    kinds: list[str] = []
    seqs: list[npt.NDArray[np.int64]] = []
    groups: list[npt.NDArray[np.int32]] = []
    num_hashes: list[npt.NDArray[np.int32]] = []
    hashes: list[bytes] = []
    num_pages: list[npt.NDArray[np.int32]] = []
    pages: list[npt.NDArray[np.int64]] = []
    parents: list[bytes] = []
    num_tokens: list[npt.NDArray[np.int32]] = []
    tokens: list[bytes] = []
    page_sizes: list[npt.NDArray[np.int32]] = []
    loras: list[str | None] = []
    keys: list[list[Any] | None] = []
    first_pages: list[npt.NDArray[np.int32]] = []
    for start in range(0, len(events), EVENTS_PER_CHUNK):
        chunk = events[start : start + EVENTS_PER_CHUNK]
        kinds.append(
            "".join(
                "s" if kind is PageStored else "r" if kind is PageRemoved else "c"
                for kind in map(type, chunk)
            )
        )
        paged: list[Any] = [e for e in chunk if type(e) is not AllCleared]
        stored: list[PageStored] = [e for e in chunk if type(e) is PageStored]
        seqs.append(np.fromiter((e.seq for e in chunk), np.int64, len(chunk)))
        groups.append(np.fromiter((e.group_id for e in paged), np.int32, len(paged)))
        num_hashes.append(np.fromiter((len(e.page_hashes) for e in paged), np.int32, len(paged)))
        hashes.extend(chain.from_iterable(e.page_hashes for e in paged))
        num_pages.append(np.fromiter((len(e.page_ids) for e in paged), np.int32, len(paged)))
        pages.append(np.fromiter(chain.from_iterable(e.page_ids for e in paged), np.int64))
        parents.extend(e.parent_page_hash or b"" for e in stored)
        num_tokens.append(np.fromiter((len(e.token_ids) for e in stored), np.int32, len(stored)))
        tokens.append(_packed_runs(e.token_ids for e in stored))
        page_sizes.append(np.fromiter((e.page_size for e in stored), np.int32, len(stored)))
        loras.extend(e.lora_name for e in stored)
        keys.extend(
            None if e.extra_keys is None else extra_keys_to_tree(e.extra_keys) for e in stored
        )
        first_pages.append(np.fromiter((e.first_page for e in stored), np.int32, len(stored)))
        if pause is not None:
            pause()
    return {
        "kinds": "".join(kinds),
        "seqs": _joined(seqs, np.int64),
        "groups": _joined(groups, np.int32),
        "num_hashes": _joined(num_hashes, np.int32),
        "hashes": hashes,
        "num_pages": _joined(num_pages, np.int32),
        "pages": _narrow(_joined(pages, np.int64)),
        "parents": parents,
        "num_tokens": _joined(num_tokens, np.int32),
        "tokens": _token_array(b"".join(tokens)),
        "page_sizes": _joined(page_sizes, np.int32),
        "loras": None if loras.count(None) == len(loras) else loras,
        # Per stored event (absent from snapshots written before events kept them): its
        # extra keys (None without; no column at all when none has any), its first page.
        "event_extra_keys": None if keys.count(None) == len(keys) else keys,
        "first_pages": _joined(first_pages, np.int32),
    }


def _joined(parts: list[npt.NDArray[Any]], dtype: type[np.generic]) -> npt.NDArray[Any]:
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def events_from_tree(tree: Tree) -> list[KVEvent]:
    kinds = str(tree["kinds"])
    seqs = np.asarray(tree["seqs"]).tolist()
    groups = np.asarray(tree["groups"]).tolist()
    hash_ends = np.cumsum(np.asarray(tree["num_hashes"], dtype=np.int64)).tolist()
    page_ends = np.cumsum(np.asarray(tree["num_pages"], dtype=np.int64)).tolist()
    token_ends = np.cumsum(np.asarray(tree["num_tokens"], dtype=np.int64)).tolist()
    hashes = _bytes_list(tree["hashes"])
    pages = np.asarray(tree["pages"]).tolist()
    tokens = np.asarray(tree["tokens"]).tolist()
    parents = _bytes_list(tree["parents"])
    page_sizes = np.asarray(tree["page_sizes"]).tolist()
    loras = tree["loras"] or [None] * len(parents)
    keys = tree.get("event_extra_keys") or [None] * len(parents)
    first_pages = (
        np.asarray(tree["first_pages"]).tolist() if "first_pages" in tree else [0] * len(parents)
    )
    if tree.get("extra_keys"):
        # Two development builds of one day used this name: with a first_pages column
        # beside it, for the keys themselves; without, for [first page, keys] pairs.
        if "first_pages" in tree:
            keys = tree["extra_keys"]
        else:
            pairs = tree["extra_keys"]
            keys = [None if p is None else p[1] for p in pairs]
            first_pages = [0 if p is None else int(p[0]) for p in pairs]
    if len(loras) != len(parents) or len(keys) != len(parents) or len(first_pages) != len(parents):
        raise InvalidArgument("snapshot events: columns do not match their kinds")
    if len(seqs) != len(kinds) or len(groups) != len(kinds) - kinds.count("c"):
        raise InvalidArgument("snapshot events: columns do not match their kinds")
    out: list[KVEvent] = []
    p = s = 0  # index among paged events, among stored events
    h0 = g0 = t0 = 0
    for seq, kind in zip(seqs, kinds, strict=True):
        if kind == "c":
            out.append(AllCleared(seq=seq))
            continue
        h1, g1 = hash_ends[p], page_ends[p]
        if kind == "s":
            t1 = token_ends[s]
            out.append(
                PageStored(
                    seq=seq,
                    group_id=groups[p],
                    page_hashes=tuple(hashes[h0:h1]),
                    parent_page_hash=parents[s] or None,
                    token_ids=TokenRun(tokens[t0:t1]),
                    page_size=page_sizes[s],
                    page_ids=tuple(pages[g0:g1]),
                    lora_name=loras[s],
                    extra_keys=None if keys[s] is None else extra_keys_from_tree(keys[s]),
                    first_page=first_pages[s],
                )
            )
            s += 1
            t0 = t1
        elif kind == "r":
            out.append(
                PageRemoved(
                    seq=seq,
                    group_id=groups[p],
                    page_hashes=tuple(hashes[h0:h1]),
                    page_ids=tuple(pages[g0:g1]),
                )
            )
        else:
            raise InvalidArgument(f"snapshot: unknown event kind {kind!r}")
        p += 1
        h0, g0 = h1, g1
    return out


# -- the manager -----------------------------------------------------------------------------


def snapshot_manager(manager: Any) -> Tree:
    """The manager's whole state as a tree (see the module docstring). The manager is not
    changed; the tree shares nothing mutable with it."""
    return capture_manager(manager)()


# Pages whose hashes are gathered between two pauses of a snapshot built in a thread.
PAGES_PER_CHUNK = 16_384


def _gather(
    page_hash: list[bytes | None],
    pages: npt.NDArray[np.int64],
    pause: Callable[[], None] | None,
) -> list[bytes]:
    """``[page_hash[p] for p in pages]``, ``PAGES_PER_CHUNK`` at a time."""
    out: list[Any] = []
    for start in range(0, len(pages), PAGES_PER_CHUNK):
        if start and pause is not None:
            pause()
        out.extend(map(page_hash.__getitem__, pages[start : start + PAGES_PER_CHUNK].tolist()))
    return out


def capture_manager(manager: Any, pause: Callable[[], None] | None = None) -> Callable[[], Tree]:
    """:func:`snapshot_manager` in two parts, as ``ServiceState.capture_snapshot``: this call
    copies, between mutations, what later ones would change; the function it returns
    builds the tree from the copies anywhere (a worker thread), calling ``pause()`` between
    chunks of the per-page work. With a large pool mostly cached the per-page work is most
    of it (131,072 cached pages: ~16 ms when all of it ran here).

    A group's index is recorded in page order and read from the copies rather than the
    index itself: its entries are exactly that group's cached pages less those waiting in
    its duplicate lists (each under its page's hash), an invariant of the pool. The entry
    counts, taken here, are checked against it when the tree is built, so a pool that broke
    it fails the snapshot rather than record another index."""
    from pagekeeper.core.manager import PageManager

    if not isinstance(manager, PageManager):
        raise InvalidArgument("snapshot_manager needs a PageManager")
    if manager.has_deferred:
        manager.settle()  # deferred caching is recorded done
    pool = manager.pool
    run = pool._buf_np[pool._head : pool._tail].copy()
    cached = pool._cached_np.copy()
    page_hash = pool._page_hash.copy()
    dups = [{h: list(waiting) for h, waiting in d.items()} for d in pool._dups]
    index_sizes = [len(index) for index in pool._index]
    events = list(pool._events)
    pool_head: Tree = {
        "num_pages": pool.num_pages,
        "enable_caching": pool.enable_caching,
        "ref": pool.ref_count_array(),
        "cached": cached,
        "capacity": len(pool._buf),
        "head": pool._head,
        "tail": pool._tail,
        "run": run,
        "num_free": pool._num_free,
    }
    pool_tail: Tree = {
        "event_seq": pool._event_seq,
        "num_evictions": pool.num_evictions,
        "num_allocated_total": pool.num_allocated_total,
        "num_freed_total": pool.num_freed_total,
    }
    config = manager.config.to_dict()
    rest = _capture_groups_and_requests(manager)

    def build() -> Tree:
        index_tree = []
        for group_id, group_dups in enumerate(dups):
            # In hash order: the dict's order means nothing (a duplicate list deferred
            # caching re-creates lands elsewhere in it), and the bytes must not differ.
            dup_hashes = sorted(group_dups)
            dup_pages = [p for h in dup_hashes for p in group_dups[h]]
            pages = np.flatnonzero(cached == group_id + 1)
            if dup_pages:
                pages = np.setdiff1d(pages, np.asarray(dup_pages, dtype=np.int64))
            if len(pages) != index_sizes[group_id]:
                raise InvariantViolation(
                    f"group {group_id}: {index_sizes[group_id]} index entries, but "
                    f"{len(pages)} cached pages outside the duplicate lists"
                )
            index_tree.append(
                {
                    "hashes": _gather(page_hash, pages, pause),
                    "pages": _ints(pages),
                    "dup_hashes": dup_hashes,
                    "dup_counts": _ints([len(group_dups[h]) for h in dup_hashes]),
                    "dup_pages": _ints(dup_pages),
                }
            )
        hash_pages = np.flatnonzero(cached)
        pool_tree: Tree = {
            **pool_head,
            "index": index_tree,
            "hash_pages": _ints(hash_pages),
            "hash_values": _gather(page_hash, hash_pages, pause),
            "events": events_to_tree(events, pause),
            **pool_tail,
        }
        return {"version": SNAPSHOT_VERSION, "config": config, "pool": pool_tree, **rest}

    return build


def _capture_groups_and_requests(manager: Any) -> Tree:
    """The groups', requests' and statistics' parts of the manager's tree (copies)."""
    groups_tree = []
    for g in manager.groups:
        rows = g.rows
        fresh = rows._num_fresh
        counts = rows._num_pages[:fresh].copy()
        width = rows._table.shape[1]
        mask = np.arange(width)[None, :] < counts[:, None]
        rids = list(g.request_rows)
        groups_tree.append(
            {
                "capacity": rows.capacity,
                "num_fresh": fresh,
                "row_counts": counts,
                "row_pages": rows._table[:fresh][mask].copy(),
                "is_live": rows._is_live[:fresh].copy(),
                "free_rows": list(rows._free_rows),
                "num_live": rows._num_live,
                "request_ids": rids,
                "request_rows": _ints([g.request_rows[r] for r in rids]),
                "page_counts": _ints([g.page_counts[r] for r in rids]),
                "num_cached_pages": _ints([g.num_cached_pages[r] for r in rids]),
            }
        )

    reqs = list(manager._requests.values())
    requests_tree: Tree = {
        "request_ids": [r.request_id for r in reqs],
        "owners": [r.owner for r in reqs],
        "extra_keys": [extra_keys_to_tree(r.extra_keys) for r in reqs],
        "num_tokens": _ints([len(r.token_ids) for r in reqs]),
        "tokens": _token_column(r.token_ids for r in reqs),
        "num_hashes": _ints([len(r.hashes) for r in reqs]),
        "hashes": [h for r in reqs for h in r.hashes],
        "num_computed_tokens": _ints([r.num_computed_tokens for r in reqs]),
        "num_cached_tokens": _ints([r.num_cached_tokens for r in reqs]),
        "scheduled_start": _ints([r.scheduled_start for r in reqs]),
        "num_scheduled": _ints([r.num_scheduled for r in reqs]),
    }
    stats = manager._stats
    return {
        "groups": groups_tree,
        "requests": requests_tree,
        "stats": {
            "prefix_queries_tokens": stats.prefix_queries_tokens,
            "prefix_hits_tokens": stats.prefix_hits_tokens,
            "prefix_queries_requests": stats.prefix_queries_requests,
            "prefix_hits_requests": stats.prefix_hits_requests,
            "num_no_capacity": stats.num_no_capacity,
        },
    }


def restore_manager(config: PoolConfig, tree: Tree) -> Any:
    """A new :class:`PageManager` for ``config`` in exactly the state ``tree`` records.

    Raises :class:`InvalidArgument` when the tree was taken from a pool with another
    configuration, has another version, or is inconsistent (the caller should also run
    ``check_invariants()`` on the result)."""
    from pagekeeper.core.manager import PageManager, _Request

    if not isinstance(tree, dict) or tree.get("version") != SNAPSHOT_VERSION:
        version = tree.get("version") if isinstance(tree, dict) else None
        raise InvalidArgument(
            f"snapshot version {version!r} is not the supported {SNAPSHOT_VERSION}"
        )
    if tree["config"] != config.to_dict():
        raise InvalidArgument(
            "snapshot was taken from a pool with another configuration "
            f"({tree['config']} != {config.to_dict()})"
        )
    manager = PageManager(config)
    try:
        _restore_pool(manager, tree["pool"])
        for g, gt in zip(manager.groups, tree["groups"], strict=True):
            _restore_group(g, gt)
        rt = tree["requests"]
        tokens = _split(np.asarray(rt["tokens"]), np.asarray(rt["num_tokens"]))
        hashes = _bytes_list(rt["hashes"])
        hash_ends = np.cumsum(np.asarray(rt["num_hashes"], dtype=np.int64)).tolist()
        start = 0
        for i, rid in enumerate(rt["request_ids"]):
            end = int(hash_ends[i])
            ids = array("Q")
            ids.frombytes(np.asarray(tokens[i]).astype("<u8").tobytes())
            req = _Request(
                str(rid),
                ids,
                extra_keys_from_tree(rt["extra_keys"][i]),
                str(rt["owners"][i]),
                hashes[start:end],
            )
            start = end
            req.num_computed_tokens = int(rt["num_computed_tokens"][i])
            req.num_cached_tokens = int(rt["num_cached_tokens"][i])
            req.scheduled_start = int(rt["scheduled_start"][i])
            req.num_scheduled = int(rt["num_scheduled"][i])
            manager._requests[req.request_id] = req
        stats = manager._stats
        for key, value in tree["stats"].items():
            setattr(stats, key, int(value))
    except (KeyError, ValueError, TypeError, IndexError) as exc:
        raise InvalidArgument(f"snapshot is inconsistent: {type(exc).__name__}: {exc}") from None
    return manager


def _restore_pool(manager: Any, pt: Tree) -> None:
    pool = manager.pool
    n = pool.num_pages
    if int(pt["num_pages"]) != n or bool(pt["enable_caching"]) != pool.enable_caching:
        raise InvalidArgument("snapshot pool size or caching differs from the configuration")
    ref = np.asarray(pt["ref"], dtype=np.int32)
    cached = np.asarray(pt["cached"], dtype=np.uint8)
    if ref.shape != (n,) or cached.shape != (n,):
        raise InvalidArgument("snapshot per-page arrays have the wrong length")
    if (ref < 0).any():
        raise InvalidArgument("snapshot has negative ref counts")
    pool.load_states(ref, cached)
    # The queue buffer may have grown to another capacity; rebuild it at the recorded one.
    run = np.asarray(pt["run"], dtype=np.int32)
    pool.load_queue(int(pt["capacity"]), int(pt["head"]), int(pt["tail"]), run)
    pool._num_free = int(pt["num_free"])
    pool._index = []
    pool._dups = []
    for it in pt["index"]:
        pages = np.asarray(it["pages"]).tolist()
        index = pool.new_index(len(pt["index"]))
        index.update(zip(_bytes_list(it["hashes"]), pages, strict=True))
        pool._index.append(index)
        dup_pages = _split(np.asarray(it["dup_pages"]), np.asarray(it["dup_counts"]))
        pool._dups.append(
            {
                h: chunk.tolist()
                for h, chunk in zip(_bytes_list(it["dup_hashes"]), dup_pages, strict=True)
            }
        )
    pool._page_hash = [None] * pool.num_pages
    hash_pages = np.asarray(pt["hash_pages"]).tolist()
    for page, page_hash in zip(hash_pages, _bytes_list(pt["hash_values"]), strict=True):
        if not 0 < page < pool.num_pages:
            raise InvalidArgument(f"snapshot caches page {page}, not in the pool")
        pool._page_hash[page] = page_hash
    pool._events = events_from_tree(pt["events"])
    pool._event_seq = int(pt["event_seq"])
    pool.num_evictions = int(pt["num_evictions"])
    pool.restore_totals(int(pt["num_allocated_total"]), int(pt["num_freed_total"]))


def _restore_group(g: Any, gt: Tree) -> None:
    rows = g.rows
    capacity = int(gt["capacity"])
    width = rows.max_pages_per_row
    fresh = int(gt["num_fresh"])
    counts = np.asarray(gt["row_counts"], dtype=np.int32)
    if counts.shape != (fresh,) or fresh > capacity or (counts > width).any():
        raise InvalidArgument("snapshot rows do not fit the table")
    table = np.zeros((capacity, width), dtype=np.int32)
    mask = np.arange(width)[None, :] < counts[:, None]
    table[:fresh][mask] = np.asarray(gt["row_pages"], dtype=np.int32)
    num_pages = np.zeros(capacity, dtype=np.int32)
    num_pages[:fresh] = counts
    is_live = np.zeros(capacity, dtype=np.bool_)
    is_live[:fresh] = np.asarray(gt["is_live"], dtype=np.bool_)
    rows._table, rows._num_pages, rows._is_live = table, num_pages, is_live
    rows._num_fresh = fresh
    free_rows = [int(r) for r in gt["free_rows"]]
    heapq.heapify(free_rows)  # already a heap when taken; heapify is a no-op then
    rows._free_rows = free_rows
    rows._num_live = int(gt["num_live"])
    rids = [str(r) for r in gt["request_ids"]]
    g.request_rows = dict(zip(rids, np.asarray(gt["request_rows"]).tolist(), strict=True))
    g.page_counts = dict(zip(rids, np.asarray(gt["page_counts"]).tolist(), strict=True))
    g.num_cached_pages = dict(zip(rids, np.asarray(gt["num_cached_pages"]).tolist(), strict=True))


__all__ = [
    "SNAPSHOT_VERSION",
    "events_from_tree",
    "events_to_tree",
    "extra_keys_from_tree",
    "extra_keys_to_tree",
    "restore_manager",
    "snapshot_manager",
]
