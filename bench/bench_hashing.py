"""Prefix-cache page hashing: pagekeeper vs vLLM, side by side, bit-exact.

Hashes one request (default 2,000 tokens, page 16) with:
  (a) cbor2 + hashlib exactly as vLLM 0.33 does it (in-script reimplementation, always run)
  (b) vLLM's own ``get_request_block_hasher`` (when vLLM imports)
  (c) pagekeeper ``sha256_cbor`` (list input, and numpy int32 input), with its C loops
      (``pagekeeper.core._native``) where they are built, and the same in pure Python
  (d) pagekeeper ``xxhash_cbor`` (when ``xxhash`` imports), and vLLM's when it can
plus the decode path: one more page filled (``PageHasher.extend`` vs vLLM's hasher).

Variants run interleaved (each round in a fresh random order) so machine drift and cold
caches hit all alike; the table shows median (and min) µs per request and the speed-up
over vLLM's own function (or over the cbor2 baseline where vLLM is absent). Every
variant's hashes are checked bit for bit first.

Run alone with the project venv:   .venv/bin/python bench/bench_hashing.py
Against vLLM (side venv, see VLLM_ANCHOR.md):
  VLLM_TARGET_DEVICE=cpu PYTHONPATH=service:client /opt/vllm-anchor/bin/python \
      bench/bench_hashing.py
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cbor2
import numpy as np

try:
    import xxhash
except ImportError:
    xxhash = None

try:
    import pagekeeper.core.hashing  # noqa: F401
except ImportError:  # run from a checkout without PYTHONPATH
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))

from pagekeeper.core import hashing
from pagekeeper.core.hashing import NONE_HASH, PageHasher, hash_pages, none_hash


# --- (a) vLLM's algorithm, reimplemented with cbor2 + hashlib ---------------------------
def vllm_style_hashes(
    tokens: list[int], page_size: int, hash_fn: Callable[[Any], bytes], none: bytes
) -> list[bytes]:
    """``get_request_block_hasher`` for a plain request (no LoRA/mm/salt): per full block,
    ``hash_fn((parent, tuple(block_tokens), extra_keys))`` with ``extra_keys=None``."""
    out: list[bytes] = []
    parent = none
    for start in range(0, len(tokens) - page_size + 1, page_size):
        extra_keys = None  # generate_block_hash_extra_keys of a plain request
        parent = hash_fn((parent, tuple(tokens[start : start + page_size]), extra_keys))
        out.append(parent)
    return out


def cbor2_sha256(obj: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def cbor2_xxh3(obj: Any) -> bytes:
    assert xxhash is not None
    return xxhash.xxh3_128_digest(cbor2.dumps(obj, canonical=True))


# --- (b) vLLM's own function, when importable -------------------------------------------
def load_vllm(page_size: int) -> dict[str, Callable[[list[int]], list[bytes]]] | str:
    """Callables hashing a token list with vLLM's hasher, or why vLLM is unavailable."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    # vLLM seeds NONE_HASH randomly for xxhash unless PYTHONHASHSEED is set (read at
    # init_none_hash time): pin it to vLLM's default seed so the bytes are comparable.
    os.environ["PYTHONHASHSEED"] = "vllm-none-hash"
    try:
        from vllm.sampling_params import SamplingParams
        from vllm.utils import hashing as vllm_hashing
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.request import Request
    except Exception as exc:  # ImportError, or a broken install
        return f"vLLM not importable ({type(exc).__name__}: {exc})"

    def make(hash_fn: Callable[[Any], bytes]) -> Callable[[list[int]], list[bytes]]:
        hasher = kv_cache_utils.get_request_block_hasher(page_size, hash_fn)
        requests: dict[int, Any] = {}

        def run(tokens: list[int]) -> list[bytes]:
            # Only the hashing is timed: the Request is built once (without a hasher) and
            # the hasher sees no page hashed yet on every call, as at admission.
            request = requests.get(id(tokens))
            if request is None:
                request = Request("bench", tokens, SamplingParams(max_tokens=1), None)
                requests[id(tokens)] = request
            request.block_hashes = []
            # NONE_HASH is a module global that depends on the algorithm (~1 µs).
            kv_cache_utils.init_none_hash(hash_fn)
            return hasher(request)

        return run

    found = {"sha256_cbor": make(vllm_hashing.sha256_cbor)}
    if vllm_hashing._xxhash is not None:
        found["xxhash_cbor"] = make(vllm_hashing.xxhash_cbor)
    return found


def load_vllm_decode(page_size: int) -> Callable[[list[int]], Callable[[], list[bytes]]] | None:
    """vLLM's incremental path: a request with all but the last page hashed; the timed
    call hashes the page its newest tokens just filled."""
    try:
        from vllm.sampling_params import SamplingParams
        from vllm.utils import hashing as vllm_hashing
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.request import Request
    except Exception:
        return None
    hasher = kv_cache_utils.get_request_block_hasher(page_size, vllm_hashing.sha256_cbor)

    def prepare(tokens: list[int]) -> Callable[[], list[bytes]]:
        kv_cache_utils.init_none_hash(vllm_hashing.sha256_cbor)
        request = Request("bench", tokens, SamplingParams(max_tokens=1), None)
        done = hasher(request)[:-1]

        def run() -> list[bytes]:
            request.block_hashes = list(done)
            return hasher(request)

        return run

    return prepare


# --- timing ------------------------------------------------------------------------------
def interleaved(
    variants: dict[str, Callable[[], object]], repeats: int, inner: int
) -> dict[str, tuple[float, float]]:
    """(median, min) µs per call of each variant, sampled in turn (A B C, C A B, ...).

    The order is shuffled every round: the variant that runs right after another one
    finds its caches cold, and a fixed order would always hand that cost to the same one.
    """
    samples: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants)
    shuffle = random.Random(1).shuffle
    for fn in variants.values():  # warm-up
        fn()
    clock = time.perf_counter_ns
    # The cyclic GC is off while timing, as timeit does: a collection triggered by one
    # variant's garbage would otherwise land in whichever variant runs next.
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeats):
            shuffle(order)
            for name in order:
                fn = variants[name]
                t0 = clock()
                for _ in range(inner):
                    fn()
                samples[name].append((clock() - t0) / inner / 1e3)
    finally:
        gc.enable()
    return {name: (statistics.median(s), min(s)) for name, s in samples.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=151_936, help="token ids drawn below this")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--inner", type=int, default=5, help="calls per timed sample")
    args = parser.parse_args()
    ps = args.page_size

    rng = random.Random(0)
    tokens = [rng.randrange(args.vocab) for _ in range(args.tokens)]
    tokens_np = np.array(tokens, dtype=np.int32)
    vllm = load_vllm(ps)

    # Reference answers, and a bit-exactness check of every variant before timing.
    expected = {
        "sha256_cbor": vllm_style_hashes(tokens, ps, cbor2_sha256, NONE_HASH),
    }
    if xxhash is not None:
        expected["xxhash_cbor"] = vllm_style_hashes(
            tokens, ps, cbor2_xxh3, none_hash("xxhash_cbor")
        )

    full: dict[str, tuple[str, Callable[[], list[bytes]]]] = {
        "(a) cbor2+hashlib (vLLM's way, in-script)": (
            "sha256_cbor",
            lambda: vllm_style_hashes(tokens, ps, cbor2_sha256, NONE_HASH),
        ),
    }
    if isinstance(vllm, dict):
        full["(b) vLLM 0.33 get_request_block_hasher"] = (
            "sha256_cbor",
            lambda: vllm["sha256_cbor"](tokens),
        )
    full["(c) pagekeeper sha256_cbor (list)"] = ("sha256_cbor", lambda: hash_pages(tokens, ps))
    full["(c) pagekeeper sha256_cbor (numpy int32)"] = (
        "sha256_cbor",
        lambda: hash_pages(tokens_np, ps),
    )
    native = hashing._native
    if native is not None:

        def pure_python(tokens_in: Any) -> list[bytes]:
            # What runs where the C loops are not built (PAGEKEEPER_NATIVE_HASHING=0).
            hashing._native = None
            try:
                return hash_pages(tokens_in, ps)
            finally:
                hashing._native = native

        full["(c) pure Python (numpy int32, no C loops)"] = (
            "sha256_cbor",
            lambda: pure_python(tokens_np),
        )
    if xxhash is not None:
        if isinstance(vllm, dict) and "xxhash_cbor" in vllm:
            full["(b) vLLM 0.33 xxhash_cbor"] = ("xxhash_cbor", lambda: vllm["xxhash_cbor"](tokens))
        full["(d) pagekeeper xxhash_cbor (list)"] = (
            "xxhash_cbor",
            lambda: hash_pages(tokens, ps, algorithm="xxhash_cbor"),
        )

    for name, (algorithm, fn) in full.items():
        if fn() != expected[algorithm]:
            print(f"MISMATCH: {name} differs from the cbor2 reference", file=sys.stderr)
            return 1

    # Decode: the request's newest tokens just filled one more page.
    hasher = PageHasher(ps)
    done = hash_pages(tokens, ps)[:-1]

    def pk_decode() -> list[bytes]:
        hashes = list(done)
        return hasher.extend(hashes, tokens)

    decode: dict[str, Callable[[], list[bytes]]] = {"(c) pagekeeper PageHasher.extend": pk_decode}
    prepare = load_vllm_decode(ps) if isinstance(vllm, dict) else None
    if prepare is not None:
        decode = {"(b) vLLM 0.33 hasher(request)": prepare(tokens), **decode}
    for name, fn in decode.items():
        if fn() != expected["sha256_cbor"][-1:]:
            print(f"MISMATCH: {name} (decode) differs from the reference", file=sys.stderr)
            return 1

    print(
        f"page hashing, {args.tokens} tokens, page {ps}, {args.tokens // ps} pages; "
        f"median and min of {args.repeats} interleaved samples x {args.inner} calls; all bit-exact"
    )
    if not isinstance(vllm, dict):
        print(f"  note: {vllm}; ratios are against (a)")
    if xxhash is None:
        print("  note: xxhash not installed in this interpreter; (d) skipped")
    print(
        "  note: pagekeeper's hashing loops run in "
        + ("C (pagekeeper.core._native)" if native is not None else "pure Python (no C build)")
    )

    def table(title: str, timings: dict[str, tuple[float, float]], baseline: str) -> None:
        base_median, base_min = timings[baseline]
        print(f"\n{title}  (ratio = {baseline.split(' ')[0]} time / variant time)")
        print(f"  {'variant':<46} {'median µs':>10} {'ratio':>7} {'min µs':>9} {'ratio':>7}")
        for name, (median, fastest) in timings.items():
            print(
                f"  {name:<46} {median:>10.1f} {base_median / median:>6.2f}x"
                f" {fastest:>9.1f} {base_min / fastest:>6.2f}x"
            )

    timings = interleaved({n: fn for n, (_, fn) in full.items()}, args.repeats, args.inner)
    base = next((n for n in timings if n.startswith("(b) vLLM 0.33 get")), next(iter(timings)))
    table("one request, all pages", timings, base)

    timings = interleaved(decode, args.repeats, args.inner * 10)
    table("decode: hash the one page just filled", timings, next(iter(timings)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
