"""Memory check of the C hash loops (``pagekeeper.core._native``) under valgrind.

It drives both functions with random inputs (every CBOR width, parents of any length,
shared or per-page extras, empty inputs) and with the argument errors they must refuse,
comparing every result with the pure-Python loops, so a wrong result fails too. With
``--valgrind LOG`` it runs itself under ``valgrind --tool=memcheck`` and fails when any
error report in LOG has a frame in the extension (CPython's own reports, which its build
makes, are not the extension's); ``make memcheck`` and a short run in the tests do that::

    .venv/bin/python -m tests.core.native_memcheck --cases 300                # differential
    .venv/bin/python -m tests.core.native_memcheck --valgrind m.log --cases 300
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

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


# Words that name the extension in a valgrind stack frame (its file and its functions).
_OUR_FRAMES = ("_native", "encode_pages", "chain_sha256")


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
        print(f"memcheck: errors in pagekeeper.core._native, see {log}")
        return 1
    print("memcheck: no error in pagekeeper.core._native")
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
