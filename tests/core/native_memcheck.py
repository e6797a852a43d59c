"""Memory check of the C extensions (``pagekeeper.core._native``, the hash loops,
``pagekeeper.core._poolops``, the page pool's loops, and ``pagekeeper_client._clientops``,
the scheduler mirror's decode loops) under valgrind.

It drives the hash functions with random inputs (every CBOR width, parents of any length,
shared or per-page extras, empty inputs) and with the argument errors they must refuse, and
two page pools (C loops, Python loops) through the same random operations, comparing every
result with the pure-Python code, so a wrong result fails too. With
``--valgrind LOG`` it runs itself under ``valgrind --tool=memcheck`` and fails when any
error report in LOG has a frame in the extension (CPython's own reports, which its build
makes, are not the extension's); ``make memcheck`` and a short run in the tests do that::

    .venv/bin/python -m tests.core.native_memcheck --cases 300                # differential
    .venv/bin/python -m tests.core.native_memcheck --valgrind m.log --cases 300
"""

from __future__ import annotations

import argparse
import array
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np

from pagekeeper.core import hashing
from pagekeeper.core import pool as pool_module
from pagekeeper.core.errors import PagekeeperError

_EDGES = [0, 23, 24, 255, 256, 65_535, 65_536, 2**32 - 1, 2**32, 2**64 - 1]


def run(cases: int, seed: int) -> int:
    return (
        hash_cases(cases, seed)
        | pool_cases(cases, seed)
        | index_cases(cases, seed)
        | decode_cases(cases, seed)
        | digest_cases(cases, seed)
        | client_cases(cases, seed)
    )


def hash_cases(cases: int, seed: int) -> int:
    native = hashing._native
    if native is None:
        print("memcheck: pagekeeper.core._native is not built here; nothing to check")
        return 0
    rng = random.Random(seed)
    checked = 0
    for _ in range(cases):
        page_size = rng.choice([1, 3, 16, 64])
        tokens = [
            rng.choice(_EDGES) if rng.random() < 0.3 else rng.randrange(50_000)
            for _ in range(rng.randrange(0, 300))
        ]
        expected = hashing._encode_tokens_py(tokens, page_size)
        for dtype in (np.uint8, np.uint16, np.uint32, np.uint64):
            if tokens and max(tokens) > np.iinfo(dtype).max:
                continue
            assert native.encode_pages(np.array(tokens, dtype=dtype), page_size) == expected
            checked += 1
        body, ends = expected
        if not ends:
            continue
        parent = rng.randbytes(rng.randrange(0, 40))
        extras: bytes | list[bytes] = rng.choice(
            [
                b"",
                b"\xf6",
                [rng.randbytes(rng.randrange(30)) for _ in range(rng.randrange(1, len(ends) + 2))],
            ]
        )
        first = hashing._PARENT_HEADS.get(len(parent)) or b"\x83" + hashing._head(2, len(parent))
        array_head = hashing._head(4, page_size)
        head32 = hashing._PARENT_HEADS[32]
        got = native.chain_sha256(first, head32, parent, array_head, body, ends, extras)
        hashing._native = None
        try:
            want = hashing._chain("sha256_cbor", parent, array_head, body, ends, extras)
        finally:
            hashing._native = native
        assert got == want
        checked += 1
        # One page read in place at any offset (pages past sha256_page's stack buffer too).
        stored = array.array("Q", tokens)
        for k in range(len(got)):
            one = native.sha256_page(
                first if k == 0 else head32,
                parent if k == 0 else got[k - 1],
                array_head,
                stored,
                k * page_size,
                page_size,
                extras if isinstance(extras, bytes) else extras[k],
            )
            assert one == got[k]
            checked += 1
    # Refusals: offsets past the body or going back, wrong types. Each must raise.
    head = hashing._PARENT_HEADS[32]
    for ends in ([5, 100], [3, 2], [-1]):
        try:
            native.chain_sha256(head, head, b"", b"", b"1234", ends, b"")
        except ValueError:
            checked += 1
        else:
            raise AssertionError(f"ends {ends} accepted")
    for bad in (np.arange(8, dtype=np.float32), np.arange(8, dtype=np.uint32)[::2], "x"):
        for function, args in (
            (native.encode_pages, (bad, 4)),
            (native.sha256_page, (head, b"", b"", bad, 0, 4, b"")),
        ):
            try:
                function(*args)
            except (TypeError, ValueError):
                checked += 1
            else:
                raise AssertionError(f"{bad!r} accepted")
    for start, page_size in ((5, 4), (-1, 4), (0, 0), (0, 9)):
        try:
            native.sha256_page(head, b"", b"", array.array("Q", range(8)), start, page_size, b"")
        except ValueError:
            checked += 1
        else:
            raise AssertionError(f"a page of {page_size} at {start} of 8 accepted")
    print(f"memcheck: {checked} checks of pagekeeper.core._native passed")
    return 0


def pool_view(pool: pool_module.PagePool) -> dict[str, object]:
    """Everything a later operation or a reader of the pool can see (its events aside)."""
    return {
        "state": list(pool._state),
        "cached": bytes(pool._cached),
        "queue": pool.free_queue(),
        "num_free": pool.num_free_pages,
        "index": [dict(index) for index in pool._index],
        "dups": [{h: list(p) for h, p in dups.items()} for dups in pool._dups],
        "page_hash": list(pool._page_hash),
        "num_cached": pool.num_cached_pages,
        "evictions": pool.num_evictions,
        "allocated": pool.num_allocated_total,
        "freed": pool.num_freed_total,
        "last_seq": pool.last_event_seq,
    }


def _outcome(pool: pool_module.PagePool, op: str, args: tuple, kwargs: dict) -> tuple[str, object]:
    """The outcome of one call: its result, or the kind of error it raised."""
    try:
        return "ok", getattr(pool, op)(*args, **kwargs)
    except (PagekeeperError, IndexError, KeyError, ValueError) as exc:
        return "error", type(exc).__name__


def call_both(
    native: pool_module.PagePool,
    python: pool_module.PagePool,
    op: str,
    *args: object,
    **kwargs: object,
) -> tuple[str, object]:
    """One call on a pool with the C loops and on one with the Python loops: the same
    answer or error, the same pool afterwards, the same events. Returns the outcome."""
    got = _outcome(native, op, args, kwargs)
    want = _outcome(python, op, args, kwargs)
    assert got == want, (op, args, got, want)
    assert pool_view(native) == pool_view(python), (op, args)
    assert native.take_events() == python.take_events(), (op, args)
    return got


def pool_cases(cases: int, seed: int) -> int:
    """Two pools, C loops and Python loops, through the same random operations (colliding
    hashes, pages listed twice, pages outside the pool when caching); equal after every
    one."""
    ops = _pool_ops()
    if ops is None:
        return 0
    rng = random.Random(seed)
    num_pages = 40
    native = pool_module.PagePool(num_pages, native=True)
    python = pool_module.PagePool(num_pages, native=False)
    for pool in (native, python):
        pool.ensure_groups(2)
    held: list[int] = []
    checked = 0
    for _ in range(cases * 4):
        kind = rng.random()
        kwargs: dict[str, object] = {}
        if kind < 0.3:
            op, args = "allocate", (rng.randrange(0, 16),)
        elif kind < 0.55 and held:
            pages = [rng.choice(held) for _ in range(rng.randrange(1, 10))]
            if rng.random() < 0.1:
                pages.append(pages[0])
            op, args = "free", (pages,)
        elif kind < 0.85:
            pool_pages = held + [0, rng.randrange(-2, num_pages + 2)]
            k = rng.randrange(1, 12)
            pages = [rng.choice(pool_pages) for _ in range(k)]
            hashes = [b"h%d" % rng.randrange(60) for _ in range(k)]
            op, args = "cache", (rng.randrange(2), pages, hashes)
            kwargs = {
                "parent_hash": None,
                "token_ids": list(range(k)),
                "page_size": 1,
                "lora_name": None,
            }
        elif kind < 0.97 and native.num_cached_pages:
            cached = [page for page, h in enumerate(native._page_hash) if h is not None]
            op, args = "touch", (rng.sample(cached, rng.randrange(1, min(8, len(cached)) + 1)),)
        else:
            op, args = "reset_prefix_cache", ()
        outcome, got = call_both(native, python, op, *args, **kwargs)
        if outcome == "ok":
            if op == "allocate":
                held.extend(got)  # type: ignore[arg-type]
            elif op == "touch":
                held.extend(args[0])
            elif op == "free":
                for page in args[0]:
                    if page in held:
                        held.remove(page)
        checked += 1
    assert native.check_invariants() == python.check_invariants()
    table, lengths = np.zeros((3, 4), np.int32), np.array([1, 0, 4], np.int32)
    assert ops.append_each(table, lengths, [0, 1, 0], [1, 0, 1], [5, 6, 8]) is False  # put back
    assert ops.append_each(table, lengths, [1, 0], [0, 1], [6, 5]) is True
    checked += 2
    # The functions' own refusals: pages outside, wrong types. Each must raise.
    for call in (
        lambda: ops.take_run(array.array("i", [1, 2]), 0, 2, [0, 0]),
        lambda: ops.take_run(array.array("i", [1]), 0, 2, [0, 0]),
        lambda: ops.pack_i32([2**40]),
        lambda: ops.append_each(np.zeros((2, 2), np.int64), np.zeros(2, np.int32), [], [], []),
        lambda: ops.append_each(np.zeros((2, 2), np.int32), np.zeros(2, np.int32), [0], [0]),
        lambda: ops.widen_tokens(np.array([-1], dtype=np.int32), None),
        lambda: ops.release([0, 2], [1, -1], 2, 0),
        lambda: ops.cache({}, [None] * 2, [0, 2], bytearray(2), [1, 7], [b"a", b"b"], 1),
        lambda: ops.evict({}, [None] * 2, bytearray(2), [1, 7], 1),
        lambda: ops.take_run(array.array("i", [1]), 0, 1, (0, 0)),
        lambda: ops.cache({}, [None] * 2, [0, 2], bytearray(3), [1], [b"a"], 1),
    ):
        checked += _refused(call, "pagekeeper.core._poolops")
    print(f"memcheck: {checked} checks of pagekeeper.core._poolops passed")
    return 0


def _pool_ops() -> ModuleType | None:
    """The pool's C loops, or None (and a line saying so) where they are not built."""
    ops = pool_module._ops
    if ops is None:
        print("memcheck: pagekeeper.core._poolops is not built here; nothing to check")
    return ops


def _refused(call: Callable[[], object], what: str) -> int:
    """1 when ``call`` raises one of the refusals a bad argument gets; fails otherwise."""
    try:
        call()
    except (IndexError, KeyError, TypeError, ValueError, OverflowError):
        return 1
    raise AssertionError(f"a bad call to {what} was accepted")


def index_cases(cases: int, seed: int) -> int:
    """``_poolops.PageIndex`` against a dict through the same random operations: small
    tables (long clusters that wrap around the end, growth past half full), deletions of
    every kind, listings; equal after every one."""
    ops = _pool_ops()
    if ops is None:
        return 0
    rng = random.Random(seed)
    checked = 0
    for _ in range(max(1, cases // 10)):
        index, model = ops.PageIndex(rng.randrange(0, 12)), {}
        keys = [rng.randbytes(rng.randrange(0, 40)) for _ in range(rng.randrange(1, 50))]
        for _ in range(200):
            key, kind = rng.choice(keys), rng.random()
            if kind < 0.4:
                value = rng.randrange(-5, 1 << 70)
                index[key] = value
                model[key] = value
            elif kind < 0.6:
                assert (key in index) == (key in model)
                if key in model:
                    del index[key]
                    del model[key]
            elif kind < 0.7:
                assert index.pop(key, "none") == model.pop(key, "none")
            elif kind < 0.8:
                pairs = [(rng.choice(keys), rng.randrange(100)) for _ in range(rng.randrange(5))]
                index.update(pairs)
                model.update(pairs)
            elif kind < 0.93:
                assert index.get(key) == model.get(key) and index.get(7, "d") == "d"
            elif kind < 0.97:
                run = [rng.choice(keys) for _ in range(rng.randrange(0, 20))]
                if run and rng.random() < 0.2:
                    run[rng.randrange(len(run))] = "not bytes"
                limit = rng.randrange(-2, 24)
                expected = []
                for k in run[: max(limit, 0)]:
                    if not isinstance(k, bytes) or k not in model:
                        break
                    expected.append(model[k])
                assert index.prefix(run, limit) == expected
            else:
                index.clear()
                model.clear()
            assert len(index) == len(model)
            checked += 1
        assert dict(index.items()) == model and sorted(index) == sorted(model)
        assert sorted(index.values()) == sorted(model.values())
    for call in (
        lambda: ops.PageIndex(-1),
        lambda: ops.PageIndex(4).__setitem__("s", 1),
        lambda: ops.PageIndex(4).__setitem__(b"s", 1.0),
        lambda: ops.PageIndex(4).update([(b"a", 1), (b"b",)]),
        lambda: ops.PageIndex(4)[b"missing"],
        lambda: ops.PageIndex(4).prefix(7, 1),
        lambda: ops.PageIndex(4).prefix([b"a"], "1"),
        lambda: ops.PageIndex(4).prefix([b"a"]),
    ):
        checked += _refused(call, "PageIndex")
    print(f"memcheck: {checked} checks of pagekeeper.core._poolops.PageIndex passed")
    return 0


def digest_cases(cases: int, seed: int) -> int:
    """``_poolops.split_digests``, ``check_digests`` and ``DigestSet`` (client page hashes
    packed end to end) against Python's slicing and sets: random widths, repeats at any
    place, tables past their first size, clears; equal after every operation."""
    ops = _pool_ops()
    if ops is None:
        return 0
    rng = random.Random(seed)
    checked = 0
    for _ in range(max(1, cases // 5)):
        width = rng.choice([1, 3, 8, 16, 32])
        pool = [rng.randbytes(width) for _ in range(rng.choice([1, 5, 40, 400]))]
        hashes = [rng.choice(pool) for _ in range(rng.randrange(0, 600))]
        packed = b"".join(hashes)
        seen: set[bytes] = set()
        repeat = next((i for i, h in enumerate(hashes) if h in seen or seen.add(h)), -1)
        assert ops.check_digests(packed, width) == repeat
        assert ops.split_digests(packed, width) == tuple(hashes)
        digests, model = ops.DigestSet(), set()
        for _ in range(rng.randrange(1, 8)):
            if rng.random() < 0.2:
                digests.clear()
                model.clear()
            else:
                run = hashes[rng.randrange(len(hashes) + 1) :] or pool[:1]
                digests.add(b"".join(run), width)
                model.update(run)
            assert len(digests) == len(model)
            for probe in rng.sample(pool, min(len(pool), 10)) + [b"", rng.randbytes(width + 1)]:
                assert (probe in digests) == (probe in model)
            checked += 1
    # A large set (past 1 MB of bytes: clear gives them back), then a small one again.
    big = [rng.randbytes(32) for _ in range(40_000)]
    digests = ops.DigestSet()
    digests.add(b"".join(big), 32)
    assert len(digests) == len(set(big)) and all(h in digests for h in big[::97])
    digests.clear()
    assert len(digests) == 0 and big[0] not in digests
    digests.add(b"".join(big[:3]), 32)
    assert len(digests) == 3 and big[2] in digests and big[3] not in digests
    checked += 1
    for call in (
        lambda: ops.split_digests(b"abc", 2),
        lambda: ops.split_digests(b"abcd", 0),
        lambda: ops.check_digests(b"abc", 2),
        lambda: ops.check_digests(7, 2),
        lambda: ops.DigestSet().add(b"abc", 2),
        lambda: ops.DigestSet().add(b"abcd", -1),
        lambda: ops.DigestSet(4),
    ):
        checked += _refused(call, "the digest functions")
    assert 7 not in ops.DigestSet()
    print(f"memcheck: {checked} checks of pagekeeper.core._poolops digests passed")
    return 0


def decode_cases(cases: int, seed: int) -> int:
    """``_poolops.decode_rows`` (the manager's plain decode rows, filled pages cached in C
    included) against the manager's Python loop: twin managers of random configurations
    through the same random admissions, decode steps and frees
    (``tests.core.test_pool_native.decode_workload``), equal after every step."""
    from tests.core.test_pool_native import _decode_twins, decode_workload

    if _pool_ops() is None:
        return 0
    rng = random.Random(seed)
    checked = 0
    ops = ["admit", "decode", "decode", "decode", "free"]
    for _ in range(max(1, cases // 5)):
        native, python = _decode_twins(
            rng.random() < 0.8, 64, rng.randrange(8, 40), [], page_size=rng.choice([1, 2, 4])
        )
        steps = [(rng.choice(ops), rng.randrange(2**16)) for _ in range(40)]
        checked += decode_workload(native, python, steps, 64)
    # Crossings taking cached pages in C before fills (rare in the random workloads).
    from tests.core.test_pool_native import (
        test_crossings_before_fills_take_evicting_pages_in_c as crossings_in_c,
    )
    from tests.core.test_pool_native import (
        test_crossings_before_fills_with_a_duplicate_hash_take_pages_in_python as duplicate,
    )

    for num_rows in (4, 20):
        crossings_in_c(num_rows)
        checked += 1
    duplicate()
    checked += 1
    print(f"memcheck: {checked} decode steps with pagekeeper.core._poolops.decode_rows passed")
    return 0


def client_cases(cases: int, seed: int) -> int:
    """``pagekeeper_client._clientops`` (the scheduler mirror's decode loops) against the
    Python loops: twin mirrors through the same random decode steps, with and without
    caching and lookahead, equal after every step; then the refusals (bad rows, bad
    arguments)."""
    import pagekeeper_client.client as client_module
    from tests.client import test_decode_plan_native as twin

    ops = client_module._clientops
    if ops is None:
        print("memcheck: pagekeeper_client._clientops is not built here; nothing to check")
        return 0
    rng = random.Random(seed)
    checked = 0
    for _ in range(max(1, cases // 10)):
        caching, lookahead = rng.random() < 0.7, rng.choice([0, 0, 1, 3])
        native, python = twin.twins(rng, caching, rng.randrange(1, 40))
        next_pages: tuple[list[int], list[int]] = ([1000], [1000])
        for _ in range(10):
            twin.twin_step(rng, native, python, lookahead, next_pages)
            checked += 1
        ids = list(native.requests)
        roomy = 1 << 30  # every row passes but the missing one at the end
        assert ops.check_decodes([*ids, "missing"], native.requests, roomy, roomy) == len(ids)
        assert ops.check_decodes(ids, native.requests, roomy, roomy) == [
            native.requests[rid] for rid in ids
        ]
        assert _refused(lambda: ops.hold_decodes([], b"x", 0, 4, 64, 0, 0, []), "hold_decodes")
        assert _refused(lambda: ops.check_decodes(None, {}, 64, 0), "check_decodes")
    print(f"memcheck: {checked} decode steps with pagekeeper_client._clientops passed")
    return 0


# Words that name the extensions in a valgrind stack frame (their files and functions).
_OUR_FRAMES = (
    "_native",
    "encode_pages",
    "chain_sha256",
    "sha256_page",
    "_poolops",
    "pool_take",
    "pool_evict",
    "pool_cache",
    "pool_release",
    "pool_atomic_tuple",
    "pool_untrack",
    "pool_decode_rows",
    "unlist_crossing",
    "decode_row",
    "small_count",
    "visit_for_tracked",
    "PageIndex",
    "index_",
    "_clientops",
    "clientops_",
    "int_attr",
    "arg_ll",
    "hold_row",
)


def under_valgrind(log: Path, cases: int, seed: int) -> int:
    """Run the checks under valgrind memcheck; 1 when a report has a frame of ours."""
    if shutil.which("valgrind") is None:
        print("memcheck: SKIPPED: valgrind is not installed")
        return 0
    log.parent.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [
            "valgrind",
            "--tool=memcheck",
            "--errors-for-leak-kinds=none",
            f"--log-file={log}",
            sys.executable,
            "-m",
            "tests.core.native_memcheck",
            "--cases",
            str(cases),
            "--seed",
            str(seed),
        ],
        env={**os.environ, "PYTHONMALLOC": "malloc"},
        cwd=Path(__file__).resolve().parents[2],
        check=False,
    )
    if done.returncode != 0:
        print(f"memcheck: the checks failed under valgrind (exit {done.returncode})")
        return 1
    report = log.read_text()
    if any(word in report for word in _OUR_FRAMES):
        print(f"memcheck: errors in pagekeeper's C extensions, see {log}")
        return 1
    print("memcheck: no error in pagekeeper's C extensions")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--valgrind", type=Path, metavar="LOG", help="run under valgrind")
    args = parser.parse_args()
    if args.valgrind is not None:
        return under_valgrind(args.valgrind, args.cases, args.seed)
    return run(args.cases, args.seed)


if __name__ == "__main__":
    sys.exit(main())
