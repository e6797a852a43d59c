"""A growth's client page hashes (``Growth.page_hashes``, the columns' packed hashes): the
pages its new tokens complete enter the prefix cache under the client's hashes, so a later
prompt the client hashes alike hits them; checked with the step before anything changes;
journaled so a replay rebuilds the same cache."""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest

from pagekeeper.core.config import GroupConfig, GroupKind, PoolConfig
from pagekeeper.core.errors import InvalidArgument
from pagekeeper.core.manager import PageManager
from pagekeeper.durability.commands import (
    STEP_TREE_GROWTH_HASHES_VERSION,
    STEP_WIRE_GROWTH_HASHES_VERSION,
    decode_command,
    encode_command,
    encode_command_parts,
)
from pagekeeper.state import (
    Admission,
    AllocationStatus,
    Growth,
    GrowthColumns,
    Limits,
    ServiceState,
    StepCommand,
)
from tests.service.test_state import scheduler, tokens

PS = 4
FULL = PoolConfig(num_pages=64, groups=(GroupConfig(GroupKind.FULL, PS),), max_model_len=96)


def h(name: str, i: int) -> bytes:
    """A client's (an engine's) hash of page ``i`` of ``name``: not the service's."""
    return hashlib.sha256(f"{name}:{i}".encode()).digest()


def chain(i: int) -> bytes:
    """One chain of client hashes shared by every prompt below (same tokens, same hashes)."""
    return h("chain", i)


class Driver:
    def __init__(self, config: PoolConfig = FULL) -> None:
        self.state = ServiceState(config, Limits(), debug_invariants=True)
        self.me = scheduler(self.state)
        self.step_id = 0
        self.commands: list[StepCommand] = []

    def step(self, **kw: object):
        self.step_id += 1
        command = StepCommand(2.0, self.me[0], self.me[1], self.step_id, **kw)  # type: ignore[arg-type]
        result = self.state.step(command)
        self.commands.append(command)
        return result

    def admit(self, rid: str, n: int, num_hashes: int):
        hashes = tuple(chain(i) for i in range(num_hashes))
        (outcome,) = self.step(
            admissions=(Admission(rid, tokens(0, n), page_hashes=hashes),)
        ).listed
        assert outcome.status is AllocationStatus.OK
        return outcome


def page_ids(state: ServiceState, rid: str) -> list[int]:
    return state.request_info(rid).page_ids[0]


def test_generated_pages_hit_under_the_clients_hashes() -> None:
    """A request admitted with client hashes generates a page; its growth names it. A new
    prompt holding the same tokens (a chat's next turn), hashed by the client, hits every
    page, the generated one included; without the growth's hash it misses that page."""
    for with_hash in (True, False):
        d = Driver()
        d.admit("a", 10, 2)
        # Two generated tokens complete page 2 (tokens 8..11).
        growth = Growth("a", 2, tokens(10, 2), page_hashes=(chain(2),) if with_hash else None)
        d.step(growths=(growth,))
        a_pages = page_ids(d.state, "a")
        (b,) = d.step(
            admissions=(
                Admission("b", tokens(0, 16), page_hashes=tuple(chain(i) for i in range(4))),
            )
        ).listed
        assert b.num_cached_tokens == (12 if with_hash else 8)
        assert list(b.hit_page_ids[0]) == list(a_pages)[: b.num_cached_tokens // PS]


def test_packed_growth_hashes_and_fewer_than_completed_pages() -> None:
    """Packed like an admission's; fewer hashes than completed pages: the service hashes
    the rest from the client's last (the same pages it would name itself next time)."""
    d = Driver()
    d.admit("a", 8, 2)
    # Eight tokens complete pages 2 and 3; the client names page 2 only.
    d.step(growths=(Growth("a", 8, tokens(8, 8), packed_page_hashes=chain(2)),))
    manager = d.state.manager
    req = manager._requests["a"]
    assert req.hashes[:3] == [chain(0), chain(1), chain(2)]
    assert len(req.hashes) == 4 and req.hashes[3] not in {chain(3)}
    # The same tokens with only the first three client hashes: the service completes the
    # chain alike, so all four pages hit (the last token is computed again).
    (b,) = d.step(
        admissions=(Admission("b", tokens(0, 17), page_hashes=tuple(chain(i) for i in range(3))),)
    ).listed
    assert b.num_cached_tokens == 16


def columns(rows: list[tuple[str, np.ndarray, tuple[bytes, ...]]]) -> GrowthColumns:
    return GrowthColumns(
        request_ids=tuple(r for r, _, _ in rows),
        num_new_tokens=np.ones(len(rows), dtype=np.int32),
        new_token_ids=np.concatenate([t for _, t, _ in rows]).astype(np.int32),
        num_new_token_ids=np.array([len(t) for _, t, _ in rows], dtype=np.int32),
        num_computed_tokens=np.array(
            [-1 if len(t) == 1 else 0 for _, t, _ in rows], dtype=np.int32
        ),
        num_lookahead_tokens=np.zeros(len(rows), dtype=np.int32),
        packed_page_hashes=b"".join(b"".join(hs) for _, _, hs in rows),
        num_page_hashes=np.array([len(hs) for _, _, hs in rows], dtype=np.int32),
    )


def test_columns_with_hashes_match_messages_step_for_step() -> None:
    """Ten requests decode for 40 steps; a row whose token completes a page carries its
    hash (every other step, every other request: the rest are hashed by the service).
    Columns and messages give the same pages, hashes, events and later hits."""
    rng = np.random.default_rng(3)
    big = PoolConfig(num_pages=256, groups=(GroupConfig(GroupKind.FULL, PS),), max_model_len=96)
    drivers = {form: Driver(big) for form in ("columns", "messages", "decodes")}
    names = [f"r{i}" for i in range(10)]
    lengths = {}
    for i, rid in enumerate(names):
        n = int(rng.integers(3, 12))
        lengths[rid] = n
        for d in drivers.values():
            d.step(
                admissions=(
                    Admission(
                        rid,
                        tokens(100 * i, n),
                        page_hashes=tuple(h(rid, p) for p in range(n // PS)),
                    ),
                )
            )
    for s in range(40):
        rows = []
        for i, rid in enumerate(names):
            n = lengths[rid]
            token = np.array([100 * i + n], dtype=np.int32)
            completes = (n + 1) % PS == 0
            hashes = (h(rid, n // PS),) if completes and (s + i) % 2 == 0 else ()
            rows.append((rid, token, hashes))
            lengths[rid] = n + 1
        as_columns = columns(rows)
        as_messages = tuple(Growth(rid, 1, t, page_hashes=hs or None) for rid, t, hs in rows)
        # Plain decodes vouched for (the wire's form when every count column is left out):
        # one batched run, the rows with hashes taken by the core one by one within it.
        as_decodes = dataclasses.replace(
            GrowthColumns.decodes(
                [rid for rid, _, _ in rows], np.concatenate([t for _, t, _ in rows])
            ),
            packed_page_hashes=as_columns.packed_page_hashes,
            num_page_hashes=as_columns.num_page_hashes,
        )
        assert as_decodes.defaults_only
        a = drivers["columns"].step(growth_columns=as_columns)
        b = drivers["messages"].step(growths=as_messages)
        c = drivers["decodes"].step(growth_columns=as_decodes)
        assert a.num_free_pages == b.num_free_pages == c.num_free_pages
    states = [d.state for d in drivers.values()]
    for other in states[1:]:
        for rid in names:
            assert other.request_info(rid) == states[0].request_info(rid)
            assert other.manager._requests[rid].hashes == states[0].manager._requests[rid].hashes
        assert other.manager.pool.free_queue() == states[0].manager.pool.free_queue()
        assert other.events_since(0, 10_000) == states[0].events_since(0, 10_000)
    # Some hashes are the client's: a later prompt naming them hits the generated pages.
    req = states[0].manager._requests["r0"]
    assert any(x == h("r0", p) for p, x in enumerate(req.hashes))


def two_pages() -> Driver:
    d = Driver()
    d.admit("a", 6, 1)  # 6 tokens: page 0 full (hashed chain(0)), page 1 holds 2
    return d


@pytest.mark.parametrize(
    ("growth", "match"),
    [
        # Two tokens complete page 1: at most one hash.
        (Growth("a", 1, tokens(6, 2), page_hashes=(chain(1), chain(2))), "2 page hashes for the 1"),
        (Growth("a", 1, tokens(6, 6), page_hashes=(chain(1), chain(1))), "repeats"),
        (Growth("a", 1, tokens(6, 2), page_hashes=(chain(0),)), "repeats its previous page"),
        (Growth("a", 1, tokens(6, 2), page_hashes=(b"",)), "non-empty bytes"),
        (Growth("a", 1, tokens(6, 2), packed_page_hashes=chain(1)[:31]), "31 bytes are not"),
        (
            Growth("a", 1, tokens(6, 2), page_hashes=(chain(1),), packed_page_hashes=chain(1)),
            "both set",
        ),
        # One token completes no page (7 of 8): no hash at all.
        (Growth("a", 1, tokens(6, 1), page_hashes=(chain(1),)), "1 page hashes for the 0"),
    ],
)
def test_bad_growth_hashes_change_nothing(growth: Growth, match: str) -> None:
    for form in ("messages", "columns"):
        d = two_pages()
        before = d.state.request_info("a")
        queue = d.state.manager.pool.free_queue()
        hashes = d.state.manager._requests["a"].hashes[:]
        kw: dict[str, object]
        if form == "messages":
            kw = {"growths": (growth,)}
        else:
            if growth.page_hashes is not None and growth.packed_page_hashes is not None:
                continue  # a column form has one packed field only
            if growth.page_hashes is not None and any(len(x) != 32 for x in growth.page_hashes):
                continue  # the packed form cannot hold it
            packed = growth.packed_page_hashes
            if packed is None:
                packed = b"".join(growth.page_hashes or ())
            num = len(growth.page_hashes) if growth.page_hashes is not None else 1
            kw = {
                "growth_columns": GrowthColumns(
                    request_ids=("a",),
                    num_new_tokens=np.ones(1, dtype=np.int32),
                    new_token_ids=growth.new_token_ids,
                    num_new_token_ids=np.array([len(growth.new_token_ids)], dtype=np.int32),
                    num_computed_tokens=np.full(1, -1, dtype=np.int32),
                    num_lookahead_tokens=np.zeros(1, dtype=np.int32),
                    packed_page_hashes=packed,
                    num_page_hashes=np.array([num], dtype=np.int32),
                )
            }
            if "31 bytes" in match:
                match = "adds up to 1 hashes of 32 bytes but packed_page_hashes holds 31"
        with pytest.raises(InvalidArgument, match=match):
            d.step(**kw)
        assert d.state.request_info("a") == before
        assert d.state.manager.pool.free_queue() == queue
        assert d.state.manager._requests["a"].hashes == hashes


def test_columns_hash_counts_must_add_up() -> None:
    d = two_pages()
    ids = tuple(f"x{i}" for i in range(8))
    for rid in ids:
        d.admit(rid, 3, 0)
    n = len(ids)
    base = {
        "request_ids": ids,
        "num_new_tokens": np.ones(n, dtype=np.int32),
        "new_token_ids": np.arange(n, dtype=np.int32),
        "num_new_token_ids": np.ones(n, dtype=np.int32),
        "num_computed_tokens": np.full(n, -1, dtype=np.int32),
        "num_lookahead_tokens": np.zeros(n, dtype=np.int32),
    }
    for extra, match in (
        ({"packed_page_hashes": chain(5)}, "packed_page_hashes without num_page_hashes"),
        (
            {"packed_page_hashes": chain(5), "num_page_hashes": np.zeros(n, dtype=np.int32)},
            "adds up to 0 hashes",
        ),
        ({"num_page_hashes": np.zeros(n - 1, dtype=np.int32)}, "num_page_hashes has 7 entries"),
        (
            {"num_page_hashes": np.array([-1] + [0] * (n - 1), dtype=np.int32)},
            "num_page_hashes must be >= 0",
        ),
    ):
        with pytest.raises(InvalidArgument, match=match):
            d.step(growth_columns=GrowthColumns(**base, **extra))  # type: ignore[arg-type]
    # The same columns with hashes for rows whose decode completes a page (3 + 1 tokens).
    num = np.zeros(n, dtype=np.int32)
    num[[2, 5]] = 1
    d.step(
        growth_columns=GrowthColumns(
            **base,  # type: ignore[arg-type]
            packed_page_hashes=h("x2", 0) + h("x5", 0),
            num_page_hashes=num,
        )
    )
    assert d.state.manager._requests["x2"].hashes == [h("x2", 0)]
    assert d.state.manager._requests["x5"].hashes == [h("x5", 0)]
    assert d.state.manager._requests["x3"].hashes != [h("x3", 0)]


def test_no_capacity_keeps_nothing_and_the_retry_names_the_page() -> None:
    d = Driver(PoolConfig(num_pages=4, groups=(GroupConfig(GroupKind.FULL, PS),), max_model_len=96))
    d.admit("a", 8, 2)  # pages 1, 2
    d.admit("b", 4, 0)  # page 3: the pool is full
    # a's 9th token needs a page: refused, nothing kept.
    (out,) = d.step(growths=(Growth("a", 1, tokens(8, 4), page_hashes=(chain(2),)),)).listed
    assert out.status is AllocationStatus.NO_CAPACITY
    assert d.state.manager._requests["a"].hashes == [chain(0), chain(1)]
    d.step(frees=("b",))
    (out,) = d.step(growths=(Growth("a", 1, tokens(8, 4), page_hashes=(chain(2),)),)).listed
    assert out.status is AllocationStatus.OK
    assert d.state.manager._requests["a"].hashes == [chain(0), chain(1), chain(2)]


def test_caching_off_checks_and_ignores_them() -> None:
    config = PoolConfig(
        num_pages=64,
        groups=(GroupConfig(GroupKind.FULL, PS),),
        max_model_len=96,
        enable_prefix_caching=False,
    )
    d = Driver(config)
    d.admit("a", 7, 1)
    with pytest.raises(InvalidArgument, match="2 page hashes for the 1"):
        d.step(growths=(Growth("a", 1, tokens(7, 1), page_hashes=(chain(1), chain(2))),))
    d.step(growths=(Growth("a", 1, tokens(7, 1), page_hashes=(chain(1),)),))
    assert d.state.request_info("a").num_tokens == 8


def test_the_core_checks_them_too() -> None:
    manager = PageManager(FULL)
    manager.admit("a", list(range(7)), page_hashes=[chain(0)])
    with pytest.raises(InvalidArgument, match="2 page hashes for the 1"):
        manager.allocate("a", 1, new_token_ids=[7], new_page_hashes=[chain(1), chain(2)])
    with pytest.raises(InvalidArgument, match="repeats its previous page"):
        manager.allocate("a", 1, new_token_ids=[7], new_page_hashes=[chain(0)])
    assert len(manager._requests["a"].token_ids) == 7
    manager.allocate("a", 1, new_token_ids=[7], new_page_hashes=[chain(1)])
    assert manager._requests["a"].hashes == [chain(0), chain(1)]
    assert manager.last_page_hash("a") == chain(1)


def test_replayed_from_the_journal_to_the_same_cache() -> None:
    """Both forms (messages with packed or listed hashes, columns) through the record
    codec, at the version that makes an older pagekeeper refuse them; replayed into a
    fresh state, the same requests, hashes and free queue."""
    d = Driver()
    d.admit("a", 7, 1)
    d.admit("b", 7, 1)
    for i in range(8):
        d.admit(f"c{i}", 3, 0)
    d.step(
        growths=(
            Growth("a", 1, tokens(7, 1), page_hashes=(h("a", 1),)),
            Growth("b", 1, tokens(7, 5), packed_page_hashes=h("b", 1) + h("b", 2)),
        )
    )
    d.step(
        growth_columns=columns(
            [(f"c{i}", tokens(i, 1), (h(f"c{i}", 0),) if i % 3 else ()) for i in range(8)]
        )
    )
    replay = ServiceState(FULL, Limits(), debug_invariants=True)
    scheduler(replay)
    for command in d.commands:
        body = encode_command(command)
        if command in d.commands[-2:]:  # the two steps with growth hashes
            assert body[1] == STEP_TREE_GROWTH_HASHES_VERSION
        decoded, _ = decode_command(body)
        replay.step(decoded)
    for rid in ["a", "b", *(f"c{i}" for i in range(8))]:
        assert replay.request_info(rid) == d.state.request_info(rid)
        assert replay.manager._requests[rid].hashes == d.state.manager._requests[rid].hashes
    assert replay.manager._requests["b"].hashes[1:3] == [h("b", 1), h("b", 2)]
    assert replay.manager.pool.free_queue() == d.state.manager.pool.free_queue()


def test_wire_steps_with_growth_hashes_are_the_next_record_version() -> None:
    from pagekeeper.rpc.convert import step_from_pb
    from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2 as pb

    plain = pb.StepRequest(client_id="c", generation=1, step_id=1)
    plain.growths.add(request_id="a", num_new_tokens=1, new_token_ids=tokens(7, 1).tobytes())
    hashed = pb.StepRequest()
    hashed.CopyFrom(plain)
    hashed.growths[0].packed_page_hashes = h("a", 1)
    cols = pb.StepRequest(client_id="c", generation=1, step_id=1)
    cols.growth_columns.request_ids.extend(["a"])
    cols.growth_columns.new_token_ids = tokens(7, 1).tobytes()
    cols.growth_columns.packed_page_hashes = h("a", 1)
    cols.growth_columns.num_page_hashes = np.array([1], dtype="<i4").tobytes()
    versions = []
    for message in (plain, hashed, cols):
        command = step_from_pb(message, 1.0, message.SerializeToString())
        body = b"".join(encode_command_parts(command))
        versions.append(body[1])
        decoded, _ = decode_command(body)
        if message is hashed:
            assert decoded.growths[0].packed_page_hashes == h("a", 1)
        if message is cols:
            assert decoded.growth_columns is not None
            assert decoded.growth_columns.packed_page_hashes == h("a", 1)
    assert versions[0] < STEP_WIRE_GROWTH_HASHES_VERSION
    assert versions[1:] == [STEP_WIRE_GROWTH_HASHES_VERSION] * 2


def test_hashes_of_their_own_size() -> None:
    """An engine hashing unlike the pool (16-byte hashes beside sha256_cbor's 32) says its
    size; the pages take those hashes, in either form, and a record keeps the size."""
    d = two_pages()
    for i in range(8):
        d.admit(f"c{i}", 3, 0)
    d.step(
        growths=(
            Growth("a", 2, tokens(6, 2), packed_page_hashes=h("a", 1)[:16], page_hash_size=16),
        )
    )
    assert d.state.manager._requests["a"].hashes[1] == h("a", 1)[:16]
    cols = columns(
        [(f"c{i}", tokens(i, 1), (h(f"c{i}", 0)[:16],) if i % 2 else ()) for i in range(8)]
    )
    cols = dataclasses.replace(cols, page_hash_size=16)
    d.step(growth_columns=cols)
    assert d.state.manager._requests["c1"].hashes == [h("c1", 0)[:16]]
    decoded, _ = decode_command(encode_command(d.commands[-1]))
    assert decoded.growth_columns is not None and decoded.growth_columns.page_hash_size == 16
    for size, match in (
        (65, "page_hash_size 65 outside"),
        (-1, "page_hash_size -1 outside"),
        (12, "16 bytes are not a whole number of 12-byte|of 12 bytes but"),
    ):
        with pytest.raises(InvalidArgument, match=match):
            d.step(
                growths=(
                    Growth(
                        "c0",
                        2,
                        tokens(6, 5),
                        packed_page_hashes=h("x", 1)[:16],
                        page_hash_size=size,
                    ),
                )
            )
        with pytest.raises(InvalidArgument, match="growth_columns.page_hash_size|" + match):
            d.step(growth_columns=dataclasses.replace(cols, page_hash_size=size))
