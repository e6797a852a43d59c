"""Deferred caching (``PageManager.defer_caching``): a manager that leaves its admissions'
prefix-cache work for ``settle()`` answers exactly as one that does it at once, and after
settling holds the same index, queue, tables and events (same seqs, same order). So does
one given each prompt as :class:`CheckedTokens` and the client's page hashes checked (packed
when they are all of one width), as the service hands them over, where a fresh prompt
takes ``PageManager._admit_fresh`` instead of the general path."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from pagekeeper.core.config import GroupConfig, GroupKind, PoolConfig
from pagekeeper.core.errors import InvariantViolation, PagekeeperError
from pagekeeper.core.events import PageRemoved, PageStored
from pagekeeper.core.hashing import hash_pages
from pagekeeper.core.manager import (
    PageManager,
    check_packed_page_hashes,
    check_page_hashes,
    check_token_ids,
)
from pagekeeper.core.types import ExtraKeys
from pagekeeper.durability.snapshot import digest_tree
from tests.core.test_manager_model import prompt_strategy
from tests.helpers.props import examples


def _pair(num_pages: int, page_size: int, **kwargs) -> tuple[PageManager, PageManager]:
    eager, lazy, _ = _trio(num_pages, page_size, **kwargs)
    return eager, lazy


def _trio(num_pages: int, page_size: int, **kwargs) -> tuple[PageManager, PageManager, PageManager]:
    """Eager, deferred, and deferred taking checked tokens (the service's admissions)."""
    config = PoolConfig(
        num_pages=num_pages,
        groups=(GroupConfig(GroupKind.FULL, page_size),),
        max_model_len=256,
        **kwargs,
    )
    eager, lazy, checked = PageManager(config), PageManager(config), PageManager(config)
    lazy.defer_caching = checked.defer_caching = True
    return eager, lazy, checked


def _as_the_service_checks(page_hashes: list[bytes]):
    """Client hashes as the service's check of a step hands them over: packed when all are
    of one width (``packed_page_hashes``), else a checked tuple (``page_hashes``)."""
    widths = {len(h) for h in page_hashes}
    if len(widths) == 1:
        return check_packed_page_hashes(b"".join(page_hashes), widths.pop())
    return check_page_hashes(page_hashes)


def _digest(manager: PageManager) -> str:
    return digest_tree({"manager": manager.snapshot_state()})


class DeferredVsEager(RuleBasedStateMachine):
    """Every operation on both managers; the deferred one settles only when an operation
    makes it (or the ``settle`` rule does), so admissions pile up between settles."""

    requests = Bundle("requests")

    @initialize(num_pages=st.integers(2, 48), page_size=st.sampled_from([2, 4, 8, 16]))
    def setup(self, num_pages, page_size):
        self.eager, self.lazy, self.checked = _trio(num_pages, page_size)
        self.deferred = (self.lazy, self.checked)
        self.managers = (self.eager, *self.deferred)
        self.page_size = page_size
        self.counter = 0
        self.prompts: list[list[int]] = []
        self.known_hashes: list[bytes] = []

    @rule(
        target=requests,
        tokens=prompt_strategy(),
        chunk=st.integers(0, 30),
        lookahead=st.integers(0, 3),
        read_cache=st.booleans(),
        send_hashes=st.sampled_from(["none", "all", "some", "unchained", "unchained-some"]),
    )
    def admit(self, tokens, chunk, lookahead, read_cache, send_hashes):
        tokens = tokens or [1]
        self.prompts.append(tokens)
        self.counter += 1
        rid = f"r{self.counter}"
        page_hashes = None
        if send_hashes in ("all", "some"):
            page_hashes = hash_pages(tokens, self.page_size)
        elif send_hashes.startswith("unchained"):
            # A client's hashes need not chain: each page named by its own tokens, so a
            # page of one prompt matches a page of another at any place, without the
            # pages before it (a repeat within a prompt is refused, alike on both).
            ps = self.page_size
            page_hashes = [
                b"u" + bytes(tokens[i * ps : (i + 1) * ps]) for i in range(len(tokens) // ps)
            ]
        if page_hashes is not None and send_hashes.endswith("some"):
            page_hashes = page_hashes[: len(page_hashes) // 2]
        return self._admit(rid, tokens, chunk, lookahead, read_cache, page_hashes)

    def _admit(self, rid, tokens, chunk, lookahead, read_cache, page_hashes):
        ps = self.page_size
        self.known_hashes.extend(hash_pages(tokens, ps))
        if page_hashes is not None:
            self.known_hashes.extend(page_hashes)
        answers = []
        for m in self.managers:
            given, given_hashes = tokens, page_hashes
            try:
                if m is self.checked:
                    given = check_token_ids(np.asarray(tokens, dtype=np.int64))
                    if page_hashes is not None:
                        given_hashes = _as_the_service_checks(page_hashes)
                answers.append(
                    m.admit(
                        rid,
                        given,
                        num_new_tokens=chunk or None,
                        num_lookahead_tokens=lookahead,
                        enable_cache_read=read_cache,
                        page_hashes=given_hashes,
                    )
                )
            except PagekeeperError as exc:
                answers.append(f"{type(exc).__name__}: {exc.message}")
        assert answers[0] == answers[1] == answers[2]
        return rid

    @precondition(lambda self: self.prompts)
    @rule(target=requests, pick=st.integers(0, 2**16), extra=st.lists(st.integers(0, 20)))
    def admit_again(self, pick, extra):
        """An earlier prompt (perhaps still deferred), perhaps longer: a hit on pages a
        deferred admission has not cached yet."""
        tokens = self.prompts[pick % len(self.prompts)] + extra
        return self.admit(tokens, 0, 0, True, "none")

    @precondition(lambda self: self.known_hashes)
    @rule(
        target=requests,
        picks=st.lists(st.integers(0, 2**16), min_size=1, max_size=12),
        extra=st.integers(0, 3),
        seed=st.integers(0, 20),
    )
    def admit_borrowed_hashes(self, picks, extra, seed):
        """A client naming its pages by hashes other prompts' pages have (cached, deferred
        or not yet hashed here), at any place: matches without the pages before them."""
        known = self.known_hashes
        page_hashes = list(dict.fromkeys(known[p % len(known)] for p in picks))
        tokens = [seed] * (len(page_hashes) * self.page_size + extra)
        self.counter += 1
        return self._admit(f"r{self.counter}", tokens, 0, 0, True, page_hashes)

    @rule(rid=requests, new=st.lists(st.integers(0, 20), min_size=0, max_size=20))
    def grow(self, rid, new):
        if not self.eager.has_request(rid):
            return
        info = self.eager.request_info(rid)
        num_tokens = info.num_tokens + len(new)
        if num_tokens > 256 or num_tokens <= info.num_computed_tokens:
            return
        num_new = num_tokens - info.num_computed_tokens
        answers = [m.allocate(rid, num_new, new_token_ids=new) for m in self.managers]
        assert answers[0] == answers[1] == answers[2]

    @rule(seed=st.integers(0, 2**16))
    def decode_all(self, seed):
        rids = [r for r in self.eager.request_ids() if self.eager.request_info(r).num_tokens < 256]
        tokens = [(seed + 7 * i) % 21 for i in range(len(rids))]
        answers = [m.allocate_decodes(rids, tokens) for m in self.managers]
        assert answers[0] == answers[1] == answers[2]

    @rule(rid=consumes(requests))
    def free(self, rid):
        if not self.eager.has_request(rid):
            return
        for m in self.managers:
            m.free(rid)

    @rule(tokens=prompt_strategy())
    def lookup(self, tokens):
        if tokens:
            answers = [m.lookup(tokens) for m in self.managers]
            assert answers[0] == answers[1] == answers[2]

    @precondition(lambda self: not self.eager.request_ids())
    @rule()
    def reset(self):
        answers = [m.reset_prefix_cache() for m in self.managers]
        assert answers[0] == answers[1] == answers[2]

    @rule()
    def settle(self):
        """What every reader does first: then the two are the same, event for event."""
        events, digest = self.eager.take_events(), _digest(self.eager)
        for m in self.deferred:
            m.settle()
            assert not m.has_deferred
            assert m.take_events() == events
            assert _digest(m) == digest

    @invariant()
    def same_tables(self):
        # Reads that do not settle: the tables and the free pages are the same at once.
        eager = self.eager
        for m in self.deferred:
            assert m.pool.num_free_pages == eager.pool.num_free_pages
            assert m.pool.last_event_seq == eager.pool.last_event_seq
            for rid in eager.request_ids():
                assert m.page_table(rid).tolist() == eager.page_table(rid).tolist()

    def teardown(self):
        if hasattr(self, "lazy"):
            self.settle()
            for m in self.deferred:
                m.check_invariants()


DeferredVsEager = settings(
    max_examples=examples(80),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)(DeferredVsEager)
TestDeferredVsEager = DeferredVsEager.TestCase


def test_admissions_defer_and_settle_in_order():
    """Three admissions in a row, the third sharing the first's prompt: the first two
    defer, the third's lookup would hit the first's pages, so it settles them first."""
    eager, lazy = _pair(64, 4)
    first, second = list(range(1, 21)), list(range(50, 70))
    for m in (eager, lazy):
        m.admit("a", first)
        m.admit("b", second)
    assert lazy.has_deferred
    assert lazy.pool.num_cached_pages == 0  # nothing indexed yet
    assert lazy.pool.last_event_seq == eager.pool.last_event_seq == 2  # seqs held
    hit = [m.admit("c", first) for m in (eager, lazy)]
    assert hit[0] == hit[1]
    assert hit[1].num_cached_tokens == 16  # the first's 4 full pages (not its last token)
    lazy.settle()
    events = eager.take_events()
    # a's 5 pages, b's 5, then c's fifth page (its first 4 were a hit).
    assert [len(e.page_ids) for e in events] == [5, 5, 1]
    assert all(isinstance(e, PageStored) for e in events)
    assert lazy.take_events() == events
    assert _digest(eager) == _digest(lazy)


def test_eviction_events_keep_their_place():
    """A deferred admission's ``stored`` event comes before the ``removed`` events of a
    later admission's evictions, as when caching is not deferred."""
    eager, lazy = _pair(9, 4)  # 8 usable pages
    for m in (eager, lazy):
        m.admit("warm", list(range(200, 216)))  # 4 pages, cached
        m.free("warm")
        m.take_events()
        m.admit("a", list(range(1, 17)))  # takes the 4 uncached pages
        m.admit("b", list(range(300, 316)))  # evicts warm's 4 cached pages
    assert lazy.has_deferred
    lazy.settle()
    events = eager.take_events()
    assert [type(e).__name__ for e in events] == ["PageStored", "PageRemoved", "PageStored"]
    assert lazy.take_events() == events
    assert [e.seq for e in events] == sorted(e.seq for e in events)


def test_evictions_wait_and_a_taken_page_is_not_hit():
    """A deferred admission's allocation takes cached pages at once but leaves their
    index entries and ``removed`` event for settling; a later admission's lookup stops
    at a hit page that was taken, as it would once the entry is gone."""
    eager, lazy = _pair(9, 4)  # 8 usable pages
    a, w = list(range(1, 17)), list(range(100, 116))
    for m in (eager, lazy):
        m.admit("a", a)  # pages 1-4
        m.admit("w", w)  # pages 5-8
        m.free("a")  # queue: a's pages last first, then w's
        m.free("w")
        m.take_events()
        m.admit("b", list(range(200, 208)))  # takes a's last two pages, evicting them
    assert lazy.has_deferred
    assert lazy.pool.has_pending_evictions
    assert lazy.pool.num_evictions == 0 and eager.pool.num_evictions == 2
    assert lazy.pool.last_event_seq == eager.pool.last_event_seq  # the seq is held
    # a's first three page hashes are still indexed in the lazy pool, the third on a page
    # b holds now: the lookup must stop before it.
    hit = [m.admit("c", a[:13]) for m in (eager, lazy)]
    assert hit[0] == hit[1]
    assert hit[1].num_cached_tokens == 8
    lazy.settle()
    assert not lazy.pool.has_pending_evictions
    events = eager.take_events()
    assert [type(e).__name__ for e in events] == [
        "PageRemoved",  # b's allocation
        "PageStored",  # b's pages
        "PageRemoved",  # c's allocation (w's last two pages)
        "PageStored",  # c's pages past the hit
    ]
    assert lazy.take_events() == events
    assert _digest(eager) == _digest(lazy)
    assert not lazy.pool.check_invariants()


def test_evictions_do_not_wait_while_a_hash_has_two_pages():
    """Evicting a page whose hash another page also holds hands the entry to that page:
    a lookup could not tell the taken page's entry from a live one, so such evictions
    happen at once (the lookup then hits the duplicate, as without deferring)."""
    eager, lazy = _pair(13, 4)  # 12 usable pages
    a, w = list(range(1, 17)), list(range(100, 116))
    for m in (eager, lazy):
        m.admit("a", a)  # pages 1-4
        m.settle()
        m.admit("d", a, enable_cache_read=False)  # pages 5-8: duplicates of a's hashes
        m.admit("w", w)  # pages 9-12
        m.free("a")
        m.free("w")
        m.admit("b", list(range(200, 208)))  # takes a's last two pages
    assert not lazy.pool.has_pending_evictions
    hit = [m.admit("c", a[:13]) for m in (eager, lazy)]
    assert hit[0] == hit[1]
    assert hit[1].num_cached_tokens == 12  # the third page through d's duplicate
    lazy.settle()
    assert eager.take_events() == lazy.take_events()
    assert _digest(eager) == _digest(lazy)


def test_readers_settle_first():
    eager, lazy = _pair(64, 4)
    tokens = list(range(1, 30))
    for m in (eager, lazy):
        m.admit("a", tokens)
    assert lazy.has_deferred
    assert lazy.lookup(tokens) == eager.lookup(tokens)
    assert not lazy.has_deferred
    for m in (eager, lazy):
        m.admit("b", list(range(40, 60)))
    assert lazy.stats() == eager.stats()
    assert not lazy.has_deferred


def test_unfilled_reservation_is_refused():
    _eager, lazy = _pair(64, 4)
    lazy.admit("a", list(range(1, 30)))
    with pytest.raises(InvariantViolation, match="settle first"):
        lazy.pool.take_events()


def test_extra_keys_and_hybrid_pools_do_not_defer():
    _eager, lazy = _pair(64, 4)
    lazy.admit("a", list(range(1, 30)), extra_keys=ExtraKeys(cache_salt="s"))
    assert not lazy.has_deferred
    hybrid = PageManager(
        PoolConfig(
            num_pages=64,
            groups=(
                GroupConfig(GroupKind.FULL, 4),
                GroupConfig(GroupKind.SLIDING_WINDOW, 4, window=8),
            ),
        )
    )
    hybrid.defer_caching = True
    hybrid.admit("a", list(range(1, 30)))
    assert not hybrid.has_deferred


def test_events_record_the_same_tokens():
    eager, lazy = _pair(64, 4)
    for m in (eager, lazy):
        m.admit("a", list(range(1, 30)))
    lazy.settle()
    (stored,) = lazy.take_events()
    assert isinstance(stored, PageStored)
    assert list(stored.token_ids) == list(range(1, 29))
    assert eager.take_events() == [stored]
    assert not isinstance(stored, PageRemoved)


def test_duplicate_lists_snapshot_alike_when_an_eviction_comes_between():
    """A deferred page that waits behind a duplicate hash whose other waiting page is
    evicted before settling re-creates that duplicate list elsewhere in the pool's dict:
    the snapshot lists duplicate hashes in hash order, so the bytes do not differ."""
    eager, lazy = _pair(8, 4)  # 7 usable pages
    first, second = [1, 2, 3, 4], [9, 9, 9, 9]
    for m in (eager, lazy):
        m.admit("s", first)
        m.admit("n1", first, enable_cache_read=False)  # a duplicate of s's page
        m.admit("s2", second)
        m.admit("n2", second, enable_cache_read=False)
        m.free("n1")  # its page: free, cached, a duplicate
        m.admit("a", first)  # caches its own page under that hash (deferred)
        m.admit("b", [7] * 12)  # takes the last free pages, n1's among them
    assert lazy.has_deferred
    lazy.settle()
    assert eager.take_events() == lazy.take_events()
    assert _digest(eager) == _digest(lazy)


def test_client_page_hashes_are_checked_page_by_page():
    """A client's hashes need not chain: a later prompt can match one of a deferred
    admission's later pages without its first. Every page such an admission will cache
    is checked, so the later lookup settles it first and hits as at once."""
    eager, lazy = _pair(64, 4)

    def h(name: str) -> bytes:
        return name.encode().ljust(16, b"\0")

    for m in (eager, lazy):
        m.admit("w", list(range(1, 9)), page_hashes=[h("x"), h("w1")])
        m.free("w")
        m.admit("a", list(range(20, 33)), page_hashes=[h("y"), h("a1"), h("a2")])
    assert lazy.has_deferred  # deferred, with every page's hash known
    answers = [
        m.admit("b", list(range(40, 53)), page_hashes=[h("x"), h("a1"), h("b2")])
        for m in (eager, lazy)
    ]
    assert answers[0] == answers[1]
    assert answers[1].num_cached_tokens == 8
    lazy.settle()
    assert eager.take_events() == lazy.take_events()
    assert _digest(eager) == _digest(lazy)


def test_client_hashes_settle_a_chained_admission_first():
    """A chained admission deferred knows only its first page to cache; a prompt with the
    client's hashes could match one of its later pages alone, so it settles first."""
    eager, lazy = _pair(64, 4)
    first = list(range(1, 13))
    w_hash = b"w0".ljust(16, b"\0")
    for m in (eager, lazy):
        m.admit("w", [90] * 5, page_hashes=[w_hash])
        m.free("w")
        m.settle()
        m.admit("a", first)
    assert lazy.has_deferred
    # The client names b's first page as w's (cached), its second as a's third (as no
    # chain would): at once, a's pages are cached and b hits both.
    b_hashes = [w_hash, hash_pages(first, 4)[2], b"b2".ljust(16, b"\0")]
    answers = [m.admit("b", list(range(50, 63)), page_hashes=b_hashes) for m in (eager, lazy)]
    assert answers[0] == answers[1]
    assert answers[1].num_cached_tokens == 8
    assert lazy.has_deferred  # b deferred in turn, after a settled
    lazy.settle()
    assert eager.take_events() == lazy.take_events()
    assert _digest(eager) == _digest(lazy)


def test_fresh_prompts_take_the_short_path():
    """A checked prompt whose first page misses takes ``_admit_fresh``; a hit, a first page
    a deferred admission caches, or a prompt of one page leaves it to the general path,
    having changed nothing."""
    from pagekeeper.core.manager import _NOT_FRESH

    _, lazy, _ = _trio(64, 4)
    prompt = np.arange(1, 11)

    def checked(tokens):
        return check_token_ids(np.asarray(tokens, dtype=np.int64)).array

    allocation = lazy._admit_fresh("a", checked(prompt), 2, "")
    assert allocation is not _NOT_FRESH and allocation.new_page_ids == ((1, 2, 3),)
    before = (lazy.pool.num_free_pages, lazy.pool.last_event_seq, set(lazy.request_ids()))
    # Its first page is deferred (not yet in the index): the general path settles first.
    assert lazy._admit_fresh("b", checked(prompt), 0, "") is _NOT_FRESH
    lazy.settle()
    assert lazy._admit_fresh("b", checked(prompt), 0, "") is _NOT_FRESH  # a hit now
    assert lazy._admit_fresh("c", checked([5, 6, 7, 8]), 0, "") is _NOT_FRESH  # one page
    assert lazy._admit_fresh("a", checked([9] * 8), 0, "") is _NOT_FRESH  # already held
    assert (lazy.pool.num_free_pages, lazy.pool.last_event_seq, set(lazy.request_ids())) == before
    assert lazy.admit("b", prompt).num_cached_tokens == 8


@pytest.fixture(params=["native", "python"])
def digest_ops(request, monkeypatch):
    """The packed hashes' C helpers, or none of them (the Python fallbacks)."""
    import pagekeeper.core.manager as manager_module

    if request.param == "python":
        for name in ("_split_digests", "_check_digests", "_DigestSet"):
            monkeypatch.setattr(manager_module, name, None)
    return request.param


def test_packed_client_hashes_take_the_short_path(digest_ops):
    """Packed client hashes covering every page: the short path keeps only the first hash
    until settle (the rest stay packed), yet a later prompt naming one of its later pages
    first (as no chain would) finds it deferred, settles, and hits as at once."""
    from pagekeeper.core.manager import _NOT_FRESH, _DigestSet

    eager, lazy, _ = _trio(64, 4)
    prompt = list(range(1, 14))  # 3 full pages
    names = [bytes([i]) * 32 for i in range(1, 4)]
    packed = check_packed_page_hashes(b"".join(names), 32)
    tokens = check_token_ids(np.asarray(prompt, dtype=np.int64))
    assert lazy.admit("a", tokens, page_hashes=packed) == eager.admit(
        "a", prompt, page_hashes=names
    )
    assert lazy.has_deferred
    if _DigestSet is not None:
        assert lazy._requests["a"].hashes == names[:1]  # the rest made by settle
    # Fewer hashes than full pages, or a chained admission deferred: the general path.
    short = check_packed_page_hashes(b"".join(names[:2]), 32)
    before = (lazy.pool.num_free_pages, lazy.pool.last_event_seq)
    assert lazy._admit_fresh("x", tokens.array, 0, "", short) is _NOT_FRESH
    assert (lazy.pool.num_free_pages, lazy.pool.last_event_seq) == before
    # b's first page is named as a's second: a's caching settles first, then b hits it.
    b_names = [names[1], names[2], b"\x09" * 32]
    b_prompt = list(range(50, 63))
    b_packed = check_packed_page_hashes(b"".join(b_names), 32)
    b_tokens = check_token_ids(np.asarray(b_prompt, dtype=np.int64))
    answers = [
        eager.admit("b", b_prompt, page_hashes=b_names),
        lazy.admit("b", b_tokens, page_hashes=b_packed),
    ]
    assert answers[0] == answers[1]
    assert answers[1].num_cached_tokens == 8
    lazy.settle()
    assert lazy._requests["a"].hashes == names
    assert eager.take_events() == lazy.take_events()
    assert _digest(eager) == _digest(lazy)


def test_packed_client_hashes_are_checked(digest_ops):
    from pagekeeper.core.errors import InvalidArgument

    a, b = b"\x01" * 16, b"\x02" * 16
    assert list(check_packed_page_hashes(a + b, 16)) == [a, b]
    assert len(check_packed_page_hashes(a + b, 16)) == 2
    with pytest.raises(InvalidArgument, match="not a whole number of 16-byte hashes"):
        check_packed_page_hashes(a + b"\x03", 16)
    with pytest.raises(InvalidArgument, match=f"page hash {a.hex()} repeats"):
        check_packed_page_hashes(a + b + a, 16)
    with pytest.raises(InvalidArgument, match="must be bytes"):
        check_packed_page_hashes(bytearray(a), 16)  # type: ignore[arg-type]
