"""The client's wire encoding of id arrays: raw little-endian int32, checked in C."""

from __future__ import annotations

import numpy as np
import pytest

from pagekeeper_client.client import decode_i32, encode_i32
from pagekeeper_client.errors import InvalidArgumentError


@pytest.mark.parametrize("n", [0, 1, 16, 2000])
def test_lists_tuples_generators_and_arrays_encode_alike(n: int) -> None:
    values = [(i * 7919) % 2**31 for i in range(n)]
    expected = np.asarray(values, dtype="<i4").tobytes()
    assert encode_i32(values) == expected
    assert encode_i32(tuple(values)) == expected
    assert encode_i32(v for v in values) == expected
    assert encode_i32(np.asarray(values, dtype=np.int64)) == expected
    assert encode_i32([np.int64(v) for v in values]) == expected  # numpy scalars too
    assert decode_i32(expected).tolist() == values


@pytest.mark.parametrize("bad", [[1, 2**31], [-(2**31) - 1], [1, 2.5], ["7"], [None]])
def test_values_that_do_not_fit_int32_are_refused_with_a_clear_error(bad: list) -> None:
    with pytest.raises(InvalidArgumentError, match="int32"):
        encode_i32(bad)


@pytest.mark.parametrize(
    "bad",
    [
        np.array([1, 2**33], dtype=np.int64),  # a cast would wrap it to 1, 0
        np.array([-(2**31) - 1], dtype=np.int64),
        np.array([2**31], dtype=np.uint32),
        np.array([2**40], dtype=np.uint64),
        np.array([1.0, 2.5]),  # a cast would truncate
        np.array([True, False]),
    ],
    ids=["int64-big", "int64-small", "uint32-big", "uint64-big", "float", "bool"],
)
def test_arrays_are_refused_rather_than_cast_when_a_value_would_change(bad) -> None:
    with pytest.raises(InvalidArgumentError, match="int32"):
        encode_i32(bad)


def test_wider_arrays_that_fit_are_cast() -> None:
    for dtype in (np.int64, np.uint64, np.uint32, np.int16, np.uint8):
        values = np.array([0, 1, 200], dtype=dtype)
        assert encode_i32(values) == np.array([0, 1, 200], dtype="<i4").tobytes()
    assert (
        encode_i32(np.array([2**31 - 1, -(2**31)], dtype=np.int64))
        == np.array([2**31 - 1, -(2**31)], dtype="<i4").tobytes()
    )
