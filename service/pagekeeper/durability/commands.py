"""Commands <-> log record bodies.

A body is ``kind (u8) | version (u8) | value`` where the value is a positional list encoded
with :mod:`pagekeeper.durability.values`. Steps are stored column-wise (all growths' request
ids in one string list, their token ids in one array, their counters in arrays), so a
256-decode step encodes in a few dozen C calls. A step's record also keeps how its batch
was published (``is_published``, ``published_slot``, ``publish_error``): a replay does not
republish, yet a retry after a restart must get the answer the first call got.

A step that arrived over gRPC is stored as the request's own protobuf bytes (kind
``step_wire``), one serialization instead of a tree encode; replay parses it back through
the same conversion the servicer used. Version 1 was the tree ``[now, publication,
bytes]``; version 2 (written since 2026-12-06) a fixed header, the publish error, then the
bytes.

Record kinds are stable numbers; a new command gets a new number, a changed layout a new
version of its kind, and old versions keep decoding.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np

from pagekeeper.core.snapshot import extra_keys_from_tree, extra_keys_to_tree
from pagekeeper.core.types import ExtraKeys
from pagekeeper.durability.values import ValueDecodeError, decode, encode
from pagekeeper.state import (
    Admission,
    Batch,
    ClientRole,
    Command,
    ConfigureLimitsCommand,
    ExpireLeasesCommand,
    ForceFreeCommand,
    Growth,
    GrowthColumns,
    HeartbeatCommand,
    RegisterCommand,
    ResetPrefixCacheCommand,
    ResumeLeasesCommand,
    StepCommand,
    StepResult,
    UnregisterCommand,
    kernel_support_from_tree,
    kernel_support_to_tree,
    limits_from_tree,
    limits_to_tree,
)

KIND_REGISTER = 1
KIND_HEARTBEAT = 2
KIND_UNREGISTER = 3
KIND_STEP = 4
KIND_EXPIRE_LEASES = 5
KIND_RESET_PREFIX_CACHE = 6
KIND_FORCE_FREE = 7
KIND_RESUME_LEASES = 8
KIND_CONFIGURE_LIMITS = 9
KIND_STEP_WIRE = 10
VERSION = 1

KIND_NAMES = {
    KIND_REGISTER: "register",
    KIND_HEARTBEAT: "heartbeat",
    KIND_UNREGISTER: "unregister",
    KIND_STEP: "step",
    KIND_EXPIRE_LEASES: "expire_leases",
    KIND_RESET_PREFIX_CACHE: "reset_prefix_cache",
    KIND_FORCE_FREE: "force_free",
    KIND_RESUME_LEASES: "resume_leases",
    KIND_CONFIGURE_LIMITS: "configure_limits",
    KIND_STEP_WIRE: "step_wire",
}

Publication = tuple[bool, int, str]
"""How a step's batch was published: (is_published, published_slot, publish_error)."""

_EMPTY_I32 = np.empty(0, dtype=np.int32)
_EMPTY_I32.flags.writeable = False


class RecordDecodeError(ValueError):
    """A record body that is not a command this version can read."""


class RecordFromNewerVersion(RecordDecodeError):
    """A record of a kind, or a kind's version, that this version does not know: what a
    newer pagekeeper writes (recovery refuses the data dir rather than drop it as damage)."""


# Version 2 of ``step_wire``: a fixed header (now, publication flags, published slot,
# publish_error's length), publish_error (UTF-8), then the request's bytes to the end.
_WIRE_HEADER = struct.Struct("<dBqI")
_WIRE_HAS_PUBLICATION, _WIRE_PUBLISHED = 1, 2
STEP_WIRE_VERSION = 2
# A step that names a request an admin freed (``StepResult.names_revoked``) is the next
# version of its kind, the same layout: a pagekeeper from before revocations would refuse
# the step on replay (NOT_FOUND), take it for damage and drop it with every record after
# it; a version it does not know makes it refuse the data dir instead.
STEP_WIRE_REVOKED_VERSION = 3
STEP_TREE_REVOKED_VERSION = 2
# A step whose growths carry client page hashes (``Growth.page_hashes``, the columns'
# ``packed_page_hashes``) is the next version of its kind (a revoked name or not): a
# pagekeeper from before them would replay its wire form without them, hashing those pages
# itself, into another prefix cache; a version it does not know makes it refuse the data
# dir instead. The tree form adds the hashes to its growths (9 or 11 entries).
STEP_WIRE_GROWTH_HASHES_VERSION = 4
STEP_TREE_GROWTH_HASHES_VERSION = 3
# A force-free that leaves its scheduler a revocation to acknowledge (the answer to
# ``ServiceState.force_free`` is True) is version 2 of its kind, the same layout: an older
# pagekeeper would replay it without one, and answer the owner's free of the request
# NOT_FOUND (the step it then refuses, it drops with the records after it).
FORCE_FREE_REVOKED_VERSION = 2
REGISTER_FRESH_VERSION = 2
"""A worker's registration with an empty KV cache: the running requests are freed and
revoked, then the prefix cache is forgotten. A pagekeeper from before it refuses the data
dir instead of replaying it as a plain registration. (Two development builds of
2026-12-07, never released, wrote this version forgetting the cache only; their data dirs
replay here with the revocations added.)"""
# ``resume_leases``: version 1 [now] (extend; [now, 1] a cap, as one day's development build
# wrote it), version 2 [now, mode] (cap, exact; development builds also wrote [now] for
# exact and [now, 3, by] for a shift), version 3 [now, by] (shift).
RESUME_MODE_VERSION = 2
RESUME_SHIFT_VERSION = 3
_RESUME_MODE_CODES = {"cap": 1, "exact": 2}
_RESUME_MODES_BY_CODE = {code: mode for mode, code in _RESUME_MODE_CODES.items()}


def _number(value: Any) -> float:
    if type(value) not in (int, float) or not math.isfinite(value):
        raise RecordDecodeError(f"resume_leases record: {value!r} is not a finite number")
    return float(value)


def _resume_from_tree(version: int, tree: Any) -> ResumeLeasesCommand:
    if not isinstance(tree, list) or not tree:
        raise RecordDecodeError("resume_leases record has the wrong shape")
    now = _number(tree[0])
    if version == 1 and len(tree) == 1:
        return ResumeLeasesCommand(now)
    if version == 1 and len(tree) == 2 and type(tree[1]) is int and tree[1] == 1:
        return ResumeLeasesCommand(now, "cap")
    # Two development builds of one day wrote version 2 as [now] (exact) and [now, 3, by]
    # (shift): read back, not dropped with everything after them.
    if version == RESUME_MODE_VERSION and len(tree) == 1:
        return ResumeLeasesCommand(now, "exact")
    if version == RESUME_MODE_VERSION and len(tree) == 3 and type(tree[1]) is int and tree[1] == 3:
        return ResumeLeasesCommand(now, "shift", _number(tree[2]))
    if version == RESUME_MODE_VERSION and len(tree) == 2 and type(tree[1]) is int:
        mode = _RESUME_MODES_BY_CODE.get(tree[1])
        if mode is None:
            # A mode a newer pagekeeper added: refuse the dir rather than drop the record.
            raise RecordFromNewerVersion(f"resume_leases mode {tree[1]} is unknown here")
        return ResumeLeasesCommand(now, mode)
    if version == RESUME_SHIFT_VERSION and len(tree) == 2:
        return ResumeLeasesCommand(now, "shift", _number(tree[1]))
    raise RecordDecodeError(f"resume_leases record version {version} has the wrong shape")


READABLE_VERSIONS = {
    KIND_STEP: (1, STEP_TREE_REVOKED_VERSION, STEP_TREE_GROWTH_HASHES_VERSION),
    KIND_FORCE_FREE: (1, FORCE_FREE_REVOKED_VERSION),
    KIND_REGISTER: (1, REGISTER_FRESH_VERSION),
    KIND_STEP_WIRE: (
        1,
        STEP_WIRE_VERSION,
        STEP_WIRE_REVOKED_VERSION,
        STEP_WIRE_GROWTH_HASHES_VERSION,
    ),
    KIND_RESUME_LEASES: (1, RESUME_MODE_VERSION, RESUME_SHIFT_VERSION),
}
"""The record versions a kind reads (any other kind: ``VERSION`` only)."""


def _encode_step_wire(
    command: StepCommand, result: StepResult | None
) -> tuple[bytes, bytes | memoryview]:
    # Every step that came over gRPC or the socket: a struct header instead of a value
    # tree (~6 µs less a step), then the request: the bytes it came in when the transport
    # kept them (no second serialization and no copy: an admission step's tens of KB went
    # through protobuf again and a join, 60-70 µs of a ~400 µs step in the service), else
    # the message serialized. Either parses to the same message.
    wire = command.wire
    assert wire is not None
    version = STEP_WIRE_VERSION
    if result is None:
        flags, slot, error = 0, 0, b""
    else:
        flags = _WIRE_HAS_PUBLICATION | (_WIRE_PUBLISHED if result.is_published else 0)
        slot, error = result.published_slot, result.publish_error.encode()
        if result.names_revoked:
            version = STEP_WIRE_REVOKED_VERSION
    if _carries_growth_hashes(command):
        version = STEP_WIRE_GROWTH_HASHES_VERSION
    received = command.wire_bytes
    return (
        b"".join(
            (
                bytes((KIND_STEP_WIRE, version)),
                _WIRE_HEADER.pack(command.now, flags, slot, len(error)),
                error,
            )
        ),
        wire.SerializeToString() if received is None else received,
    )


def _growths_carry_hashes(growths: tuple[Growth, ...]) -> bool:
    return any(g.page_hashes is not None or g.packed_page_hashes for g in growths)


def _carries_growth_hashes(command: StepCommand) -> bool:
    columns = command.growth_columns
    if columns is not None and columns.num_page_hashes is not None:
        return True
    return _growths_carry_hashes(command.growths)


def encode_command(command: Command, result: Any = None) -> bytes:
    """The log record body of an applied command (``result``: the step's answer)."""
    return b"".join(encode_command_parts(command, result))


def encode_command_parts(command: Command, result: Any = None) -> tuple[bytes | memoryview, ...]:
    """:func:`encode_command` as parts whose concatenation is the body (what the journal
    writes as they are)."""
    if isinstance(command, StepCommand) and command.wire is not None:
        return _encode_step_wire(command, result)
    return (_encode_tree_command(command, result),)


def _encode_tree_command(command: Command, result: Any) -> bytes:
    kind: int
    tree: Any
    if isinstance(command, StepCommand):
        kind, tree = KIND_STEP, _step_to_tree(command, result)
        if _carries_growth_hashes(command):
            return bytes((kind, STEP_TREE_GROWTH_HASHES_VERSION)) + encode(tree)
        if result is not None and result.names_revoked:
            return bytes((kind, STEP_TREE_REVOKED_VERSION)) + encode(tree)
    elif isinstance(command, HeartbeatCommand):
        kind, tree = KIND_HEARTBEAT, [command.now, command.client_id, command.generation]
    elif isinstance(command, RegisterCommand):
        kind = KIND_REGISTER
        tree = [
            command.now,
            command.role.value,
            command.name,
            command.client_id,
            float(command.lease_ttl_s),
            command.device,
            kernel_support_to_tree(command.kernel_support),
            # Only when bound: records without client certificates stay as they were.
            *([command.identity] if command.identity or command.fresh_kv_cache else []),
        ]
        if command.fresh_kv_cache:
            return bytes((kind, REGISTER_FRESH_VERSION)) + encode([*tree, True])
    elif isinstance(command, UnregisterCommand):
        kind, tree = KIND_UNREGISTER, [command.now, command.client_id, command.generation]
    elif isinstance(command, ExpireLeasesCommand):
        kind, tree = KIND_EXPIRE_LEASES, [command.now]
    elif isinstance(command, ResetPrefixCacheCommand):
        kind, tree = KIND_RESET_PREFIX_CACHE, [command.now]
    elif isinstance(command, ForceFreeCommand):
        kind, tree = KIND_FORCE_FREE, [command.now, command.request_id]
        if result is True:
            return bytes((kind, FORCE_FREE_REVOKED_VERSION)) + encode(tree)
    elif isinstance(command, ResumeLeasesCommand):
        # An exact resume is version 2 of the kind: a pagekeeper from before it refuses the
        # data dir (it would apply a plain resume, and replay the records after it into
        # another state); a plain one stays version 1, readable by every version.
        if command.mode == "shift":
            tree = [command.now, command.by]
            return bytes((KIND_RESUME_LEASES, RESUME_SHIFT_VERSION)) + encode(tree)
        if command.mode != "extend":
            tree = [command.now, _RESUME_MODE_CODES[command.mode]]
            return bytes((KIND_RESUME_LEASES, RESUME_MODE_VERSION)) + encode(tree)
        kind, tree = KIND_RESUME_LEASES, [command.now]
    elif isinstance(command, ConfigureLimitsCommand):
        kind, tree = KIND_CONFIGURE_LIMITS, [command.now, limits_to_tree(command.limits)]
    else:
        raise TypeError(f"cannot log {type(command).__name__}")
    return bytes((kind, VERSION)) + encode(tree)


def decode_command(body: bytes | memoryview) -> tuple[Command, Publication | None]:
    """The command a record body holds, and (steps) how its batch was published."""
    if len(body) < 2:
        raise RecordDecodeError("record body shorter than its header")
    kind, version = body[0], body[1]
    if kind not in KIND_NAMES:
        raise RecordFromNewerVersion(f"unknown record kind {kind}")
    readable = READABLE_VERSIONS.get(kind, (VERSION,))
    if version not in readable:
        raise RecordFromNewerVersion(
            f"{KIND_NAMES[kind]} record version {version} is not {' or '.join(map(str, readable))}"
        )
    if kind == KIND_STEP_WIRE and version in (
        STEP_WIRE_VERSION,
        STEP_WIRE_REVOKED_VERSION,
        STEP_WIRE_GROWTH_HASHES_VERSION,
    ):
        return _step_wire_from_body(memoryview(body)[2:])
    try:
        tree = decode(memoryview(body)[2:])
        if kind == KIND_RESUME_LEASES:
            return _resume_from_tree(version, tree), None
        if kind == KIND_REGISTER and (version == REGISTER_FRESH_VERSION) != (
            isinstance(tree, list) and len(tree) == 9
        ):
            raise RecordDecodeError(f"register record version {version} has the wrong shape")
        return _from_tree(kind, tree)
    except RecordDecodeError:
        raise
    except ValueDecodeError as exc:
        raise RecordDecodeError(f"{KIND_NAMES[kind]} record: {exc}") from None
    except (TypeError, ValueError, IndexError, KeyError, OverflowError, AttributeError) as exc:
        # A tree of the wrong shape, or a number no field can hold (a CRC-valid record
        # never has either: this is the decoder refusing a damaged one, not crashing).
        raise RecordDecodeError(
            f"{KIND_NAMES[kind]} record has the wrong shape: {type(exc).__name__}: {exc}"
        ) from None


def record_kind(body: bytes | memoryview) -> str:
    """The kind's name (for reports), "?" when unreadable."""
    return KIND_NAMES.get(body[0], "?") if len(body) else "?"


def _from_tree(kind: int, tree: Any) -> tuple[Command, Publication | None]:
    if kind == KIND_STEP:
        return _step_from_tree(tree)
    if kind == KIND_STEP_WIRE:
        return _step_from_wire(tree)
    if kind == KIND_HEARTBEAT:
        now, client_id, generation = tree
        return HeartbeatCommand(float(now), str(client_id), int(generation)), None
    if kind == KIND_REGISTER:
        identity, fresh = "", False
        if isinstance(tree, list) and len(tree) == 9:
            *tree, fresh = tree
            if fresh is not True:
                raise RecordDecodeError("register record: fresh_kv_cache must be true")
        if isinstance(tree, list) and len(tree) == 8:
            *tree, identity = tree
        now, role, name, client_id, lease, device, support = tree
        return (
            RegisterCommand(
                now=float(now),
                role=ClientRole(role),
                name=str(name),
                client_id=str(client_id),
                lease_ttl_s=float(lease),
                device=str(device),
                kernel_support=kernel_support_from_tree(support),
                identity=str(identity),
                fresh_kv_cache=fresh,
            ),
            None,
        )
    if kind == KIND_UNREGISTER:
        now, client_id, generation = tree
        return UnregisterCommand(float(now), str(client_id), int(generation)), None
    if kind == KIND_EXPIRE_LEASES:
        return ExpireLeasesCommand(float(tree[0])), None
    if kind == KIND_RESET_PREFIX_CACHE:
        return ResetPrefixCacheCommand(float(tree[0])), None
    if kind == KIND_FORCE_FREE:
        return ForceFreeCommand(float(tree[0]), str(tree[1])), None
    if kind == KIND_RESUME_LEASES:
        return _resume_from_tree(1, tree), None
    if kind == KIND_CONFIGURE_LIMITS:
        return ConfigureLimitsCommand(float(tree[0]), limits_from_tree(tree[1])), None
    raise RecordDecodeError(f"unknown record kind {kind}")  # pragma: no cover - checked above


# -- steps -----------------------------------------------------------------------------------


def _ids(ids: list[str]) -> Any:
    """Request ids as one NUL-joined string (two C calls) unless an id holds a NUL."""
    joined = "\x00".join(ids)
    return joined if joined.count("\x00") == len(ids) - 1 else ids


def _ids_from(tree: Any, n: int) -> list[str]:
    """The ``n`` request ids of an id field; ValueError unless it holds exactly ``n``."""
    if n == 0:
        if not (isinstance(tree, (str, list)) and len(tree) == 0):
            raise ValueError("request ids where the count says none")
        return []
    ids = tree.split("\x00") if isinstance(tree, str) else [str(r) for r in tree]
    if len(ids) != n:
        raise ValueError("the growths' request ids do not match their count")
    return ids


def _column(values: list[int]) -> Any:
    """An int column: one int when every value is the same (a decode step's counters
    almost always are), else an int64 array."""
    first = values[0]
    if values.count(first) == len(values):
        return first
    return np.array(values, dtype=np.int64)


def _column_from(tree: Any, n: int) -> list[int]:
    if isinstance(tree, int):
        return [tree] * n
    values: list[int] = np.asarray(tree).tolist()
    if len(values) != n:
        raise ValueError("a growth column has the wrong length")
    return values


def _array_column(values: Any, n: int) -> Any:
    """``_column`` for an int32 array column (one int when uniform)."""
    array = np.asarray(values)
    if n and array.shape == (n,) and (array == array[0]).all():
        return int(array[0])
    return array.astype(np.int64)


def _int32_column(tree: Any, n: int) -> Any:
    if isinstance(tree, int):
        return np.full(n, tree, dtype=np.int32)
    column = np.asarray(tree).astype(np.int32)
    if column.shape != (n,):
        raise ValueError("a growth column has the wrong length")
    return column


def _step_to_tree(cmd: StepCommand, result: StepResult | None) -> list[Any]:
    growths_tree: list[Any] | None = None
    growths = cmd.growths
    if growths:
        # Column-wise, uniform columns as one int: a 256-decode step's record is its request
        # ids and its 256 token ids (~3 KB, one SQLite page).
        token_arrays = [g.new_token_ids for g in growths]
        growths_tree = [
            len(growths),
            _ids([g.request_id for g in growths]),
            _column([g.num_new_tokens for g in growths]),
            np.concatenate(token_arrays).astype(np.int32, copy=False),
            _column(list(map(len, token_arrays))),
            _column(
                [-1 if g.num_computed_tokens is None else g.num_computed_tokens for g in growths]
            ),
            _column([g.num_lookahead_tokens for g in growths]),
        ]
        if _growths_carry_hashes(growths):
            # Each growth's page hashes (None: none); the 8th entry says "not columns".
            growths_tree += [False, [_growth_hashes_tree(g) for g in growths]]
    columns = cmd.growth_columns
    if columns is not None:
        # Already column-wise; the 8th entry marks the form so replay rebuilds the same one.
        n = len(columns)
        growths_tree = [
            n,
            _ids(list(columns.request_ids)),
            _array_column(columns.num_new_tokens, n),
            np.asarray(columns.new_token_ids).astype(np.int32, copy=False),
            _array_column(columns.num_new_token_ids, n),
            _array_column(columns.num_computed_tokens, n),
            _array_column(columns.num_lookahead_tokens, n),
            True,
        ]
        if columns.num_page_hashes is not None:
            growths_tree += [
                columns.packed_page_hashes,
                _array_column(columns.num_page_hashes, n),
                columns.page_hash_size,
            ]
    admissions = [
        [
            a.request_id,
            np.asarray(a.token_ids).astype(np.int32, copy=False),
            a.num_new_tokens,
            None if a.extra_keys is None else extra_keys_to_tree(a.extra_keys),
            None if a.page_hashes is None else list(a.page_hashes),
            a.num_lookahead_tokens,
            a.enable_cache_read,
        ]
        for a in cmd.admissions
    ]
    batch: list[Any] | None = None
    if cmd.batch is not None:
        counts = cmd.batch.num_scheduled_tokens
        ends = cmd.batch.num_computed_tokens
        batch = [
            len(cmd.batch.request_ids),
            _ids(list(cmd.batch.request_ids)),
            None if counts is None else np.asarray(counts).astype(np.int32, copy=False),
        ]
        if ends is not None:
            # A 4th entry only when given: records without it read back as before.
            batch.append(np.asarray(ends).astype(np.int32, copy=False))
    publication = _publication(result)
    return [
        cmd.now,
        cmd.client_id,
        cmd.generation,
        cmd.step_id,
        [len(cmd.frees), _ids(list(cmd.frees))],
        growths_tree,
        admissions,
        batch,
        publication,
    ]


def _growth_hashes_tree(growth: Growth) -> list[bytes] | bytes | None:
    """A growth's page hashes as a record holds them: a list, or packed bytes of the pool's
    size as they came (a ``bytes`` entry), or None."""
    packed, size = growth.packed_page_hashes, growth.page_hash_size
    if packed is not None:
        if not size:
            return packed
        return [packed[i : i + size] for i in range(0, len(packed), size)]
    if growth.page_hashes is None:
        return None
    return list(growth.page_hashes)


def _publication(result: StepResult | None) -> list[Any] | None:
    if result is None:
        return None
    return [result.is_published, result.published_slot, result.publish_error]


def _step_from_wire(tree: list[Any]) -> tuple[StepCommand, Publication | None]:
    # The servicer's own conversion (imported here: the log module does not need gRPC
    # until it reads such a record).
    from google.protobuf.message import DecodeError

    from pagekeeper.core.errors import PagekeeperError
    from pagekeeper.rpc.convert import step_from_pb
    from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2 as pb

    now, pub, data = tree
    try:
        command = step_from_pb(pb.StepRequest.FromString(bytes(data)), float(now))
    except (DecodeError, PagekeeperError) as exc:
        raise ValueError(f"its StepRequest does not read back: {exc}") from None
    publication = None if pub is None else (bool(pub[0]), int(pub[1]), str(pub[2]))
    return command, publication


def _step_wire_from_body(rest: memoryview) -> tuple[StepCommand, Publication | None]:
    if len(rest) < _WIRE_HEADER.size:
        raise RecordDecodeError("step_wire record shorter than its header")
    now, flags, slot, error_len = _WIRE_HEADER.unpack_from(rest)
    start = _WIRE_HEADER.size
    if flags & ~(_WIRE_HAS_PUBLICATION | _WIRE_PUBLISHED) or error_len > len(rest) - start:
        raise RecordDecodeError("step_wire record has the wrong shape: bad header")
    try:
        error = bytes(rest[start : start + error_len]).decode()
    except UnicodeDecodeError:
        raise RecordDecodeError("step_wire record has the wrong shape: publish_error") from None
    pub = [bool(flags & _WIRE_PUBLISHED), slot, error] if flags & _WIRE_HAS_PUBLICATION else None
    try:
        return _step_from_wire([now, pub, rest[start + error_len :]])
    except (TypeError, ValueError, OverflowError) as exc:
        raise RecordDecodeError(f"step_wire record has the wrong shape: {exc}") from None


def _step_from_tree(tree: list[Any]) -> tuple[StepCommand, Publication | None]:
    now, client_id, generation, step_id, frees, growths_tree, admissions, batch, pub = tree
    growths: tuple[Growth, ...] = ()
    columns: GrowthColumns | None = None
    growth_hashes: Any = None
    if growths_tree is not None and len(growths_tree) == 9:
        # Growths with their page hashes, one entry each.
        growths_tree, is_columns, growth_hashes = growths_tree[:7], growths_tree[7], growths_tree[8]
        if is_columns is not False:
            raise ValueError("growths with page hashes marked as columns")
    if growths_tree is not None and len(growths_tree) in (8, 11):
        n, ids, num_new, tokens, token_lens, computed, lookahead, is_columns = growths_tree[:8]
        if is_columns is not True:
            raise ValueError("growth columns not marked as columns")
        # The ids first: they check the count against what the record holds before any
        # column is sized by it (a damaged count must not size an allocation).
        n = int(n)
        request_ids = _ids_from(ids, n)
        columns = GrowthColumns(
            request_ids=tuple(request_ids),
            num_new_tokens=_int32_column(num_new, n),
            new_token_ids=np.asarray(tokens, dtype=np.int32),
            num_new_token_ids=_int32_column(token_lens, n),
            num_computed_tokens=_int32_column(computed, n),
            num_lookahead_tokens=_int32_column(lookahead, n),
            # Uniform columns at their defaults: plain decodes, as the wire said.
            defaults_only=all(
                isinstance(v, int) for v in (num_new, token_lens, computed, lookahead)
            )
            and (num_new, token_lens, computed, lookahead) == (1, 1, -1, 0),
            packed_page_hashes=bytes(growths_tree[8]) if len(growths_tree) == 11 else b"",
            num_page_hashes=(
                _int32_column(growths_tree[9], n) if len(growths_tree) == 11 else None
            ),
            page_hash_size=int(growths_tree[10]) if len(growths_tree) == 11 else 0,
        )
    elif growths_tree is not None:
        n, ids, num_new, tokens, token_lens, computed, lookahead = growths_tree
        n = int(n)
        request_ids = _ids_from(ids, n)  # checks the count first, as above
        lengths = _column_from(token_lens, n)
        if sum(lengths) != len(tokens):
            raise ValueError("growth token lengths do not add up")
        if isinstance(token_lens, int) and token_lens == 1:
            pieces = list(tokens.reshape(n, 1))  # a decode step: one token each
        else:
            pieces = np.split(tokens, np.cumsum(lengths)[:-1])
        growths = tuple(
            Growth(rid, k, piece, None if c < 0 else c, la)
            for rid, k, piece, c, la in zip(
                request_ids,
                _column_from(num_new, n),
                pieces,
                _column_from(computed, n),
                _column_from(lookahead, n),
                strict=True,
            )
        )
        if growth_hashes is not None:
            if len(growth_hashes) != n:
                raise ValueError("the growths' page hashes do not match their count")
            for growth, hashes in zip(growths, growth_hashes, strict=True):
                if isinstance(hashes, (bytes, memoryview)):
                    growth.packed_page_hashes = bytes(hashes)
                elif hashes is not None:
                    growth.page_hashes = tuple(bytes(h) for h in hashes)
    decoded_admissions = tuple(
        Admission(
            request_id=str(rid),
            token_ids=np.asarray(tokens, dtype=np.int32),
            num_new_tokens=int(num_new),
            extra_keys=None if extra is None else _extra(extra),
            page_hashes=None if hashes is None else tuple(bytes(h) for h in hashes),
            num_lookahead_tokens=int(lookahead),
            enable_cache_read=bool(read),
        )
        for rid, tokens, num_new, extra, hashes, lookahead, read in admissions
    )
    decoded_batch = None
    if batch is not None:
        num_ids, request_ids, counts, *rest = batch
        ends = rest[0] if rest else None
        decoded_batch = Batch(
            tuple(_ids_from(request_ids, int(num_ids))),
            None if counts is None else np.asarray(counts, dtype=np.int32),
            None if ends is None else np.asarray(ends, dtype=np.int32),
        )
    command = StepCommand(
        now=float(now),
        client_id=str(client_id),
        generation=int(generation),
        step_id=int(step_id),
        frees=tuple(_ids_from(frees[1], int(frees[0]))),
        growths=growths,
        admissions=decoded_admissions,
        batch=decoded_batch,
        growth_columns=columns,
    )
    publication = None if pub is None else (bool(pub[0]), int(pub[1]), str(pub[2]))
    return command, publication


def _extra(tree: list[Any]) -> ExtraKeys:
    return extra_keys_from_tree(tree)


__all__ = [
    "KIND_NAMES",
    "Publication",
    "RecordDecodeError",
    "decode_command",
    "encode_command",
    "encode_command_parts",
    "record_kind",
]
