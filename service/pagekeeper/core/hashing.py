"""Prefix-cache page hashes, bit-compatible with vLLM's ``sha256_cbor`` and ``xxhash_cbor``.

A page's hash chains its parent page's hash, its token ids and the request's extra keys,
exactly as vLLM 0.33 computes block hashes (``hash_block_tokens`` over
``generate_block_hash_extra_keys``)::

    hash(page i) = H(cbor((parent, tuple(page_token_ids), extra_keys)))
    parent       = hash(page i-1), or none_hash(H) for page 0
    H            = sha256 (32 bytes) | xxh3_128 (16 bytes)
    extra_keys   = None, or a tuple of tagged tuples in this order:
                   ("lora", lora_name, lora_path)        every page of a LoRA request
                   ("mm", identifier, offset - page_start) each mm input whose placeholder
                                                          overlaps the page, in order
                   ("cache_salt", salt)                  page 0 only (non-empty salt)

``cbor`` is canonical CBOR (``cbor2.dumps(obj, canonical=True)``). vLLM pays for a generic
encoder per page; we encode exactly this shape ourselves. Every page's message is::

    83 | 58 20 <parent: 32 bytes> | 90 | <16 CBOR uints> | f6      (sha256, page 16, no keys)
    ^array(3)  ^bytes(32)           ^array(16)              ^null, or array(k) of tagged tuples

The token ids of all pages are encoded in one vectorised pass (a 64-bit word per token
holding its CBOR encoding right-aligned, then one compress drops the bytes each
variable-length encoding does not use); what remains per page is one join of five byte
strings and one digest call. A few pages (decode) take a plain-Python encoder instead;
both are checked against cbor2 in the tests.

Where the package was built with its C accelerator (``pagekeeper.core._native``: a C
compiler and OpenSSL's headers at install time), the encoding and the sha256 chain run
there instead, 7-10x faster, with identical bytes (tests compare both on random inputs);
``PAGEKEEPER_NATIVE_HASHING=0`` keeps the Python loops.

Only full pages are hashed. Hashes are raw ``bytes``, deterministic across processes
(never Python's ``hash()``). Pure: no I/O, numpy only (``xxhash`` for ``xxhash_cbor``).
"""

from __future__ import annotations

import array
import bisect
import hashlib
import struct
from collections.abc import Callable, Iterable, Sequence
from functools import lru_cache
from itertools import repeat
from types import ModuleType
from typing import Any, Final, Literal, TypeAlias, cast

import numpy as np
import numpy.typing as npt

from pagekeeper.core.errors import ConfigError, InvalidArgument
from pagekeeper.core.extensions import load_extension
from pagekeeper.core.types import ExtraKeys, MultiModalKey

_xxh3_128_digest: Callable[[bytes], bytes] | None
try:
    # Optional, as in vLLM: only xxhash_cbor needs it.
    from xxhash import xxh3_128_digest as _xxh3_128_digest
except ImportError:  # pragma: no cover - exercised only where xxhash is absent
    _xxh3_128_digest = None

# The C accelerator of the two hot loops (CBOR of the tokens, the SHA-256 chain), built
# with the package where a C compiler and OpenSSL's headers are; results are identical.
_native: ModuleType | None = load_extension("_native", "PAGEKEEPER_NATIVE_HASHING")


def native_hashing() -> bool:
    """Whether page hashing runs its C loops (``pagekeeper.core._native``)."""
    return _native is not None


__all__ = [
    "DEFAULT_NONE_HASH_SEED",
    "HASH_ALGORITHMS",
    "NONE_HASH",
    "PageHasher",
    "TokenIds",
    "digest_size",
    "encode_cbor",
    "hash_pages",
    "join_hashes",
    "native_hashing",
    "none_hash",
    "page_extra_keys",
    "validate_extra_keys",
]

SHA256_CBOR: Final = "sha256_cbor"
XXHASH_CBOR: Final = "xxhash_cbor"
HASH_ALGORITHMS: Final = (SHA256_CBOR, XXHASH_CBOR)
_DIGEST_SIZES: Final = {SHA256_CBOR: 32, XXHASH_CBOR: 16}

# vLLM's seed for NONE_HASH (``DEFAULT_NONE_HASH_SEED``). vLLM draws a random seed for the
# non-cryptographic xxhash algorithms unless PYTHONHASHSEED is set; pagekeeper's hashes must
# survive restarts, so it always uses a fixed seed (vLLM with PYTHONHASHSEED=<seed> agrees).
DEFAULT_NONE_HASH_SEED: Final = "vllm-none-hash"

TokenIds: TypeAlias = Sequence[int] | npt.NDArray[np.integer[Any]]
CborValue: TypeAlias = bool | int | str | bytes | tuple["CborValue", ...] | None
ExtraKeyTuple: TypeAlias = tuple[tuple[str | int | None, ...], ...]

_UINT64_LIMIT: Final = 1 << 64
# array.array's 32-bit unsigned typecode ("I" on every mainstream platform).
_UINT32_TYPECODE: Final = next(code for code in "IL" if array.array(code).itemsize == 4)

# Fewer tokens than this are encoded in plain Python: numpy's fixed cost per call (~10
# array operations, ~10 µs) exceeds a per-token loop (~0.13 µs a token) below ~80 tokens,
# which covers the decode path (one page at a time).
_NUMPY_MIN_TOKENS: Final = 80


# --------------------------------------------------------------------------------------
# Generic canonical CBOR for the few shapes a page message holds
# --------------------------------------------------------------------------------------
def _head(major: int, value: int) -> bytes:
    """CBOR item head: major type + argument in its shortest form (canonical)."""
    mt = major << 5
    if value < 24:
        return bytes((mt | value,))
    if value < 0x100:
        return bytes((mt | 24, value))
    if value < 0x1_0000:
        return struct.pack(">BH", mt | 25, value)
    if value < 0x1_0000_0000:
        return struct.pack(">BI", mt | 26, value)
    if value < _UINT64_LIMIT:
        return struct.pack(">BQ", mt | 27, value)
    # cbor2 would switch to a bignum tag here; nothing pagekeeper hashes gets this large.
    raise InvalidArgument(f"integer {value} does not fit in 64 bits")


def _encode_int(value: int) -> bytes:
    return _head(0, value) if value >= 0 else _head(1, -1 - value)


# An image's offset relative to each page it covers, and a page's count of keys: the same
# few values again and again (one bytes object each, shared).
_int_item = lru_cache(maxsize=1 << 16)(_encode_int)
_ARRAY_HEADS = tuple(bytes((0x80 | n,)) for n in range(24))


def _array_head(n: int) -> bytes:
    return _ARRAY_HEADS[n] if n < 24 else _head(4, n)


def encode_cbor(obj: CborValue) -> bytes:
    """Canonical CBOR of ``obj`` (None, bool, int within ±2**64, str, bytes, tuples/lists).

    Equals ``cbor2.dumps(obj, canonical=True)`` on these types: shortest integer heads,
    tuples as definite-length arrays, str as UTF-8 text, bytes as byte strings.
    """
    if obj is None:
        return b"\xf6"
    if obj is True:
        return b"\xf5"
    if obj is False:
        return b"\xf4"
    if isinstance(obj, int):
        return _encode_int(obj)
    if isinstance(obj, str):
        try:
            raw = obj.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidArgument(f"string is not valid UTF-8: {obj!r}") from exc
        return _head(3, len(raw)) + raw
    if isinstance(obj, bytes | bytearray | memoryview):
        raw = bytes(obj)
        return _head(2, len(raw)) + raw
    if isinstance(obj, tuple | list):
        return _head(4, len(obj)) + b"".join(encode_cbor(item) for item in obj)
    raise InvalidArgument(f"cannot hash a value of type {type(obj).__name__}")


# --------------------------------------------------------------------------------------
# Extra keys (vLLM's generate_block_hash_extra_keys)
# --------------------------------------------------------------------------------------
def validate_extra_keys(extra_keys: ExtraKeys) -> None:
    """InvalidArgument unless ``extra_keys`` is what hashing takes (types; LoRA path only
    with a name; placeholders sorted and disjoint)."""
    if not isinstance(extra_keys, ExtraKeys):
        raise InvalidArgument(f"extra_keys must be ExtraKeys, got {type(extra_keys).__name__}")
    if extra_keys.lora_name is not None and not isinstance(extra_keys.lora_name, str):
        raise InvalidArgument("extra_keys.lora_name must be a str")
    if extra_keys.lora_path is not None:
        if not isinstance(extra_keys.lora_path, str):
            raise InvalidArgument("extra_keys.lora_path must be a str")
        if extra_keys.lora_name is None:
            raise InvalidArgument("extra_keys.lora_path is set but lora_name is not")
    if extra_keys.cache_salt is not None and not isinstance(extra_keys.cache_salt, str):
        raise InvalidArgument("extra_keys.cache_salt must be a str")
    previous_end = 0
    for i, mm in enumerate(extra_keys.mm_inputs):
        where = f"extra_keys.mm_inputs[{i}]"
        if not isinstance(mm.identifier, str) or not mm.identifier:
            raise InvalidArgument(f"{where}.identifier must be a non-empty str")
        if not isinstance(mm.offset, int) or isinstance(mm.offset, bool) or mm.offset < 0:
            raise InvalidArgument(f"{where}.offset must be an int >= 0, got {mm.offset!r}")
        if not isinstance(mm.length, int) or isinstance(mm.length, bool) or mm.length < 1:
            raise InvalidArgument(f"{where}.length must be an int >= 1, got {mm.length!r}")
        # vLLM assumes placeholders sorted by offset and disjoint (its per-page cursor and
        # its window bisection both rely on it); anything else is a caller bug.
        if mm.offset < previous_end:
            raise InvalidArgument(
                f"{where}: placeholders must be sorted by offset and must not overlap "
                f"(offset {mm.offset} < previous end {previous_end})"
            )
        previous_end = mm.offset + mm.length


def page_extra_keys(
    extra_keys: ExtraKeys | None, page_index: int, page_size: int
) -> ExtraKeyTuple | None:
    """The extra keys vLLM hashes into page ``page_index`` (tokens
    ``[page_index*page_size, (page_index+1)*page_size)``), as plain tuples; None if none.

    LoRA (name *and* path) on every page, then every multimodal input overlapping the
    page as ``("mm", identifier, offset relative to the page start)``, then the cache salt
    on page 0 only. A LoRA without a path is keyed with ``None`` as its path (vLLM requires
    a path, so this never collides with a vLLM key).
    """
    if extra_keys is None:
        return None
    validate_extra_keys(extra_keys)
    return run_extra_keys(extra_keys, page_index, 1, page_size)[0]


def input_pages(offset: int, end: int, first_page: int, stop: int, page_size: int) -> range:
    """The pages among ``first_page .. stop - 1`` that a placeholder over tokens
    ``[offset, end)`` overlaps (each carries that input in its hash)."""
    return range(max(offset // page_size, first_page), min((end - 1) // page_size + 1, stop))


def narrow_extra_keys(
    extra_keys: ExtraKeys, first_page: int, num_pages: int, page_size: int
) -> ExtraKeys | None:
    """The part of a request's (validated) keys that falls on its pages ``first_page ..
    first_page + num_pages - 1``: the LoRA, the multimodal inputs overlapping them, the
    salt when page 0 is one of them; None when nothing falls there. Over those pages
    :func:`run_extra_keys` of it equals that of the whole (what an event keeps: a request
    with a thousand images does not copy them into every page's event). The same object
    when nothing is left out."""
    mm = extra_keys.mm_inputs
    kept = mm
    if mm:
        start, end = first_page * page_size, (first_page + num_pages) * page_size
        # Sorted and apart (validated): the inputs ending after start, up to the first
        # that begins at or after end.
        lo = bisect.bisect_right(mm, start, key=_mm_end)
        hi = bisect.bisect_left(mm, end, lo, key=_mm_offset)
        if lo or hi < len(mm):
            kept = mm[lo:hi]
    salt = extra_keys.cache_salt if first_page == 0 else None
    if kept is mm and salt == extra_keys.cache_salt:
        return extra_keys
    if not kept and not salt and extra_keys.lora_name is None:
        return None
    return ExtraKeys(
        lora_name=extra_keys.lora_name,
        lora_path=extra_keys.lora_path,
        mm_inputs=kept,
        cache_salt=salt,
    )


def _mm_end(mm: MultiModalKey) -> int:
    return mm.offset + mm.length


def _mm_offset(mm: MultiModalKey) -> int:
    return mm.offset


def run_extra_keys(
    extra_keys: ExtraKeys, first_page: int, num_pages: int, page_size: int
) -> list[ExtraKeyTuple | None]:
    """:func:`page_extra_keys` of pages ``first_page .. first_page + num_pages - 1`` of a
    request whose keys were validated (on admission)."""
    lora = (
        (("lora", extra_keys.lora_name, extra_keys.lora_path),)
        if extra_keys.lora_name is not None
        else ()
    )
    mm_inputs = extra_keys.mm_inputs
    salt = extra_keys.cache_salt
    out: list[ExtraKeyTuple | None] = []
    for page in range(first_page, first_page + num_pages):
        start = page * page_size
        end = start + page_size
        keys: list[tuple[str | int | None, ...]] = [*lora]
        for mm in mm_inputs:
            if mm.offset < end and mm.offset + mm.length > start:
                keys.append(("mm", mm.identifier, mm.offset - start))
        if page == 0 and salt:
            keys.append(("cache_salt", salt))
        out.append(tuple(keys) if keys else None)
    return out


class _CompiledKeys:
    """A request's extra keys, pre-encoded: what every page carries, and how to build the
    few pages that differ (page 0 with a salt, pages overlapping a multimodal input)."""

    __slots__ = ("common", "lora", "mm", "salt")

    def __init__(self, extra_keys: ExtraKeys | None) -> None:
        if extra_keys is not None:
            validate_extra_keys(extra_keys)
        ek = extra_keys or ExtraKeys()
        self.lora = (
            encode_cbor(("lora", ek.lora_name, ek.lora_path)) if ek.lora_name is not None else b""
        )
        # vLLM keys a salt only when it is truthy: an empty salt is no salt.
        self.salt = encode_cbor(("cache_salt", ek.cache_salt)) if ek.cache_salt else b""
        # (encoded `array(3) "mm" identifier` prefix, offset, end) per input.
        self.mm = tuple(
            (
                b"\x83" + encode_cbor("mm") + encode_cbor(mm.identifier),
                mm.offset,
                mm.offset + mm.length,
            )
            for mm in ek.mm_inputs
        )
        self.common = b"\x81" + self.lora if self.lora else b"\xf6"

    def special_pages(self, first_page: int, num_pages: int, page_size: int) -> dict[int, bytes]:
        """Encoded extra keys of the pages in ``[first_page, first_page+num_pages)`` whose
        keys differ from ``common``, by index relative to ``first_page``."""
        stop = first_page + num_pages
        # Per page: array(n) | lora | its inputs' items | salt. An image spans dozens of
        # pages: one bytes object per page from cached parts (0.85 -> ~0.3 us a page).
        items_by_page: dict[int, list[bytes]] = {}
        get = items_by_page.get
        for prefix, offset, end in self.mm:
            for page in input_pages(offset, end, first_page, stop, page_size):
                item = prefix + _int_item(offset - page * page_size)
                items = get(page)
                if items is None:
                    items_by_page[page] = [item]
                else:
                    items.append(item)
        if self.salt and first_page == 0 and num_pages > 0:
            items_by_page.setdefault(0, []).append(self.salt)
        lora = self.lora
        base = 1 if lora else 0
        return {
            page - first_page: _array_head(base + len(items)) + lora + b"".join(items)
            for page, items in items_by_page.items()
        }


_NO_KEYS: Final = _CompiledKeys(None)
_EMPTY_EXTRA_KEYS: Final = ExtraKeys()


# --------------------------------------------------------------------------------------
# Token ids -> CBOR bodies
# --------------------------------------------------------------------------------------
def _as_uint32(token_ids: TokenIds) -> npt.NDArray[np.unsignedinteger[Any]] | None:
    """Token ids as an unsigned array when every id is in ``[0, 2**32)`` (the numpy
    encoder's domain, i.e. any real vocabulary), else None: the plain-Python encoder then
    takes the ids as they are, encodes any 64-bit id and refuses invalid ones. Negative
    ids in an integer array are refused here."""
    if (
        isinstance(token_ids, array.array)
        and token_ids.typecode in "QL"
        and token_ids.itemsize == 8
    ):
        # A request's stored tokens (unsigned 64-bit): viewed, not converted one by one.
        token_ids = np.frombuffer(token_ids, dtype=np.uint64)
    if isinstance(token_ids, np.ndarray):
        kind = token_ids.dtype.kind
        if kind == "O":
            return None
        if kind not in ("i", "u"):
            raise InvalidArgument(f"token_ids must be integers, got dtype {token_ids.dtype}")
        if kind == "i" and token_ids.size and int(token_ids.min()) < 0:
            raise InvalidArgument(f"token ids must be >= 0, got {int(token_ids.min())}")
        # Known >= 0: the same bits as unsigned (no copy).
        unsigned = cast(
            "npt.NDArray[np.unsignedinteger[Any]]",
            token_ids.view(token_ids.dtype.str.replace("i", "u")),
        )
        if unsigned.dtype.itemsize > 4 and unsigned.size and int(unsigned.max()) >> 32:
            return None
        return unsigned
    try:
        # One C call converts and range-checks (refusing negatives, ids >= 2**32 and
        # non-integers): several times faster than np.array() on a list of ints.
        packed = array.array(_UINT32_TYPECODE, token_ids)
    except (OverflowError, TypeError):
        return None
    return np.frombuffer(packed, dtype=np.uint32)


def _describe_bad_token(token_ids: Sequence[Any]) -> str:
    for i, token in enumerate(token_ids):
        if not isinstance(token, int | np.integer) or isinstance(token, bool | np.bool_):
            return f"token_ids[{i}] is not an int: {token!r}"
        if not 0 <= int(token) < _UINT64_LIMIT:
            return f"token_ids[{i}] out of range [0, 2**64): {int(token)}"
    return "token_ids: invalid token id"  # pragma: no cover - struct agreed with the loop


def _encode_uints_py(values: Sequence[int]) -> bytes:
    """Concatenated CBOR uints, for a handful of values (no numpy round trip). Raises
    struct.error / TypeError on a negative, too large or non-integer value."""
    fmt: list[str] = []
    args: list[int] = []
    add_fmt = fmt.append
    add_arg = args.append
    # Largest classes first: ids of a big vocabulary are mostly >= 2**16.
    for v in values:
        if v >= 0x1_0000:
            if v < 0x1_0000_0000:
                add_fmt("BI")
                add_arg(0x1A)
            else:
                add_fmt("BQ")
                add_arg(0x1B)
        elif v >= 0x100:
            add_fmt("BH")
            add_arg(0x19)
        elif v >= 24:
            add_fmt("BB")
            add_arg(0x18)
        else:
            add_fmt("B")  # below 24 the value is its own head (negatives fail in pack)
        add_arg(v)
    return struct.pack(">" + "".join(fmt), *args)


# Vectorised CBOR for the tokens of all pages at once: every token becomes one big-endian
# 64-bit word holding its whole encoding right-aligned (head byte just above the payload;
# an id below 2**32 takes at most 5 bytes). A keep mask per word (one uint64 whose bytes
# are 0/1, looked up by size class) marks the bytes of the encoding, and one compress over
# all words yields the concatenated encodings, in order. Few numpy calls on purpose: each
# costs a microsecond or more (much more with cold caches), the data itself is small.
_CLASS_BOUNDS: Final = np.array([24, 0x100, 0x1_0000], dtype=np.uint64)
_CLASS_HEAD: Final = np.array([0, 0x18 << 8, 0x19 << 16, 0x1A << 32], dtype=np.uint64)
_CLASS_LEN: Final = np.array([1, 2, 3, 5], dtype=np.int64)


def _keep_masks() -> npt.NDArray[np.uint64]:
    keep = np.zeros((len(_CLASS_LEN), 8), dtype=np.bool_)
    for cls, length in enumerate(_CLASS_LEN):
        keep[cls, 8 - length :] = True
    return keep.view(np.uint64).reshape(-1)


# _KEEP[c]: the last len(class c) bytes of a token word.
_KEEP: Final = _keep_masks()


def _encode_tokens_np(
    tokens: npt.NDArray[np.unsignedinteger[Any]], page_size: int
) -> tuple[bytes, list[int]]:
    """The CBOR uints of all tokens (each < 2**32), concatenated, and the end offset of
    every page's run of them."""
    # Size class 0..3 (< 24, < 2**8, < 2**16, < 2**32): one byte, then 1, 2, 4 payload bytes.
    cls = np.searchsorted(_CLASS_BOUNDS, tokens, side="right")
    words = np.empty(tokens.shape[0], dtype=">u8")
    # A value below 24 is its own head; class c's head byte sits just above its payload.
    np.bitwise_or(tokens, _CLASS_HEAD.take(cls), out=words)
    keep = _KEEP.take(cls)
    body = np.compress(keep.view(np.bool_), words.view(np.uint8))
    ends = _CLASS_LEN.take(cls).cumsum()[page_size - 1 :: page_size]
    return body.tobytes(), ends.tolist()


def _encode_tokens(
    tokens: npt.NDArray[np.unsignedinteger[Any]], page_size: int
) -> tuple[bytes, list[int]]:
    """``_encode_tokens_np``, in C when the accelerator is built (10x faster)."""
    if _native is None:
        return _encode_tokens_np(tokens, page_size)
    if not (tokens.flags.c_contiguous and tokens.dtype.isnative):
        tokens = np.ascontiguousarray(tokens, dtype=tokens.dtype.newbyteorder("="))
    encoded: tuple[bytes, list[int]] = _native.encode_pages(tokens, page_size)
    return encoded


def _encode_tokens_py(tokens: Sequence[int], page_size: int) -> tuple[bytes, list[int]]:
    """The same as ``_encode_tokens_np``, in plain Python (a few pages, or ids >= 2**32)."""
    parts = [
        _encode_uints_py(tokens[start : start + page_size])
        for start in range(0, len(tokens) - page_size + 1, page_size)
    ]
    ends: list[int] = []
    end = 0
    for part in parts:
        end += len(part)
        ends.append(end)
    return b"".join(parts), ends


# --------------------------------------------------------------------------------------
# Digests and chaining
# --------------------------------------------------------------------------------------
def _check_algorithm(algorithm: str) -> None:
    if algorithm not in _DIGEST_SIZES:
        raise ConfigError(
            "hash_algorithm", f"unknown {algorithm!r}; one of {list(HASH_ALGORITHMS)}"
        )
    if algorithm == XXHASH_CBOR and _xxh3_128_digest is None:
        raise ConfigError(
            "hash_algorithm", "xxhash_cbor needs the xxhash package (pip install xxhash)"
        )


def digest_size(algorithm: str) -> int:
    """Bytes in one page hash: 32 for ``sha256_cbor``, 16 for ``xxhash_cbor``."""
    _check_algorithm(algorithm)
    return _DIGEST_SIZES[algorithm]


def _digest(algorithm: str, data: bytes) -> bytes:
    if algorithm == SHA256_CBOR:
        return hashlib.sha256(data).digest()
    assert _xxh3_128_digest is not None  # _check_algorithm ran first
    return _xxh3_128_digest(data)


@lru_cache(maxsize=16)
def none_hash(algorithm: str = SHA256_CBOR, seed: str = DEFAULT_NONE_HASH_SEED) -> bytes:
    """The parent hash of page 0: ``H(cbor(seed))`` (vLLM's ``NONE_HASH``)."""
    _check_algorithm(algorithm)
    return _digest(algorithm, encode_cbor(seed))


NONE_HASH: Final[bytes] = none_hash(SHA256_CBOR)
"""vLLM's NONE_HASH for ``sha256_cbor``: sha256 of ``cbor("vllm-none-hash")``."""


# `array(3)` + the byte-string head of a parent of each digest size.
_PARENT_HEADS: Final = {size: b"\x83" + _head(2, size) for size in _DIGEST_SIZES.values()}


def _parent_head(parent: bytes) -> bytes:
    """``array(3)`` + the byte-string head of ``parent`` (any length: a caller-given hash)."""
    return _PARENT_HEADS.get(len(parent)) or b"\x83" + _head(2, len(parent))


def _sha256_one_page(
    parent: bytes,
    token_ids: array.array[int],
    start: int,
    page_size: int,
    array_head: bytes,
    extra: bytes,
) -> bytes:
    """sha256_cbor of the full page at ``start`` of ``array('Q')`` ids, read in place by
    the C loops (built)."""
    assert _native is not None
    digest: bytes = _native.sha256_page(
        _parent_head(parent),
        parent,
        array_head,
        token_ids,
        start,
        page_size,
        extra,
    )
    return digest


def _chain(
    algorithm: str,
    parent: bytes,
    array_head: bytes,
    tokens: bytes,
    ends: list[int],
    extras: bytes | list[bytes],
) -> list[bytes]:
    """Hash page after page, each hash the next page's parent. Page i's message::

    83 | bytes-head parent | array_head | tokens[ends[i-1]:ends[i]] | extras[i]

    ``extras``: one page's extra keys for every page (bytes), or a list, one per page.
    """
    # Page 0's parent may be any bytes (a caller-given hash); later parents are digests.
    first_head = _parent_head(parent)
    head = _PARENT_HEADS[_DIGEST_SIZES[algorithm]]
    if algorithm == SHA256_CBOR and _native is not None:
        chained: list[bytes] = _native.chain_sha256(
            first_head, head, parent, array_head, tokens, ends, extras
        )
        return chained
    join = b"".join
    out: list[bytes] = []
    append = out.append
    each: Iterable[bytes] = repeat(extras) if isinstance(extras, bytes) else extras
    pages = zip(ends, each, strict=False)
    start, extra = next(pages)
    # Two copies of one loop: a shared callable would add a Python frame per page.
    if algorithm == SHA256_CBOR:
        sha256 = hashlib.sha256
        parent = sha256(join((first_head, parent, array_head, tokens[:start], extra))).digest()
        append(parent)
        for end, extra in pages:
            parent = sha256(join((head, parent, array_head, tokens[start:end], extra))).digest()
            append(parent)
            start = end
    else:
        xxh = _xxh3_128_digest
        assert xxh is not None  # _check_algorithm ran first
        parent = xxh(join((first_head, parent, array_head, tokens[:start], extra)))
        append(parent)
        for end, extra in pages:
            parent = xxh(join((head, parent, array_head, tokens[start:end], extra)))
            append(parent)
            start = end
    return out


def _check_positive_int(name: str, value: object, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise InvalidArgument(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


class PageHasher:
    """Hashes one request's pages, with its page size, extra keys and algorithm bound once
    (keys pre-encoded), for incremental use: :meth:`extend` after every step.

    >>> hasher = PageHasher(16)
    >>> hashes: list[bytes] = []
    >>> len(hasher.extend(hashes, range(40)))  # pages 0 and 1 are full
    2
    >>> len(hasher.extend(hashes, range(48))), len(hashes)  # page 2 just filled
    (1, 3)
    """

    __slots__ = (
        "_array_head",
        "_keys",
        "_none_hash",
        "_one_page_extra",
        "algorithm",
        "extra_keys",
        "page_size",
    )

    def __init__(
        self,
        page_size: int,
        *,
        extra_keys: ExtraKeys | None = None,
        algorithm: str = SHA256_CBOR,
    ) -> None:
        self.page_size = _check_positive_int("page_size", page_size, 1)
        _check_algorithm(algorithm)
        self.algorithm = algorithm
        self.extra_keys = extra_keys
        self._keys = _NO_KEYS if extra_keys is None else _CompiledKeys(extra_keys)
        self._none_hash = none_hash(algorithm)
        self._array_head = _head(4, page_size)
        # The extra keys of every page when they are the same for every page but page 0
        # (no multimodal input) and sha256_cbor: hash_next's direct path (None: _hash).
        self._one_page_extra = (
            self._keys.common if algorithm == SHA256_CBOR and not self._keys.mm else None
        )

    def native_page_parts(self) -> tuple[Callable[..., bytes], bytes, bytes, bytes, bytes] | None:
        """``(sha256_page, head, array_head, extra, none_hash)``: what the C decode loop
        needs to hash a page of stored ids as :meth:`hash_next` does, for pages whose
        parent is a 32-byte digest and whose keys are the same on every page (no
        multimodal input, no salt); None when that is not C's to do here."""
        if self._one_page_extra is None or _native is None or self._keys.salt:
            return None
        return (
            _native.sha256_page,
            _PARENT_HEADS[32],
            self._array_head,
            self._one_page_extra,
            self._none_hash,
        )

    def hash_pages(
        self,
        token_ids: TokenIds,
        *,
        parent: bytes | None = None,
        first_page_index: int = 0,
    ) -> list[bytes]:
        """Hashes of the full pages in ``token_ids``; see :func:`hash_pages`."""
        first_page_index = _check_positive_int("first_page_index", first_page_index, 0)
        if parent is None:
            parent = self._none_hash
        elif not isinstance(parent, bytes):
            raise InvalidArgument(f"parent must be bytes, got {type(parent).__name__}")
        return self._hash(token_ids, parent, first_page_index)

    def extend(self, hashes: list[bytes], token_ids: TokenIds) -> list[bytes]:
        """Append to ``hashes`` (this request's page hashes so far) the hashes of the pages
        that ``token_ids`` (*all* its tokens so far) has filled since; returns those."""
        page_size = self.page_size
        num_hashed = len(hashes)
        num_full = len(token_ids) // page_size
        if num_full <= num_hashed:
            if num_full < num_hashed:
                raise InvalidArgument(
                    f"{num_hashed} page hashes but only {len(token_ids)} tokens "
                    f"({num_full} full pages of {page_size})"
                )
            return []
        new = self._hash(
            token_ids[num_hashed * page_size : num_full * page_size],
            hashes[-1] if hashes else self._none_hash,
            num_hashed,
        )
        hashes += new
        return new

    def hash_next(self, hashes: list[bytes], token_ids: Sequence[int]) -> bytes:
        """:meth:`extend` when ``token_ids`` (*all* the request's tokens so far) fill
        exactly one page past ``hashes`` (e.g. the page a decode just filled): append its
        hash and return it. The decode step's shortest path, with no chain machinery."""
        page_size = self.page_size
        k = len(hashes)
        if len(token_ids) // page_size != k + 1:
            raise InvalidArgument(
                f"hash_next needs one page of {page_size} tokens past {k} hashed pages, "
                f"got {len(token_ids)} tokens"
            )
        new = self.hash_page(token_ids, k, hashes[-1] if k else None)
        hashes.append(new)
        return new

    def hash_page(self, token_ids: Sequence[int], index: int, parent: bytes | None) -> bytes:
        """The hash of full page ``index`` of ``token_ids`` under ``parent`` (the hash of
        page ``index - 1``; None for page 0): one page of a chain without the chain
        machinery (a lookup's first page, the page a decode filled)."""
        if index < 0:
            raise InvalidArgument(f"page index must be >= 0, got {index}")
        if parent is None:
            parent = self._none_hash
        page_size = self.page_size
        start = index * page_size
        extra = self._one_page_extra
        if (
            extra is not None
            and _native is not None
            and type(token_ids) is array.array
            and token_ids.typecode == "Q"
            and (index or not self._keys.salt)
            and start + page_size <= len(token_ids)
        ):
            # A request's stored ids (valid by type): read in place by one C call, 0.3
            # against 1.5 us through _hash's checks and a slice.
            return _sha256_one_page(parent, token_ids, start, page_size, self._array_head, extra)
        pages = self._hash(token_ids[start : start + page_size], parent, index)
        if len(pages) != 1:
            raise InvalidArgument(f"page {index} of {len(token_ids)} tokens is not full")
        return pages[0]

    def _hash(self, token_ids: TokenIds, parent: bytes, first_page: int) -> list[bytes]:
        page_size = self.page_size
        if isinstance(token_ids, np.ndarray) and token_ids.ndim != 1:
            raise InvalidArgument(f"token_ids must be 1-D, got shape {token_ids.shape}")
        num_pages = len(token_ids) // page_size
        if num_pages == 0:
            return []
        num_tokens = num_pages * page_size
        keys = self._keys
        # Most pages carry the same extra keys; the few that differ are listed.
        extras: bytes | list[bytes] = keys.common
        if keys.mm or (keys.salt and first_page == 0):
            special = keys.special_pages(first_page, num_pages, page_size)
            extras = [special.get(page, keys.common) for page in range(num_pages)]
        tokens: Sequence[int]
        if num_pages == 1 and not isinstance(token_ids, np.ndarray):
            # The decode step: one page just filled. No chain machinery.
            page = token_ids[:page_size]
            extra = extras if isinstance(extras, bytes) else extras[0]
            if _native is not None and self.algorithm == SHA256_CBOR:
                # 1.0 us against 4.6 in Python (16 tokens): the array checks every id.
                try:
                    checked = array.array("Q", page)
                except (OverflowError, TypeError) as exc:
                    raise InvalidArgument(_describe_bad_token(page)) from exc
                return [_sha256_one_page(parent, checked, 0, page_size, self._array_head, extra)]
            head = _parent_head(parent)
            try:
                encoded = _encode_uints_py(page)
            except (struct.error, TypeError) as exc:
                raise InvalidArgument(_describe_bad_token(page)) from exc
            message = b"".join((head, parent, self._array_head, encoded, extra))
            return [_digest(self.algorithm, message)]
        if _native is not None and type(token_ids) is array.array and token_ids.typecode == "Q":
            # A request's stored tokens (unsigned 64-bit, so valid): the C encoder reads
            # them in place and encodes any id, so no numpy view or range check is needed.
            # It encodes the full pages only.
            body, ends = _native.encode_pages(token_ids, page_size)
            return _chain(self.algorithm, parent, self._array_head, body, ends, extras)
        if num_tokens >= _NUMPY_MIN_TOKENS or _native is not None:
            # A list is packed whole (no slice copy) and its partial page dropped after.
            whole = isinstance(token_ids, np.ndarray)
            values = _as_uint32(token_ids[:num_tokens] if whole else token_ids)
            if values is not None:
                body, ends = _encode_tokens(values[:num_tokens], page_size)
                return _chain(self.algorithm, parent, self._array_head, body, ends, extras)
        hashed = token_ids[:num_tokens]
        if isinstance(hashed, np.ndarray):
            values = _as_uint32(hashed)  # refuses non-integer dtypes and negative ids
            tokens = (hashed if values is None else values).tolist()
        else:
            tokens = hashed
        try:
            body, ends = _encode_tokens_py(tokens, page_size)
        except (struct.error, TypeError) as exc:
            raise InvalidArgument(_describe_bad_token(tokens)) from exc
        return _chain(self.algorithm, parent, self._array_head, body, ends, extras)


def hash_pages(
    token_ids: TokenIds,
    page_size: int,
    *,
    extra_keys: ExtraKeys | None = None,
    algorithm: str = SHA256_CBOR,
    parent: bytes | None = None,
    first_page_index: int = 0,
) -> list[bytes]:
    """Chained hashes of every full page of ``token_ids``; a trailing partial page is not
    hashed.

    ``token_ids[0]`` is token ``first_page_index * page_size`` of the request, so a
    request can be hashed piecewise: the cache salt goes into page 0 only and multimodal
    overlaps use absolute positions. ``parent`` is the hash of the page before the first
    (None: :func:`none_hash` of the algorithm). Raises InvalidArgument on negative or
    non-integer token ids, bad extra keys or a bad page size, ConfigError on an unknown
    algorithm.
    """
    if (
        (extra_keys is None or extra_keys == _EMPTY_EXTRA_KEYS)
        and type(page_size) is int
        and type(algorithm) is str
    ):
        hasher = _plain_hasher(page_size, algorithm)
    else:
        hasher = PageHasher(page_size, extra_keys=extra_keys, algorithm=algorithm)
    return hasher.hash_pages(token_ids, parent=parent, first_page_index=first_page_index)


@lru_cache(maxsize=64)
def _plain_hasher(page_size: int, algorithm: str) -> PageHasher:
    # Hashers hold no per-request state: requests without extra keys can share one.
    return PageHasher(page_size, algorithm=algorithm)


def join_hashes(
    hashes: Sequence[bytes], factor: int, *, mode: Literal["concat", "last"] = "last"
) -> list[bytes]:
    """Hashes of a group whose page size is ``factor`` times the hash page size, one per
    *complete* big page (a trailing partial big page gets none).

    ``"last"`` (default): the big page's last small hash, which already chains over the
    whole prefix; vLLM 0.33's ``BlockHashListWithBlockSize`` does this (it keys each group's
    index by group id, so equal bytes in two groups never collide). ``"concat"``: the
    concatenation of its ``factor`` small hashes, as earlier vLLM releases merged them.
    Both identify the same prefixes, so they give the same cache hits; they differ only in
    the bytes (and in the events).
    """
    factor = _check_positive_int("factor", factor, 1)
    if mode not in ("concat", "last"):
        raise InvalidArgument(f"mode must be 'concat' or 'last', got {mode!r}")
    num_big = len(hashes) // factor
    if factor == 1:
        return list(hashes[:num_big])
    if mode == "last":
        return list(hashes[factor - 1 : num_big * factor : factor])
    return [b"".join(hashes[i * factor : (i + 1) * factor]) for i in range(num_big)]
