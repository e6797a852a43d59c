"""The core's fast event builders make the same frozen objects as the constructors."""

from __future__ import annotations

import dataclasses
import pickle
from array import array

import pytest

from pagekeeper.core.events import PageRemoved, PageStored, TokenRun, new_removed, new_stored
from pagekeeper.core.types import ExtraKeys, MultiModalKey


def test_new_stored_is_the_constructed_event() -> None:
    run = TokenRun.adopt(array("Q", range(32)))
    keys = ExtraKeys(lora_name="lora-a", mm_inputs=(MultiModalKey("img", 3, 40),))
    values = (7, 1, (b"h1", b"h2"), b"parent", run, 16, (3, 9), "lora-a", keys, 4)
    built, made = new_stored(*values), PageStored(*values)
    assert type(built) is PageStored
    assert built == made and hash(built) == hash(made) and repr(built) == repr(made)
    assert dataclasses.astuple(built) == dataclasses.astuple(made)
    assert pickle.loads(pickle.dumps(built)) == made
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.seq = 8  # type: ignore[misc]
    # Every field is filled: a field the builder did not know would be missing here.
    assert [f.name for f in dataclasses.fields(PageStored)] == [
        "seq", "group_id", "page_hashes", "parent_page_hash", "token_ids", "page_size",
        "page_ids", "lora_name", "extra_keys", "first_page",
    ]  # fmt: skip
    assert all(hasattr(built, f.name) for f in dataclasses.fields(PageStored))
    plain = new_stored(1, 0, (b"h",), None, run, 16, (2,), None)
    assert plain.parent_page_hash is None
    assert (plain.extra_keys, plain.first_page) == (None, 0)


def test_new_removed_is_the_constructed_event() -> None:
    built, made = new_removed(3, 0, (b"h",), (5,)), PageRemoved(3, 0, (b"h",), (5,))
    assert type(built) is PageRemoved and built == made and hash(built) == hash(made)
    assert [f.name for f in dataclasses.fields(PageRemoved)] == [
        "seq", "group_id", "page_hashes", "page_ids",
    ]  # fmt: skip
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.page_ids = ()  # type: ignore[misc]
