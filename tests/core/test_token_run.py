"""``TokenRun``: the packed token ids of a stored event stand wherever a tuple did."""

from __future__ import annotations

import pickle
from array import array

from pagekeeper.core.events import PageStored, TokenRun


def test_a_run_equals_and_hashes_like_the_tuple_of_its_ints():
    run = TokenRun([5, 6, 7])
    assert run == (5, 6, 7) and (5, 6, 7) == run  # noqa: SIM300 (the reflected side)
    assert run == [5, 6, 7] and [5, 6, 7] == run  # noqa: SIM300
    assert run == TokenRun((5, 6, 7)) and hash(run) == hash((5, 6, 7))
    assert run != (5, 6) and run != (5, 6, 8) and run != "567" and run != [5, 6, 7, 8]
    assert len(run) == 3 and list(run) == [5, 6, 7] and run[1] == 6 and run[-1] == 7
    assert run[1:] == (6, 7) and isinstance(run[1:], TokenRun)
    assert run.tolist() == [5, 6, 7] and 6 in run and run.index(7) == 2
    assert repr(run) == "TokenRun([5, 6, 7])"
    assert pickle.loads(pickle.dumps(run)) == run


def test_an_adopted_array_is_not_copied_and_events_compare_across_forms():
    ids = array("Q", [1, 2, 3, 4])
    run = TokenRun.adopt(ids)
    assert run._ids is ids
    made = PageStored(1, 0, (b"h",), None, run, 4, (9,))
    decoded = PageStored(1, 0, (b"h",), None, (1, 2, 3, 4), 4, (9,))
    assert made == decoded and hash(made) == hash(decoded)
    assert made != PageStored(1, 0, (b"h",), None, (1, 2, 3, 5), 4, (9,))
