"""Memory check of the C hash loops (``pagekeeper.core._native``) under valgrind.

``make memcheck`` runs this module under ``valgrind --tool=memcheck`` and fails when any
error report has a frame in the extension. It drives both functions with random inputs
(every CBOR width, parents of any length, shared or per-page extras, empty inputs) and
with the argument errors they must refuse, comparing every result with the pure-Python
loops, so a wrong result fails here too. Run alone (without valgrind) it is a quick
differential check::

    .venv/bin/python -m tests.core.native_memcheck --cases 300
"""

from __future__ import annotations

import argparse
import random
import sys

import numpy as np

from pagekeeper.core import hashing

_EDGES = [0, 23, 24, 255, 256, 65_535, 65_536, 2**32 - 1, 2**32, 2**64 - 1]


def run(cases: int, seed: int) -> int:
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
        got = native.chain_sha256(
            first, hashing._PARENT_HEADS[32], parent, array_head, body, ends, extras
        )
        hashing._native = None
        try:
            want = hashing._chain("sha256_cbor", parent, array_head, body, ends, extras)
        finally:
            hashing._native = native
        assert got == want
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
        try:
            native.encode_pages(bad, 4)
        except (TypeError, ValueError):
            checked += 1
        else:
            raise AssertionError(f"{bad!r} accepted")
    print(f"memcheck: {checked} checks of pagekeeper.core._native passed")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    return run(args.cases, args.seed)


if __name__ == "__main__":
    sys.exit(main())
