"""Page hashing: bit-exact with vLLM 0.33 (``sha256_cbor`` / ``xxhash_cbor``).

Three independent references: the shared vectors (computed by vLLM), more vectors computed
here with vLLM 0.33's own ``get_request_block_hasher`` (multimodal, integer widths, page
sizes, xxhash), and an in-test model of vLLM's algorithm (cbor2 + hashlib, vLLM's per-page
multimodal cursor) that hypothesis compares against on random requests.
"""

from __future__ import annotations

import array
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import cbor2
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pagekeeper.core import hashing
from pagekeeper.core.errors import ConfigError, InvalidArgument
from pagekeeper.core.hashing import (
    NONE_HASH,
    PageHasher,
    digest_size,
    encode_cbor,
    hash_pages,
    join_hashes,
    none_hash,
    page_extra_keys,
)
from pagekeeper.core.types import ExtraKeys, MultiModalKey
from tests.helpers.keys import extra_keys as request_keys
from tests.helpers.props import examples

try:
    import xxhash
except ImportError:  # pragma: no cover - xxhash is a declared dependency
    xxhash = None

needs_xxhash = pytest.mark.skipif(xxhash is None, reason="xxhash not installed")

# The shared tree beside the checkout is the source of truth; a copy is vendored beside this
# file so the test never depends on a tree outside the repository.
_REPO = Path(__file__).resolve().parents[2]
VECTORS_PATH = next(
    (
        p
        for p in (
            _REPO.parent / "shared" / "vectors" / "block_hashes.json",
            _REPO / "shared" / "vectors" / "block_hashes.json",
        )
        if p.exists()
    ),
    Path(__file__).resolve().parent / "data" / "block_hashes.json",
)
VECTORS = json.loads(VECTORS_PATH.read_text())

SETTINGS = settings(
    max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@contextmanager
def forced_encoder(kind: str) -> Iterator[None]:
    """Route every call through the numpy encoder (``"numpy"``, for ids below 2**32), the
    plain-Python one (``"python"``), whatever the token count, or the C loops of
    ``pagekeeper.core._native`` (``"native"``: its encoder and SHA-256 chain)."""
    saved = hashing._NUMPY_MIN_TOKENS, hashing._native
    hashing._NUMPY_MIN_TOKENS = 0 if kind == "numpy" else 1 << 62  # type: ignore[misc]
    if kind != "native":
        hashing._native = None
    try:
        yield
    finally:
        hashing._NUMPY_MIN_TOKENS, hashing._native = saved  # type: ignore[misc]


# The C accelerator is tested where it is built (a C compiler and OpenSSL's headers).
ENCODERS = ["numpy", "python"] + (["native"] if hashing.native_hashing() else [])


# --------------------------------------------------------------------------------------
# Reference model: vLLM 0.33's algorithm, written out with cbor2 (not our encoder)
# --------------------------------------------------------------------------------------
def ref_digest(algorithm: str, obj: Any) -> bytes:
    data = cbor2.dumps(obj, canonical=True)
    if algorithm == "sha256_cbor":
        return hashlib.sha256(data).digest()
    assert xxhash is not None
    return xxhash.xxh3_128_digest(data)


def ref_mm_keys(
    mm: Sequence[MultiModalKey], start: int, end: int, mm_idx: int
) -> tuple[list[tuple[Any, ...]], int]:
    """vLLM's ``_gen_mm_extra_hash_keys``: a cursor over the (sorted) inputs."""
    keys: list[tuple[Any, ...]] = []
    if not mm or mm[-1].offset + mm[-1].length <= start:
        return keys, mm_idx
    while mm_idx < len(mm):
        item = mm[mm_idx]
        if end > item.offset:
            if start >= item.offset + item.length:
                mm_idx += 1
                continue
            keys.append(("mm", item.identifier, item.offset - start))
            if end >= item.offset + item.length:
                mm_idx += 1
            else:
                break
        else:
            break
    return keys, mm_idx


def ref_hashes(
    tokens: Sequence[int],
    page_size: int,
    extra: ExtraKeys | None = None,
    algorithm: str = "sha256_cbor",
) -> list[bytes]:
    """``get_request_block_hasher`` over the whole request."""
    extra = extra or ExtraKeys()
    parent = ref_digest(algorithm, "vllm-none-hash")
    out: list[bytes] = []
    mm_idx = 0
    for start in range(0, len(tokens) - page_size + 1, page_size):
        end = start + page_size
        mm_keys, mm_idx = ref_mm_keys(extra.mm_inputs, start, end, mm_idx)
        lora = [("lora", extra.lora_name, extra.lora_path)] if extra.lora_name is not None else []
        salt = [("cache_salt", extra.cache_salt)] if start == 0 and extra.cache_salt else []
        keys = lora + mm_keys + salt
        page = tuple(int(t) for t in tokens[start:end])
        parent = ref_digest(algorithm, (parent, page, tuple(keys) if keys else None))
        out.append(parent)
    return out


def extra_from_case(case: dict[str, Any]) -> ExtraKeys:
    lora = case.get("lora")
    if isinstance(lora, dict):
        lora = (lora["name"], lora["path"])
    return ExtraKeys(
        lora_name=lora[0] if lora else None,
        lora_path=lora[1] if lora else None,
        mm_inputs=tuple(MultiModalKey(*m) for m in case.get("mm", ())),
        cache_salt=case.get("cache_salt"),
    )


# --------------------------------------------------------------------------------------
# Vectors
# --------------------------------------------------------------------------------------
def test_none_hash_matches_vllm() -> None:
    assert NONE_HASH.hex() == VECTORS["none_hash"]
    assert none_hash() == NONE_HASH
    assert none_hash("sha256_cbor") == NONE_HASH
    assert none_hash("sha256_cbor", "other-seed") != NONE_HASH


@pytest.mark.parametrize("case", VECTORS["cases"], ids=lambda c: c["name"])
@pytest.mark.parametrize("as_array", [False, True], ids=["list", "array"])
@pytest.mark.parametrize("encoder", ENCODERS)
def test_shared_vectors(case: dict[str, Any], as_array: bool, encoder: str) -> None:
    tokens = np.array(case["token_ids"], dtype=np.int64) if as_array else case["token_ids"]
    with forced_encoder(encoder):
        got = hash_pages(tokens, case["page_size"], extra_keys=extra_from_case(case))
    assert [h.hex() for h in got] == case["hashes"]
    assert all(len(h) == 32 for h in got)


@pytest.mark.parametrize("case", VECTORS["cases"], ids=lambda c: c["name"])
def test_shared_vectors_token_by_token(case: dict[str, Any]) -> None:
    hasher = PageHasher(case["page_size"], extra_keys=extra_from_case(case))
    hashes: list[bytes] = []
    for n in range(len(case["token_ids"]) + 1):
        hasher.extend(hashes, case["token_ids"][:n])
    assert [h.hex() for h in hashes] == case["hashes"]


def vllm_tokens(n: int) -> list[int]:
    return [(i * 7919 + 13) % 151_000 for i in range(n)]


# Computed with vLLM 0.33.0's own code (Request + get_request_block_hasher; PYTHONHASHSEED
# set to "vllm-none-hash" so that its xxhash NONE_HASH is deterministic). Tokens:
# vllm_tokens(n) unless listed. "mm incremental decode" was built from a 37-token prompt
# plus 63 output tokens appended one at a time (vLLM's incremental path).
# fmt: off
VLLM_CASES: list[dict[str, Any]] = [
    dict(
        name="mm one image across pages", page_size=16, n=80, mm=[("img-a", 5, 40)],
        hashes=[
            "e07a3e3d2f1daa308b325f2e6f4a750f9c966d77ea46799e4b862859d5a6f3cc",
            "923bdf3544533698037ebcf63622a164c0c3cc0f9c6859a493b5ed59ab506ae9",
            "b1124615361eb746e4cbe4d312c4b4217302995d52b34d7a64b2ced9ec25d4d3",
            "4678c9717d902952f4d4b8c30762fea7479c4c8b93eba61c3fc7e20cf994b4fb",
            "13334add7a79a3330d0c6a503f9a5c67de04ab0cf5d82f0fbcb50fda5a73c9de",
        ],
    ),
    dict(
        name="mm two inputs in one page, one page-aligned", page_size=16, n=96,
        mm=[("img-a", 3, 4), ("aud-b", 7, 20), ("img-c", 64, 16)],
        hashes=[
            "9e505bc666f24c8bde6576d2afded2bed16a7122d2184b1d0bf0859573cc0e01",
            "9de3e86bc04dfd44cc64357041bd88d15e97c3b2459850c5074a8c5ed411ba4c",
            "8e63b5dc37423172fe06d588b73a18a3194d4b1208926fe05aa3253f4603e2cc",
            "2924962ebfffb4825503c5f3264a07bff0e9f86dd9d14a120e0334ffbb0fd267",
            "c3afd870b8fa7b0536c6650207d8980b1c93e1cea6be164f856d0139a2a012f9",
            "0065c1eaa04d8187353db6e975b407ccde8c6d6dceedceef11745b7d0d812563",
        ],
    ),
    dict(
        name="mm + lora + salt", page_size=16, n=100, lora=("my-lora", "/adapters/my-lora"),
        cache_salt="salt-A", mm=[("img-a", 0, 16), ("img-b", 20, 30)],
        hashes=[
            "ac8e75b6ed78f4e1ee8ce8fc1b384b29d8c2599d0dad248083d1004a02cf9603",
            "62d7e9b4128ae2025f24849fcc5f172fdac487b45a821693ca9d2e8e03d4b6ac",
            "b88f51277d73ad2ae47ffd5a2852540af875af19822d75c8acc8dfbf6c04ba06",
            "1b29bda4ce7e035a58723b4fbad4870d042381c1cae165c456ed262853fb179e",
            "a572441b7d1fb2f29e723136659b928966fd0dcdad9daa1d790eaa4cf03a196f",
            "2e3c2f23a43c3b7ddfe3517eb70f91ed1a9bf3d42c4b7ec0d585c0ef0997c25e",
        ],
    ),
    dict(
        name="mm incremental decode", page_size=16, n=100, lora=("l", "/p"), cache_salt="s",
        mm=[("img-a", 10, 50)],
        hashes=[
            "4949368b228e5967b64fa9d60f5dba0820209fd670d1700ff1407aa649bf0b34",
            "dbcf51d78e4f8da16177f60a7674ee33d690fef4734aac591bc0f91d394891a3",
            "fedc103f314d072cc071ca8f9a64b9dca5c2962d1d4c3d5fbcea3180d69f5fb1",
            "b6db70edf72467136aa09c8b80e2b549cce9c322e6bc5b45f7fb9a83ca988ee9",
            "640c652ef2c334673bd03e6c199ddca17a5ef2f9cebfdf5174835897844db9c7",
            "94e6e1d2eb1d7f5eed27a46a87ef586a9f5ca891b85c51697f7ac09cef93c66e",
        ],
    ),
    dict(
        name="mm page 32 image ends exactly at page end", page_size=32, n=130,
        mm=[("x", 32, 32), ("y", 96, 1)],
        hashes=[
            "cba1e5c09ba3e334a2525cdff89344deb8d27357ebaaabde6f663b6a890803fe",
            "d2abb7a55e8706be3fc11fd04ee2bf0d09ac8572bbfc7a487a97bbabb0c0f3b4",
            "113b0c17dc9a297654d859789804dfdafbd2312818736c9c967b35330606bcdf",
            "79b14d7adfdd30746ae24673cc120931c1b46dc975c6b7cb6778292cf102a731",
        ],
    ),
    dict(
        name="cbor integer width edges", page_size=8,
        token_ids=[0, 1, 23, 24, 25, 255, 256, 257, 65535, 65536, 65537, 2**32 - 1, 2**32,
                   2**32 + 1, 2**63 - 1, 2**40 + 5, 100, 9],
        hashes=[
            "e137ffa87f16f4ec13e285826c84b37845991a5458049644cdca2a49982d034e",
            "378241d99afe777af8e1f2b8baa76544e2c98e70e85a802c0fd2e2d622dbea89",
        ],
    ),
    dict(
        name="page 24 (2-byte array head)", page_size=24, n=72,
        hashes=[
            "41b807422fc991bb7c157e3e8d1888f54ec0122b4f7458c9f7818d21cef5666f",
            "fe20438829f03bf30afb2bebbe84add9783a040e629b2140fe9d67aa3a0df9b2",
            "562651b589097dfe5b0e989b82a3c2f0aa79cb745827172a31107dce8256d69d",
        ],
    ),
    dict(
        name="page 256 (3-byte array head), long LoRA path", page_size=256, n=512,
        lora=("a" * 30, "/x/" + "b" * 300),
        hashes=[
            "71af28c9ef10e213ffbb60ec4020242828b97b58afa73d18122c3b0d341b1d34",
            "d7429afbcea11b3dd1cfbee4b9154ae11f3096de4b307e02b17c0f99ef95aad7",
        ],
    ),
    dict(
        name="xxhash_cbor plain", algorithm="xxhash_cbor", page_size=16, n=48,
        hashes=[
            "198baa40cd751398df23cb92701b2e8b",
            "b85cf07e91e93958e1c71834bd38645d",
            "0bd3e32dccaa1817c4795f65c561b29b",
        ],
    ),
    dict(
        name="xxhash_cbor lora salt mm", algorithm="xxhash_cbor", page_size=16, n=64,
        lora=("my-lora", "/adapters/my-lora"), cache_salt="salt-B", mm=[("img", 8, 20)],
        hashes=[
            "d5b73365f56ad5adc700963c6d8d8932",
            "f6a6e9690df9b2972037489171c8e6bd",
            "1eb2399e168cc3f60cd9aa707338206b",
            "69bd8db28b0c7fe75eb2f2b64e8434fb",
        ],
    ),
]
# fmt: on


def case_params() -> list[Any]:
    return [
        pytest.param(c, id=c["name"], marks=[needs_xxhash] if c.get("algorithm") else [])
        for c in VLLM_CASES
    ]


@pytest.mark.parametrize("case", case_params())
@pytest.mark.parametrize("encoder", ENCODERS)
def test_vllm_vectors(case: dict[str, Any], encoder: str) -> None:
    algorithm = case.get("algorithm", "sha256_cbor")
    tokens = case.get("token_ids") or vllm_tokens(case["n"])
    extra = extra_from_case(case)
    page_size = case["page_size"]
    expected = case["hashes"]

    def hexes(hashes: list[bytes]) -> list[str]:
        return [h.hex() for h in hashes]

    # The in-test reference model agrees with vLLM too.
    assert hexes(ref_hashes(tokens, page_size, extra, algorithm)) == expected
    with forced_encoder(encoder):
        got = hash_pages(tokens, page_size, extra_keys=extra, algorithm=algorithm)
        assert hexes(got) == expected
        as_array = np.array(tokens, dtype=np.uint64)
        got = hash_pages(as_array, page_size, extra_keys=extra, algorithm=algorithm)
        assert hexes(got) == expected
        # vLLM's own split of "mm incremental decode": a 37-token prompt, then one token
        # at a time.
        hasher = PageHasher(page_size, extra_keys=extra, algorithm=algorithm)
        hashes: list[bytes] = []
        hasher.extend(hashes, tokens[:37])
        for n in range(38, len(tokens) + 1):
            hasher.extend(hashes, tokens[:n])
        assert hexes(hashes) == expected


@needs_xxhash
def test_xxhash_none_hash_and_sizes() -> None:
    # vLLM with PYTHONHASHSEED=vllm-none-hash; pagekeeper never seeds randomly.
    assert none_hash("xxhash_cbor").hex() == "a4e364baa0791a6f63bbf917db9b700d"
    assert digest_size("xxhash_cbor") == 16
    assert digest_size("sha256_cbor") == 32
    assert all(len(h) == 16 for h in hash_pages(range(64), 16, algorithm="xxhash_cbor"))


# --------------------------------------------------------------------------------------
# The encoder against cbor2
# --------------------------------------------------------------------------------------
EDGE_TOKENS = [0, 1, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1, 2**64 - 1]


@st.composite
def token_lists(draw: st.DrawFn, max_size: int) -> list[int]:
    """Token ids below a drawn bound (most lists stay below 2**32, the numpy encoder's
    domain), rich in the CBOR integer-width edges."""
    bound = draw(st.sampled_from([24, 256, 65536, 2**32, 2**32, 2**64]))
    edges = [t for t in EDGE_TOKENS if t < bound]
    token = st.sampled_from(edges) | st.integers(0, bound - 1)
    return draw(st.lists(token, max_size=max_size))


cbor_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**64), 2**64 - 1),
        st.sampled_from([-(2**64), -(2**32) - 1, -(2**32), -257, -256, -25, -24, -1]),
        st.text(max_size=40),
        st.binary(max_size=300),
    ),
    lambda children: st.lists(children, max_size=30).map(tuple),
    max_leaves=40,
)


@SETTINGS
@given(cbor_values)
def test_encode_cbor_equals_cbor2(value: Any) -> None:
    assert encode_cbor(value) == cbor2.dumps(value, canonical=True)


@st.composite
def extra_keys_st(draw: st.DrawFn) -> ExtraKeys:
    lora = draw(st.none() | st.tuples(st.text(max_size=20), st.none() | st.text(max_size=60)))
    salt = draw(st.none() | st.text(max_size=20))
    mm: list[MultiModalKey] = []
    position = draw(st.integers(0, 40))
    for i in range(draw(st.integers(0, 5))):
        length = draw(st.integers(1, 60))
        mm.append(MultiModalKey(draw(st.text(min_size=1, max_size=12)) + str(i), position, length))
        position += length + draw(st.integers(0, 30))
    return ExtraKeys(
        lora_name=lora[0] if lora else None,
        lora_path=lora[1] if lora else None,
        mm_inputs=tuple(mm),
        cache_salt=salt,
    )


@SETTINGS
@given(
    tokens=token_lists(max_size=300),
    page_size=st.sampled_from([1, 2, 3, 16, 23, 24, 25, 64]),
    extra=st.none() | extra_keys_st(),
    first_page=st.integers(0, 5),
    parent=st.none() | st.binary(min_size=1, max_size=40),
)
def test_page_bodies_equal_cbor2(
    tokens: list[int],
    page_size: int,
    extra: ExtraKeys | None,
    first_page: int,
    parent: bytes | None,
) -> None:
    """Each page's message, as the hasher assembles it, is exactly cbor2's encoding."""
    num_pages = len(tokens) // page_size
    tokens = tokens[: num_pages * page_size]
    parent = parent or NONE_HASH
    keys = hashing._CompiledKeys(extra)
    special = keys.special_pages(first_page, num_pages, page_size)
    array_head = cbor2.dumps((0,) * page_size)[:-page_size]  # each 0 encodes as one byte
    encoded = [hashing._encode_tokens_py(tokens, page_size)]
    if num_pages and max(tokens) < 2**32:
        encoded.append(hashing._encode_tokens_np(np.array(tokens, dtype=np.uint64), page_size))
    for body, ends in encoded:
        assert len(ends) == num_pages
        start = 0
        for i, end in enumerate(ends):
            page_tokens = tuple(tokens[i * page_size : (i + 1) * page_size])
            extra_i = page_extra_keys(extra, first_page + i, page_size)
            expected = cbor2.dumps((parent, page_tokens, extra_i), canonical=True)
            message = (
                b"\x83"
                + encode_cbor(parent)
                + array_head
                + body[start:end]
                + special.get(i, keys.common)
            )
            assert message == expected, i
            start = end
        assert start == len(body)


@SETTINGS
@given(
    tokens=token_lists(max_size=400),
    page_size=st.sampled_from([1, 4, 16, 24, 32]),
    extra=st.none() | extra_keys_st(),
    algorithm=st.sampled_from(["sha256_cbor", "xxhash_cbor"] if xxhash else ["sha256_cbor"]),
    encoder=st.sampled_from(ENCODERS),
)
def test_hash_pages_equals_reference_model(
    tokens: list[int], page_size: int, extra: ExtraKeys | None, algorithm: str, encoder: str
) -> None:
    expected = ref_hashes(tokens, page_size, extra, algorithm)
    with forced_encoder(encoder):
        assert hash_pages(tokens, page_size, extra_keys=extra, algorithm=algorithm) == expected
        as_array = np.array(tokens, dtype=np.uint64)
        assert hash_pages(as_array, page_size, extra_keys=extra, algorithm=algorithm) == expected


@SETTINGS
@given(extra=extra_keys_st(), page_index=st.integers(0, 30), page_size=st.sampled_from([1, 7, 16]))
def test_page_extra_keys_equal_vllm_cursor(
    extra: ExtraKeys, page_index: int, page_size: int
) -> None:
    # Walk vLLM's cursor over every page up to page_index, as its hasher does.
    mm_idx = 0
    for i in range(page_index + 1):
        mm_keys, mm_idx = ref_mm_keys(extra.mm_inputs, i * page_size, (i + 1) * page_size, mm_idx)
    lora = [("lora", extra.lora_name, extra.lora_path)] if extra.lora_name is not None else []
    salt = [("cache_salt", extra.cache_salt)] if page_index == 0 and extra.cache_salt else []
    expected = tuple(lora + mm_keys + salt) or None
    assert page_extra_keys(extra, page_index, page_size) == expected


# --------------------------------------------------------------------------------------
# Incremental use
# --------------------------------------------------------------------------------------
@SETTINGS
@given(
    tokens=st.lists(st.integers(0, 200_000), max_size=300),
    page_size=st.sampled_from([1, 5, 16]),
    extra=st.none() | extra_keys_st(),
    cuts=st.lists(st.integers(0, 300), max_size=8),
)
def test_incremental_equals_one_shot(
    tokens: list[int], page_size: int, extra: ExtraKeys | None, cuts: list[int]
) -> None:
    one_shot = hash_pages(tokens, page_size, extra_keys=extra)
    hasher = PageHasher(page_size, extra_keys=extra)
    hashes: list[bytes] = []
    for cut in [*sorted(c for c in cuts if c <= len(tokens)), len(tokens)]:
        before = list(hashes)
        new = hasher.extend(hashes, tokens[:cut])
        assert hashes == before + new
    assert hashes == one_shot

    # Piecewise with explicit parent / first_page_index gives the same chain.
    split = (len(one_shot) // 2) * page_size
    head = hash_pages(tokens[:split], page_size, extra_keys=extra)
    tail = hash_pages(
        tokens[split:],
        page_size,
        extra_keys=extra,
        parent=head[-1] if head else None,
        first_page_index=split // page_size,
    )
    assert head + tail == one_shot


def test_extend_returns_only_new_pages_and_refuses_lost_tokens() -> None:
    hasher = PageHasher(4)
    hashes: list[bytes] = []
    assert hasher.extend(hashes, [1, 2, 3]) == []
    first = hasher.extend(hashes, [1, 2, 3, 4, 5])
    assert len(first) == 1 and hashes == first
    assert hasher.extend(hashes, [1, 2, 3, 4, 5, 6, 7]) == []
    assert len(hasher.extend(hashes, np.arange(1, 13))) == 2 and len(hashes) == 3
    with pytest.raises(InvalidArgument, match="3 page hashes"):
        hasher.extend(hashes, [1, 2, 3, 4])
    assert len(hashes) == 3


# --------------------------------------------------------------------------------------
# Extra-key semantics
# --------------------------------------------------------------------------------------
def test_salt_on_first_page_only() -> None:
    tokens = list(range(48))
    salted = ExtraKeys(cache_salt="tenant-a")
    plain = hash_pages(tokens, 16)
    with_salt = hash_pages(tokens, 16, extra_keys=salted)
    assert with_salt[0] != plain[0]
    assert page_extra_keys(salted, 0, 16) == (("cache_salt", "tenant-a"),)
    assert page_extra_keys(salted, 1, 16) is None
    # Past page 0 the salt only reaches a page through its parent.
    page1 = hash_pages(
        tokens[16:32], 16, extra_keys=salted, parent=with_salt[0], first_page_index=1
    )
    assert page1 == hash_pages(tokens[16:32], 16, parent=with_salt[0], first_page_index=1)
    assert page1 == with_salt[1:2]
    # An empty salt is no salt (vLLM tests its truth value).
    assert hash_pages(tokens, 16, extra_keys=ExtraKeys(cache_salt="")) == plain


def test_lora_name_and_path_on_every_page() -> None:
    tokens = list(range(48))
    lora = ExtraKeys(lora_name="ad", lora_path="/a/1")
    for i in range(3):
        assert page_extra_keys(lora, i, 16) == (("lora", "ad", "/a/1"),)
    hashes = hash_pages(tokens, 16, extra_keys=lora)
    # Same parent, same tokens: page 2 still differs because the LoRA is in its own key.
    assert hash_pages(tokens[32:], 16, parent=hashes[1], first_page_index=2) != hashes[2:]
    other_path = hash_pages(tokens, 16, extra_keys=ExtraKeys(lora_name="ad", lora_path="/a/2"))
    assert all(a != b for a, b in zip(hashes, other_path, strict=True))
    # No path: keyed with None, distinct from an empty path.
    no_path = ExtraKeys(lora_name="ad")
    assert page_extra_keys(no_path, 1, 16) == (("lora", "ad", None),)
    assert hash_pages(tokens, 16, extra_keys=no_path) != hash_pages(
        tokens, 16, extra_keys=ExtraKeys(lora_name="ad", lora_path="")
    )


def test_multimodal_overlap_and_key_order() -> None:
    extra = ExtraKeys(
        lora_name="l",
        lora_path="/p",
        mm_inputs=(
            MultiModalKey("A", 5, 20),
            MultiModalKey("B", 25, 3),
            MultiModalKey("C", 48, 16),
        ),
        cache_salt="s",
    )
    assert page_extra_keys(extra, 0, 16) == (
        ("lora", "l", "/p"),
        ("mm", "A", 5),
        ("cache_salt", "s"),
    )
    # A ends at 25 inside page 1, B starts there: both, in order, offsets relative to 16.
    assert page_extra_keys(extra, 1, 16) == (("lora", "l", "/p"), ("mm", "A", -11), ("mm", "B", 9))
    assert page_extra_keys(extra, 2, 16) == (("lora", "l", "/p"),)
    assert page_extra_keys(extra, 3, 16) == (("lora", "l", "/p"), ("mm", "C", 0))
    assert page_extra_keys(extra, 4, 16) == (("lora", "l", "/p"),)
    assert page_extra_keys(ExtraKeys(mm_inputs=(MultiModalKey("C", 48, 16),)), 4, 16) is None
    tokens = list(range(80))
    assert hash_pages(tokens, 16, extra_keys=extra) == ref_hashes(tokens, 16, extra)


# --------------------------------------------------------------------------------------
# Pages, join, inputs
# --------------------------------------------------------------------------------------
def test_partial_page_is_not_hashed() -> None:
    tokens = list(range(47))
    assert len(hash_pages(tokens, 16)) == 2
    assert hash_pages([*tokens, 47], 16)[:2] == hash_pages(tokens, 16)
    assert len(hash_pages([*tokens, 47], 16)) == 3
    assert hash_pages(tokens[:15], 16) == []
    # Only hashed tokens are looked at (a long list is packed whole, then falls back).
    long = [7] * 160
    assert hash_pages([*long, -1], 16) == hash_pages(long, 16) == ref_hashes(long, 16)
    assert hash_pages([], 16) == []
    assert hash_pages(np.array([], dtype=np.int64), 16) == []


def test_input_kinds_agree() -> None:
    tokens = [(i * 7919) % 150_000 for i in range(200)]
    expected = hash_pages(tokens, 16)
    for dtype in (np.int32, np.int64, np.uint32, np.uint64):
        assert hash_pages(np.array(tokens, dtype=dtype), 16) == expected
    assert hash_pages(tuple(tokens), 16) == expected
    assert hash_pages(np.array(tokens, dtype=object), 16) == expected
    assert hash_pages([np.int64(t) for t in tokens], 16) == expected
    # An id of 2**32 or more anywhere sends a long request to the plain-Python encoder.
    big = [*tokens[:100], 2**40, *tokens[100:]]
    assert hash_pages(big, 16) == hash_pages(np.array(big, dtype=np.uint64), 16)
    assert hash_pages(big, 16) == ref_hashes(big, 16)
    # A request's stored tokens (array 'Q', up to 2**64 - 1): the C encoder reads them
    # in place, partial last page dropped.
    for ids in (tokens, big, [*big, 2**64 - 1, 5, 7]):
        assert hash_pages(array.array("Q", ids), 16) == hash_pages(list(ids), 16)
    assert hash_pages(array.array("Q", big), 16) == ref_hashes(big, 16)
    small = [1, 2, 300, 70000]  # below the numpy threshold: the plain-Python encoder
    assert hash_pages(np.array(small, dtype=np.int64), 2) == hash_pages(small, 2)
    assert hash_pages(small, 2) == ref_hashes(small, 2)


def test_join_hashes() -> None:
    small = [bytes([i]) * 32 for i in range(7)]
    assert join_hashes(small, 1) == small
    concat = [small[0] + small[1], small[2] + small[3], small[4] + small[5]]
    assert join_hashes(small, 2, mode="concat") == concat
    assert join_hashes(small, 3, mode="concat") == [b"".join(small[0:3]), b"".join(small[3:6])]
    assert join_hashes(small, 8) == []
    assert join_hashes(small, 3) == [small[2], small[5]]  # vLLM 0.33: the last small hash
    assert join_hashes(small, 3, mode="last") == [small[2], small[5]]
    assert join_hashes(small, 1, mode="last") == small
    # A big page's joined hash identifies the same prefix as hashing at the big size would.
    tokens = list(range(96))
    a, b = join_hashes(hash_pages(tokens, 16), 2)[:2], join_hashes(hash_pages(tokens[:80], 16), 2)
    assert a == b[:2] and len(b) == 2
    with pytest.raises(InvalidArgument, match="factor"):
        join_hashes(small, 0)
    with pytest.raises(InvalidArgument, match="mode"):
        join_hashes(small, 2, mode="xor")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "tokens",
    [
        [1, 2, -1, 4],
        [0] * 40 + [-5] + [0] * 23,
        [1.5, 2, 3, 4],
        [1, 2, "3", 4],
        [2**64, 1, 2, 3],
        [0] * 63 + [2**64],
        np.array([1, -2, 3, 4]),
        np.array([1.0, 2.0, 3.0, 4.0]),
        np.array([[1, 2], [3, 4]]),
        np.array([True, False, True, False]),
    ],
    ids=lambda t: repr(t)[:24],
)
def test_invalid_tokens(tokens: Any) -> None:
    with pytest.raises(InvalidArgument):
        hash_pages(tokens, 4)


def test_invalid_arguments() -> None:
    with pytest.raises(InvalidArgument, match="page_size"):
        hash_pages([1, 2], 0)
    with pytest.raises(InvalidArgument, match="page_size"):
        hash_pages([1, 2], True)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="first_page_index"):
        hash_pages([1, 2], 2, first_page_index=-1)
    with pytest.raises(InvalidArgument, match="parent"):
        hash_pages([1, 2], 2, parent="ab")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="hash_algorithm"):
        hash_pages([1, 2], 2, algorithm="md5")
    with pytest.raises(ConfigError):
        none_hash("sha256")


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (ExtraKeys(lora_path="/p"), "lora_name is not"),
        (ExtraKeys(lora_name=3), "lora_name"),  # type: ignore[arg-type]
        (ExtraKeys(cache_salt=b"s"), "cache_salt"),  # type: ignore[arg-type]
        (ExtraKeys(mm_inputs=(MultiModalKey("a", 10, 5), MultiModalKey("b", 3, 2))), "sorted"),
        (ExtraKeys(mm_inputs=(MultiModalKey("a", 0, 5), MultiModalKey("b", 4, 2))), "overlap"),
        (ExtraKeys(mm_inputs=(MultiModalKey("a", 0, 0),)), "length"),
        (ExtraKeys(mm_inputs=(MultiModalKey("a", -1, 3),)), "offset"),
        (ExtraKeys(mm_inputs=(MultiModalKey("", 0, 3),)), "identifier"),
        (ExtraKeys(cache_salt="\ud800"), "UTF-8"),
    ],
)
def test_invalid_extra_keys(extra: ExtraKeys, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        hash_pages(list(range(16)), 16, extra_keys=extra)
    with pytest.raises(InvalidArgument):
        PageHasher(16, extra_keys=extra)


def test_stable_across_processes() -> None:
    """Never Python's ``hash()``: other str hash seeds give the same page hashes."""
    code = (
        "from pagekeeper.core.hashing import hash_pages; from pagekeeper.core.types import "
        "ExtraKeys as E; print(hash_pages(list(range(64)), 16, extra_keys=E('a', 'b', (), 's'))"
        "[-1].hex())"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        for seed in ("1", "2")
    }
    expected = hash_pages(list(range(64)), 16, extra_keys=ExtraKeys("a", "b", (), "s"))[-1].hex()
    assert outputs == {expected}


# --------------------------------------------------------------------------------------
# The C accelerator (pagekeeper.core._native), where it is built
# --------------------------------------------------------------------------------------
needs_native = pytest.mark.skipif(
    not hashing.native_hashing(), reason="pagekeeper.core._native is not built here"
)


@needs_native
@SETTINGS
@given(tokens=token_lists(max_size=300), page_size=st.sampled_from([1, 2, 3, 16, 24, 64]))
def test_native_encoder_equals_python(tokens: list[int], page_size: int) -> None:
    """Every width the C encoder reads (1, 2, 4, 8 bytes), every CBOR size class (ids up
    to 2**64 - 1, which the numpy encoder leaves to Python), byte for byte."""
    assert hashing._native is not None
    expected = hashing._encode_tokens_py(tokens, page_size)
    for dtype in (np.uint8, np.uint16, np.uint32, np.uint64):
        if tokens and max(tokens) > np.iinfo(dtype).max:
            continue
        assert hashing._native.encode_pages(np.array(tokens, dtype=dtype), page_size) == expected
    if not tokens or max(tokens) < 2**32:
        # The array module's buffers too (format "I"/"L"), and the layouts numpy may hand
        # over: the wrapper makes a byte-swapped or strided array contiguous and native.
        assert hashing._native.encode_pages(array.array("I", tokens), page_size) == expected
        big = np.array(tokens, dtype=">u4")
        assert hashing._encode_tokens(big, page_size) == expected
        strided = np.repeat(np.array(tokens, dtype=np.uint32), 2)[::2]
        assert hashing._encode_tokens(strided, page_size) == expected


@needs_native
@SETTINGS
@given(
    tokens=token_lists(max_size=200),
    page_size=st.sampled_from([1, 3, 16]),
    parent=st.binary(max_size=40),
    extras=st.binary(max_size=30) | st.lists(st.binary(max_size=30), max_size=20),
    algorithm_size=st.sampled_from([32, 16]),
)
def test_native_chain_equals_python(
    tokens: list[int],
    page_size: int,
    parent: bytes,
    extras: bytes | list[bytes],
    algorithm_size: int,
) -> None:
    """The SHA-256 chain over any parent (any length, empty too), extras the same for every
    page or one per page (a shorter list ends the chain, as zip does), equals _chain."""
    body, ends = hashing._encode_tokens_py(tokens, page_size)
    num_pages = len(ends) if isinstance(extras, bytes) else min(len(ends), len(extras))
    assume(num_pages > 0)  # callers never chain zero pages (_chain needs one)
    array_head = hashing._head(4, page_size)
    with forced_encoder("native"):
        got = hashing._chain("sha256_cbor", parent, array_head, body, ends, extras)
    with forced_encoder("python"):
        expected = hashing._chain("sha256_cbor", parent, array_head, body, ends, extras)
    assert got == expected
    assert len(got) == num_pages


@needs_native
@SETTINGS
@given(
    tokens=token_lists(max_size=120),
    page_size=st.sampled_from([1, 3, 16, 65, 100]),
    parent=st.binary(max_size=40),
    extra=st.binary(max_size=30),
    data=st.data(),
)
def test_native_one_page_equals_the_chain(
    tokens: list[int], page_size: int, parent: bytes, extra: bytes, data: st.DataObject
) -> None:
    """sha256_page reads any full page in place (any offset, any width, pages past the
    stack buffer too) and hashes what chain_sha256 hashes for that page."""
    native = hashing._native
    assert native is not None
    assume(len(tokens) >= page_size)
    start = data.draw(st.integers(0, len(tokens) - page_size), label="start")
    page = tokens[start : start + page_size]
    array_head = hashing._head(4, page_size)
    head = hashing._parent_head(parent)
    body, ends = hashing._encode_tokens_py(page, page_size)
    (expected,) = native.chain_sha256(head, head, parent, array_head, body, ends, extra)
    stored = array.array("Q", tokens)
    assert native.sha256_page(head, parent, array_head, stored, start, page_size, extra) == (
        expected
    )
    if max(tokens, default=0) < 2**16:
        narrow = np.array(tokens, dtype=np.uint16)
        assert native.sha256_page(head, parent, array_head, narrow, start, page_size, extra) == (
            expected
        )


@needs_native
def test_native_refuses_bad_arguments() -> None:
    """Wrong types and out-of-range offsets are Python exceptions, never a crash or a read
    past the buffer."""
    native = hashing._native
    assert native is not None
    head = hashing._PARENT_HEADS[32]
    good = (head, head, NONE_HASH, b"\x82", b"\x01\x02\x03\x04", [2, 4], b"\xf6")
    assert len(native.chain_sha256(*good)) == 2
    bad_cases: list[tuple[tuple[Any, ...], type[Exception], str]] = [
        ((*good[:5], [2, 5], good[6]), ValueError, "outside"),
        ((*good[:5], [3, 2], good[6]), ValueError, "outside"),
        ((*good[:5], [-1], good[6]), ValueError, "outside"),
        ((*good[:5], (2, 4), good[6]), TypeError, "list"),
        ((*good[:5], [2, "4"], good[6]), TypeError, "integer"),
        ((*good[:6], "x"), TypeError, "extras"),
        ((*good[:6], [b"", 3]), TypeError, r"extras\[1\]"),
        ((head, head, "parent", *good[3:]), TypeError, "parent"),
        (good[:6], TypeError, "chain_sha256"),
    ]
    for args, error, match in bad_cases:
        with pytest.raises(error, match=match):
            native.chain_sha256(*args)
    assert native.encode_pages(np.arange(8, dtype=np.uint32), 4)[1] == [4, 8]
    for tokens, page_size, error in [
        (np.arange(8, dtype=np.int32), 4, TypeError),  # signed: the wrapper checks signs
        (np.arange(8, dtype=np.float32), 4, TypeError),
        (np.arange(8, dtype=np.uint32)[::2], 4, ValueError),  # not C-contiguous
        (np.arange(8, dtype=np.uint32), 0, ValueError),
        ("tokens", 4, TypeError),
    ]:
        with pytest.raises(error):
            native.encode_pages(tokens, page_size)
    ids = array.array("Q", range(40))
    one = (head, NONE_HASH, b"\x90", ids, 16, 16, b"")
    assert len(native.sha256_page(*one)) == 32
    for args, error, match in [
        ((*one[:4], 25, 16, b""), ValueError, "no full page of 16 tokens at 25"),
        ((*one[:4], -1, 16, b""), ValueError, "start"),
        ((*one[:4], 0, 0, b""), ValueError, "page_size"),
        ((*one[:4], 0, 41, b""), ValueError, "no full page"),
        ((*one[:3], np.arange(40, dtype=np.int64), 0, 16, b""), TypeError, "unsigned"),
        ((*one[:3], np.arange(80, dtype=np.uint64)[::2], 0, 16, b""), ValueError, "contiguous"),
        ((*one[:6], "x"), TypeError, "extra"),
        ((head, "parent", *one[2:]), TypeError, "parent"),
        (one[:6], TypeError, "sha256_page"),
    ]:
        with pytest.raises(error, match=match):
            native.sha256_page(*args)


def test_native_hashing_can_be_turned_off() -> None:
    """PAGEKEEPER_NATIVE_HASHING=0 runs the pure-Python loops; hashes do not change."""
    code = (
        "from pagekeeper.core import hashing; import numpy as np; print(hashing.native_hashing(),"
        " hashing.hash_pages(np.arange(4000), 16)[-1].hex())"
    )
    outputs = [
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PAGEKEEPER_NATIVE_HASHING": flag},
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split()
        for flag in ("0", "1")
    ]
    expected = hash_pages(np.arange(4000), 16)[-1].hex()
    assert outputs[0] == ["False", expected]
    built = importlib.util.find_spec("pagekeeper.core._native") is not None
    assert outputs[1] == [str(built), expected]


def test_native_is_built_where_it_can_be() -> None:
    """The accelerator is optional, but where its toolchain is (a C compiler and OpenSSL's
    headers, as on the CI machine) a build that silently failed is a regression."""
    if os.environ.get("PAGEKEEPER_NATIVE_HASHING") == "0":
        pytest.skip("turned off by PAGEKEEPER_NATIVE_HASHING=0")
    if not (shutil.which("cc") and Path("/usr/include/openssl/evp.h").exists()):
        pytest.skip("no C compiler or OpenSSL headers: the pure-Python loops run")
    assert hashing.native_hashing(), "setup.py did not build pagekeeper.core._native"


@needs_native
@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed")
def test_native_memcheck_short_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A short run of ``make memcheck``: the C loops (hashing and, where built, the pool's)
    under valgrind, no error report with a frame in either extension (CPython's own reports
    are not counted)."""
    from tests.core.native_memcheck import under_valgrind

    assert under_valgrind(tmp_path / "memcheck.log", cases=40, seed=0) == 0
    assert "no error in pagekeeper's C extensions" in capsys.readouterr().out


@pytest.mark.skipif(hashing._native is None, reason="the C hash loops are not built")
@given(
    page_size=st.sampled_from([1, 4, 16]),
    tokens=st.lists(st.integers(0, 2**64 - 1), min_size=16, max_size=16),
    parent=st.binary(min_size=1, max_size=40),
    lora=st.sampled_from([None, "adapter-a"]),
)
@settings(max_examples=examples(60), deadline=None)
def test_hash_next_of_stored_ids_matches_the_general_path(
    page_size: int, tokens: list[int], parent: bytes, lora: str | None
) -> None:
    """hash_next hands a request's stored ``array('Q')`` page straight to the C loops; the
    hash is the one the general path gives the same ids as a list, for any parent (client
    page hashes may have any length), any 64-bit id and common extra keys."""
    hasher = PageHasher(page_size, extra_keys=ExtraKeys(lora_name=lora) if lora else None)
    # One page hashed already (``parent``): the next page is read at ``page_size``.
    ids = [7] * page_size + tokens[:page_size]
    direct: list[bytes] = [parent]
    general: list[bytes] = [parent]
    hasher.hash_next(direct, array.array("Q", ids))
    hasher.hash_next(general, ids)
    assert direct == general
    assert direct[1] == hasher.hash_pages(tokens[:page_size], parent=parent, first_page_index=1)[0]


@pytest.mark.parametrize(
    "extra",
    [
        None,
        ExtraKeys(lora_name="l"),
        ExtraKeys(cache_salt="s"),
        ExtraKeys(mm_inputs=(MultiModalKey("img", 2, 4),)),
    ],
)
def test_hash_page_is_that_page_of_the_chain(extra: ExtraKeys | None) -> None:
    """hash_page (a lookup's one-page step) gives page ``index`` of the chain, for a
    request's stored ids and for a list, from anywhere in a longer prompt; a page that is
    not full is refused."""
    hasher = PageHasher(4, extra_keys=extra)
    tokens = list(range(100, 121))  # 5 full pages and one token
    chain = hash_pages(tokens, 4, extra_keys=extra)
    for ids in (array.array("Q", tokens), tokens):
        for index in range(5):
            parent = chain[index - 1] if index else None
            assert hasher.hash_page(ids, index, parent) == chain[index]
        with pytest.raises(InvalidArgument, match="not full"):
            hasher.hash_page(ids, 5, chain[4])
        with pytest.raises(InvalidArgument, match="must be >= 0"):
            hasher.hash_page(ids, -2, chain[0])  # would read page 3 from the end


@pytest.mark.parametrize(
    "extra",
    [
        ExtraKeys(mm_inputs=(MultiModalKey("img", 2, 4),)),
        ExtraKeys(cache_salt="s"),
        None,
    ],
)
def test_hash_next_keeps_page_specific_keys(extra: ExtraKeys | None) -> None:
    """Pages whose extra keys differ (a multimodal input, the salt on page 0) take the
    general path: stored ids and a list hash alike, page after page, as hash_pages does."""
    hasher = PageHasher(4, extra_keys=extra)
    tokens = list(range(100, 112))
    direct: list[bytes] = []
    general: list[bytes] = []
    for k in range(3):
        hasher.hash_next(direct, array.array("Q", tokens[: 4 * k + 4]))
        hasher.hash_next(general, tokens[: 4 * k + 4])
    assert direct == general == hash_pages(tokens, 4, extra_keys=extra)
    if extra is not None:
        assert direct != hash_pages(tokens, 4)


@given(
    keys=request_keys(max_inputs=12),
    first_page=st.integers(0, 40),
    num_pages=st.integers(1, 12),
    page_size=st.sampled_from([1, 4, 16]),
)
@settings(max_examples=examples(300), suppress_health_check=[HealthCheck.too_slow])
def test_an_events_narrowed_keys_give_its_pages_the_same_keys(
    keys: ExtraKeys, first_page: int, num_pages: int, page_size: int
) -> None:
    """What a stored event keeps of its request's keys gives each of its pages the keys
    the whole would, and holds no input that falls on none of them."""
    narrowed = hashing.narrow_extra_keys(keys, first_page, num_pages, page_size)
    whole = hashing.run_extra_keys(keys, first_page, num_pages, page_size)
    if narrowed is None:
        assert whole == [None] * num_pages
        return
    assert hashing.run_extra_keys(narrowed, first_page, num_pages, page_size) == whole
    start, end = first_page * page_size, (first_page + num_pages) * page_size
    assert all(m.offset < end and m.offset + m.length > start for m in narrowed.mm_inputs)
    if narrowed.mm_inputs == keys.mm_inputs and narrowed.cache_salt == keys.cache_salt:
        assert narrowed is keys  # nothing left out: the request's own object, no copy


def test_a_request_with_many_images_puts_few_into_each_event() -> None:
    """1,000 images over 16,000 tokens, prefilled a page a step: each page's stored event
    carries the image on that page, not all of them; its estimated size says what it
    holds; a prompt stored in one go keeps the request's own keys, uncopied."""
    from pagekeeper.core.config import GroupConfig, PoolConfig
    from pagekeeper.core.events import PageStored, event_nbytes
    from pagekeeper.core.manager import PageManager

    images = tuple(MultiModalKey(f"image-{i:04d}", 16 * i + 3, 10) for i in range(1_000))
    keys = ExtraKeys(mm_inputs=images)
    config = PoolConfig(num_pages=2_100, groups=(GroupConfig(page_size=16),), max_model_len=32_768)
    pm = PageManager(config)
    pm.admit("whole", list(range(16_000)), extra_keys=keys)
    (whole,) = [e for e in pm.take_events() if isinstance(e, PageStored)]
    assert whole.extra_keys is keys  # one event over every page: all of them
    pm.admit("chunked", list(range(16_000)), num_new_tokens=16, extra_keys=keys,
             enable_cache_read=False)  # fmt: skip
    for _ in range(999):
        assert pm.allocate("chunked", 16) is not None
    events = [e for e in pm.take_events() if isinstance(e, PageStored)]
    assert len(events) == 1_000
    for i, event in enumerate(events):
        assert event.first_page == i and event.extra_keys == ExtraKeys(mm_inputs=(images[i],))
    assert event_nbytes(whole) > event_nbytes(events[0]) + 999 * 120
