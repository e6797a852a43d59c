"""A small, safe, self-describing binary encoding for trees of plain values.

Used for log record bodies and snapshots. Not pickle (decoding runs no code and builds only
the types below) and no third-party format: the layout is defined here, in full, and is
versioned by whoever embeds it. Every value starts with a one-byte tag:

====  ==========================  ===================================================
tag   value                       payload
====  ==========================  ===================================================
N     ``None``                    —
T/F   ``True`` / ``False``        —
i     ``int`` (64-bit signed)     8 bytes LE
f     ``float``                   8 bytes LE (IEEE 754 double)
s     ``str``                     u32 length + UTF-8 (surrogates pass through)
b     ``bytes``                   u64 length + raw
l     ``list`` / ``tuple``        u32 count + values
d     ``dict`` (``str`` keys)     u32 count + (key as ``s`` payload, value) pairs
a     ``numpy.ndarray``           dtype string (``s`` payload), u8 ndim, u64 per dim,
                                  then the C-order little-endian data (u64 length first)
B     ``list`` of ``bytes``       u32 count, u32 length per item, the items back to back
S     ``list`` of ``str``         like ``B``, items UTF-8 encoded
====  ==========================  ===================================================

``B`` and ``S`` are what make bulky trees cheap: a list of 100,000 page hashes is two C
calls (``b"".join`` and one length array), not 100,000 tagged values. Tuples decode as
lists. :class:`ValueDecodeError` reports any malformed input (truncated, unknown tag,
trailing bytes) without building anything partial.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

_U8 = struct.Struct("<B")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1
_LE_U32 = np.dtype("<u4")
# Only these dtypes may appear in a tree: decoding never interprets an arbitrary dtype
# string (object arrays would be a way in for code).
_ALLOWED_DTYPES = {
    np.dtype(t).str: np.dtype(t)
    for t in (
        "<i1",
        "<i2",
        "<i4",
        "<i8",
        "<u1",
        "<u2",
        "<u4",
        "<u8",
        "<f4",
        "<f8",
        "|b1",
        "|u1",
        "|i1",
    )
}


class ValueDecodeError(ValueError):
    """The bytes are not a valid encoding (truncated, corrupt, or from another format)."""


_BYTES_ONLY = {bytes}
_STR_ONLY = {str}


_CHUNK = 8192
"""Items of a long list looked at per C-level pass when ``encode`` is given a ``pause``."""


def encode(value: Any, pause: Callable[[], None] | None = None) -> bytes:
    """Encode a tree of None/bool/int/float/str/bytes/list/tuple/dict/ndarray.

    ``pause``: called between chunks of the long C-level passes over a list's items (a
    snapshot's 70,000 page hashes take milliseconds each, during which no other thread
    runs): an encoder in a worker thread passes one that lets the event loop run. The bytes
    do not depend on it."""
    out: list[bytes] = []
    _encode(value, out, pause)
    return b"".join(out)


def _chunks(items: Any, pause: Callable[[], None] | None) -> Iterator[Any]:
    """``items`` whole without ``pause``, else in slices of ``_CHUNK``, pausing after each."""
    if pause is None or len(items) <= _CHUNK:
        yield items
        return
    for start in range(0, len(items), _CHUNK):
        yield items[start : start + _CHUNK]
        pause()


def _encode(value: Any, out: list[bytes], pause: Callable[[], None] | None = None) -> None:
    kind = type(value)
    if value is None:
        out.append(b"N")
    elif kind is bool:
        out.append(b"T" if value else b"F")
    elif kind is int or isinstance(value, np.integer):
        number = int(value)
        if not _I64_MIN <= number <= _I64_MAX:
            raise TypeError(f"int {number} does not fit in 64 bits")
        out.append(b"i" + _I64.pack(number))
    elif kind is float or isinstance(value, np.floating):
        out.append(b"f" + _F64.pack(float(value)))
    elif kind is str:
        data = value.encode("utf-8", "surrogatepass")
        out.append(b"s" + _U32.pack(len(data)) + data)
    elif kind is bytes or kind is bytearray or kind is memoryview:
        data = bytes(value)
        out.append(b"b" + _U64.pack(len(data)))
        out.append(data)
    elif kind is list or kind is tuple:
        # One C-level pass over the item types (a step's page-hash lists are hundreds long).
        types: set[type] = set()
        for part in _chunks(value, pause):
            types.update(map(type, part))
        if types == _BYTES_ONLY:
            _encode_blobs(b"B", value, out, pause)
        elif types == _STR_ONLY:
            _encode_blobs(b"S", [v.encode("utf-8", "surrogatepass") for v in value], out, pause)
        else:
            out.append(b"l" + _U32.pack(len(value)))
            for item in value:
                _encode(item, out, pause)
    elif kind is dict:
        out.append(b"d" + _U32.pack(len(value)))
        for key, item in value.items():
            if type(key) is not str:
                raise TypeError(f"dict keys must be str, got {type(key).__name__}")
            data = key.encode("utf-8", "surrogatepass")
            out.append(_U32.pack(len(data)) + data)
            _encode(item, out, pause)
    elif isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value)
        dtype = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
        if dtype.str not in _ALLOWED_DTYPES:
            raise TypeError(f"arrays of dtype {array.dtype} cannot be encoded")
        array = array.astype(dtype, copy=False)
        name = dtype.str.encode()
        header = [b"a", _U32.pack(len(name)), name, _U8.pack(array.ndim)]
        header += [_U64.pack(d) for d in array.shape]
        data = array.tobytes()
        header.append(_U64.pack(len(data)))
        out.append(b"".join(header))
        out.append(data)
    else:
        raise TypeError(f"cannot encode {kind.__name__}")


def _encode_blobs(
    tag: bytes, items: Any, out: list[bytes], pause: Callable[[], None] | None = None
) -> None:
    out.append(tag + _U32.pack(len(items)))
    lengths, blobs = [], []
    for part in _chunks(items, pause):
        lengths.append(np.fromiter(map(len, part), dtype=_LE_U32, count=len(part)).tobytes())
        blobs.append(b"".join(part))
    out.extend(lengths)
    out.extend(blobs)


def decode(data: bytes | memoryview) -> Any:
    """Decode one value that spans ``data`` exactly."""
    view = memoryview(data)
    try:
        value, offset = _decode(view, 0)
    except (struct.error, IndexError, UnicodeDecodeError, ValueError) as exc:
        if isinstance(exc, ValueDecodeError):
            raise
        raise ValueDecodeError(f"malformed value: {exc}") from None
    if offset != len(view):
        raise ValueDecodeError(f"{len(view) - offset} trailing bytes after the value")
    return value


def _need(view: memoryview, offset: int, size: int) -> None:
    if offset + size > len(view):
        raise ValueDecodeError(f"truncated: need {size} bytes at offset {offset}")


def _decode(view: memoryview, offset: int) -> tuple[Any, int]:
    _need(view, offset, 1)
    tag = view[offset]
    offset += 1
    if tag == 0x4E:  # N
        return None, offset
    if tag == 0x54:  # T
        return True, offset
    if tag == 0x46:  # F
        return False, offset
    if tag == 0x69:  # i
        _need(view, offset, 8)
        return _I64.unpack_from(view, offset)[0], offset + 8
    if tag == 0x66:  # f
        _need(view, offset, 8)
        return _F64.unpack_from(view, offset)[0], offset + 8
    if tag == 0x73:  # s
        return _decode_str(view, offset)
    if tag == 0x62:  # b
        _need(view, offset, 8)
        (size,) = _U64.unpack_from(view, offset)
        offset += 8
        _need(view, offset, size)
        return bytes(view[offset : offset + size]), offset + size
    if tag == 0x6C:  # l
        _need(view, offset, 4)
        (count,) = _U32.unpack_from(view, offset)
        offset += 4
        items = []
        for _ in range(count):
            item, offset = _decode(view, offset)
            items.append(item)
        return items, offset
    if tag == 0x64:  # d
        _need(view, offset, 4)
        (count,) = _U32.unpack_from(view, offset)
        offset += 4
        result: dict[str, Any] = {}
        for _ in range(count):
            key, offset = _decode_str(view, offset)
            result[key], offset = _decode(view, offset)
        return result, offset
    if tag == 0x61:  # a
        name, offset = _decode_str(view, offset)
        dtype = _ALLOWED_DTYPES.get(name)
        if dtype is None:
            raise ValueDecodeError(f"array dtype {name!r} is not allowed")
        _need(view, offset, 1)
        ndim = view[offset]
        offset += 1
        _need(view, offset, 8 * ndim + 8)
        shape = tuple(_U64.unpack_from(view, offset + 8 * i)[0] for i in range(ndim))
        offset += 8 * ndim
        (size,) = _U64.unpack_from(view, offset)
        offset += 8
        count = 1
        for d in shape:
            count *= d
        if size != count * dtype.itemsize:
            raise ValueDecodeError(f"array of shape {shape} cannot hold {size} bytes")
        _need(view, offset, size)
        array = np.frombuffer(view[offset : offset + size], dtype=dtype).reshape(shape).copy()
        return array, offset + size
    if tag == 0x42 or tag == 0x53:  # B, S
        _need(view, offset, 4)
        (count,) = _U32.unpack_from(view, offset)
        offset += 4
        _need(view, offset, 4 * count)
        lengths = np.frombuffer(view[offset : offset + 4 * count], dtype=_LE_U32)
        offset += 4 * count
        total = int(lengths.sum(dtype=np.uint64))
        _need(view, offset, total)
        blob = bytes(view[offset : offset + total])
        ends = np.cumsum(lengths, dtype=np.int64).tolist()
        starts = [0, *ends[:-1]]
        pieces = [blob[s:e] for s, e in zip(starts, ends, strict=True)]
        if tag == 0x53:
            return [p.decode("utf-8", "surrogatepass") for p in pieces], offset + total
        return pieces, offset + total
    raise ValueDecodeError(f"unknown tag 0x{tag:02x} at offset {offset - 1}")


def _decode_str(view: memoryview, offset: int) -> tuple[str, int]:
    _need(view, offset, 4)
    (size,) = _U32.unpack_from(view, offset)
    offset += 4
    _need(view, offset, size)
    return bytes(view[offset : offset + size]).decode("utf-8", "surrogatepass"), offset + size


__all__ = ["ValueDecodeError", "decode", "encode"]
