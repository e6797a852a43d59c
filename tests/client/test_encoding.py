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
