"""Field-level mutations of valid ``StepRequest``s, applied in process (shared by the test
suite and ``make fuzz``).

Byte-level fuzzing (``fuzz.py``) mostly breaks the protobuf framing; this changes one or two
*fields* of well-formed requests with real ids to odd values (0, -1, 2**31-1, a huge
uint64, a column of the wrong length or of -1s, an empty or repeated id, a duplicated or
dropped list entry), so the values reach the conversion and the state's checks. Each
request goes through what the servicer does (parse, ``step_from_pb``, ``ServiceState.step``
with invariants checked after every change, the answer built and serialized). Only a
``PagekeeperError`` may come out (the servicer maps it to a documented status; anything
else would be INTERNAL), a refused step must leave the state digest exactly as it was, and
the invariants must hold after an accepted one.

It found a growth whose lookahead took its computed tokens past max_model_len (accepted,
then a later step crashed halfway with OverflowError).
"""

from __future__ import annotations

import copy
import traceback
from collections.abc import Iterator
from typing import Any

import numpy as np
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from pagekeeper.core.config import GroupConfig, GroupKind, PoolConfig
from pagekeeper.core.errors import PagekeeperError
from pagekeeper.core.hashing import hash_pages
from pagekeeper.durability.snapshot import state_digest
from pagekeeper.rpc import convert
from pagekeeper.state import ClientRole, Limits, RegisterCommand, ServiceState
from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2 as pb

PAGE = 16
FULL = PoolConfig(num_pages=256, groups=(GroupConfig(page_size=PAGE),), max_model_len=512)
HYBRID = PoolConfig(
    num_pages=320,
    groups=(
        GroupConfig(page_size=PAGE),
        GroupConfig(GroupKind.SLIDING_WINDOW, page_size=PAGE, window=40),
        GroupConfig(GroupKind.MAMBA, page_size=2 * PAGE, enable_state_caching=True),
    ),
    max_model_len=512,
)
LIMITS = Limits(
    lease_ttl_s=1e9, max_lease_ttl_s=1e9, max_requests_per_step=64, max_tokens_per_step=4096
)
RUNNING = [f"r{i}" for i in range(12)]

ODD_INTS = [0, -1, 1, 2, 3, 2**31 - 1, -(2**31), 10**6]
ODD_UINTS = [0, 1, 2**63 - 1, 2**64 - 1, 10**12]
ODD_STRINGS = ["", "\x00", "r0", "new", "zz", "é" * 300]


def _i32(values: Any) -> bytes:
    return np.asarray(values, dtype="<i4").tobytes()


ODD_BYTES = [
    b"",
    b"\x01",
    b"\x00\x00\x00",
    _i32([-1]),
    _i32([-1] * 10),
    _i32([2**31 - 1] * 5),
    _i32([0] * 10),
    _i32(range(600)),
]


class FieldFuzz:
    """One in-process service state, a scheduler with running requests, and the mutator."""

    def __init__(self, seed: int, hybrid: bool) -> None:
        self.rng = np.random.default_rng(seed)
        self.state = ServiceState(HYBRID if hybrid else FULL, LIMITS, debug_invariants=True)
        if seed % 2:
            # As the service runs (odd seeds): admissions cache after the step returns (the
            # digest taken before the next step settles them, invariants checked then).
            self.state.defer_caching(lambda: None)
        registration = self.state.register(RegisterCommand(now=0.0, role=ClientRole.SCHEDULER))
        self.client_id, self.generation = registration.client_id, registration.generation
        self.step_id = 0
        self.apply(
            self.request(
                admissions=[
                    pb.Admission(request_id=r, token_ids=_i32(range(i, 2 * i + 30)))
                    for i, r in enumerate(RUNNING)
                ]
            )
        )

    def request(self, **fields: Any) -> pb.StepRequest:
        self.step_id += 1
        return pb.StepRequest(
            client_id=self.client_id, generation=self.generation, step_id=self.step_id, **fields
        )

    def apply(self, request: pb.StepRequest) -> None:
        """What the servicer does with a Step (its bytes parsed again, as they arrive)."""
        parsed = pb.StepRequest.FromString(request.SerializeToString())
        command = convert.step_from_pb(parsed, 1.0)
        result = self.state.step(command)
        convert.step_result_to_pb(result, parsed, command).SerializeToString()

    def templates(self) -> Iterator[pb.StepRequest]:
        """Valid steps of every shape: column decodes, message growths with an admission,
        a free with column growths carrying held tokens, admissions with extra keys, client
        page hashes and a chunked prefill."""
        ids = [str(r) for r in self.rng.choice(RUNNING, 10, replace=False)]
        yield self.request(
            growth_columns=pb.GrowthColumns(request_ids=ids, new_token_ids=_i32([7] * 10)),
            batch=pb.Batch(request_ids=ids),
        )
        yield self.request(
            growths=[pb.Growth(request_id=ids[0], num_new_tokens=2, new_token_ids=_i32([5, 6]))],
            admissions=[
                pb.Admission(
                    request_id="new",
                    token_ids=_i32(range(40)),
                    num_new_tokens=20,
                    num_lookahead_tokens=2,
                )
            ],
            batch=pb.Batch(request_ids=[ids[0], "new"], num_scheduled_tokens=_i32([2, 20])),
        )
        yield self.request(
            free_request_ids=[ids[1]],
            growth_columns=pb.GrowthColumns(
                request_ids=ids[2:5],
                new_token_ids=_i32([1, 2, 3, 4]),
                num_new_token_ids=_i32([2, 1, 1]),
                num_new_tokens=_i32([2, 1, 1]),
                num_computed_tokens=_i32([-1, -1, -1]),
                num_lookahead_tokens=_i32([0, 1, 0]),
            ),
        )
        # Growths naming the pages their tokens complete (a page's worth each: one page).
        yield self.request(
            growths=[
                pb.Growth(
                    request_id=ids[5],
                    num_new_tokens=PAGE,
                    new_token_ids=_i32(range(PAGE)),
                    packed_page_hashes=bytes([1]) * 32,
                ),
                pb.Growth(
                    request_id=ids[6],
                    num_new_tokens=PAGE,
                    new_token_ids=_i32(range(PAGE)),
                    packed_page_hashes=bytes([2]) * 16,
                    page_hash_size=16,
                ),
            ],
        )
        yield self.request(
            growth_columns=pb.GrowthColumns(
                request_ids=ids[:8],
                new_token_ids=_i32(list(range(PAGE)) * 8),
                num_new_token_ids=_i32([PAGE] * 8),
                num_new_tokens=_i32([PAGE] * 8),
                packed_page_hashes=b"".join(bytes([10 + k]) * 32 for k in range(4)),
                num_page_hashes=_i32([1, 0] * 4),
            ),
        )
        prompt = np.arange(100, 170, dtype=np.int32)
        extra = pb.ExtraKeys(
            lora_name="l1",
            cache_salt="s",
            mm_inputs=[pb.MultiModalKey(identifier="img", offset=5, length=20)],
        )
        yield self.request(
            admissions=[
                pb.Admission(
                    request_id="ek",
                    token_ids=_i32(prompt),
                    extra_keys=extra,
                    num_new_tokens=40,
                    num_lookahead_tokens=1,
                ),
                pb.Admission(
                    request_id="ph",
                    token_ids=_i32(prompt),
                    page_hashes=hash_pages(prompt, PAGE),
                    enable_cache_read=False,
                ),
                # Reads the cache with the first half of its hashes sent (the service
                # completes the chain; on odd seeds its caching waits for settling).
                pb.Admission(
                    request_id="pd",
                    token_ids=_i32(prompt[::-1]),
                    page_hashes=hash_pages(prompt[::-1], PAGE)[:2],
                ),
                # Every page's hash packed into one field (as the client sends them).
                pb.Admission(
                    request_id="pk",
                    token_ids=_i32(prompt + 500),
                    packed_page_hashes=b"".join(hash_pages(prompt + 500, PAGE)),
                ),
            ],
            batch=pb.Batch(
                request_ids=["ek", "ph", "pd", "pk"],
                num_scheduled_tokens=_i32([40, 70, 70, 70]),
                num_computed_tokens=_i32([40, 70, 70, 70]),
            ),
        )

    def mutate(self, message: Message) -> str:
        """Change one field somewhere in ``message``; says which and how."""
        fields = [
            (path, node, field)
            for path, node in _message_nodes(message)
            for field in node.DESCRIPTOR.fields
            if field.type != FieldDescriptor.TYPE_MESSAGE
        ]
        path, owner, field = fields[int(self.rng.integers(len(fields)))]
        where = f"{path}{field.name}"
        pick = self.rng.integers
        if field.is_repeated:
            entries = getattr(owner, field.name)
            op = int(pick(3))
            if op == 0:
                del entries[:]
                return f"{where}: cleared"
            if op == 1 and len(entries):
                entries.append(entries[0])
                return f"{where}: first entry repeated"
            if field.type == FieldDescriptor.TYPE_STRING:
                value = ODD_STRINGS[int(pick(len(ODD_STRINGS)))]
                entries.append(value)
                return f"{where}: {value!r} appended"
            return f"{where}: unchanged"
        value: Any
        if field.type == FieldDescriptor.TYPE_BYTES:
            value = ODD_BYTES[int(pick(len(ODD_BYTES)))]
        elif field.type == FieldDescriptor.TYPE_STRING:
            value = ODD_STRINGS[int(pick(len(ODD_STRINGS)))]
        elif field.type == FieldDescriptor.TYPE_BOOL:
            value = bool(pick(2))
        elif field.type == FieldDescriptor.TYPE_ENUM:
            value = int(pick(5))
        elif field.type in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64):
            value = ODD_UINTS[int(pick(len(ODD_UINTS)))]
        elif field.type == FieldDescriptor.TYPE_UINT32:
            value = ODD_UINTS[int(pick(len(ODD_UINTS)))] % 2**32
        elif field.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
            value = [0.0, -1.0, 1e300, float("nan")][int(pick(4))]
        else:
            value = ODD_INTS[int(pick(len(ODD_INTS)))]
            if field.type == FieldDescriptor.TYPE_INT64 and pick(4) == 0:
                value = 2**62
        try:
            setattr(owner, field.name, value)
        except (TypeError, ValueError):  # out of the field's range: protobuf refuses it
            return f"{where}: unchanged"
        return f"{where} = {value!r}"[:120]

    def mutate_together(self, message: Message) -> str:
        """Set several number fields of one (sub-)message to the same odd value at once
        (each with probability 1/2; a growth column of the right length), the kind of
        change one field at a time almost never makes: a growth's num_new_tokens and
        num_lookahead_tokens both huge, say."""
        nodes = _message_nodes(message)
        path, node = nodes[int(self.rng.integers(len(nodes)))]
        value = ODD_INTS[int(self.rng.integers(len(ODD_INTS)))]
        count = len(node.request_ids) if isinstance(node, pb.GrowthColumns) else 0
        changed = []
        for field in node.DESCRIPTOR.fields:
            if field.is_repeated or not self.rng.integers(2):
                continue
            if field.type == FieldDescriptor.TYPE_INT32:
                setattr(node, field.name, value)
            elif count and field.type == FieldDescriptor.TYPE_BYTES:
                if field.name == "new_token_ids":
                    continue
                setattr(node, field.name, _i32([value] * count))
            else:
                continue
            changed.append(field.name)
        return f"{path or 'request'}: {changed} = {value!r}"

    def restore_running(self) -> None:
        """Back to the running set (an accepted mutation may have freed or added some)."""
        live = set(self.state.manager.request_ids())
        extra = sorted(live - set(RUNNING))
        missing = [r for r in RUNNING if r not in live]
        if extra or missing:
            self.apply(
                self.request(
                    free_request_ids=extra,
                    admissions=[
                        pb.Admission(request_id=r, token_ids=_i32(range(33))) for r in missing
                    ],
                )
            )


def _message_nodes(message: Message, path: str = "") -> list[tuple[str, Message]]:
    """``message`` and every sub-message it holds, with where each is."""
    out = [(path, message)]
    for field in message.DESCRIPTOR.fields:
        if field.type != FieldDescriptor.TYPE_MESSAGE:
            continue
        if field.is_repeated:
            for i, sub in enumerate(getattr(message, field.name)):
                out.extend(_message_nodes(sub, f"{path}{field.name}[{i}]."))
        elif message.HasField(field.name):
            out.extend(_message_nodes(getattr(message, field.name), f"{path}{field.name}."))
    return out


def run_field_fuzz(*, seed: int, rounds: int, hybrid: bool = False) -> dict[str, Any]:
    """``rounds`` x 4 mutated steps; returns the figures and every problem found (a
    description of the mutations and what went wrong), an empty list when none."""
    fuzz = FieldFuzz(seed, hybrid)
    accepted = refused = 0
    problems: list[str] = []
    for _ in range(rounds):
        for template in fuzz.templates():
            request = copy.deepcopy(template)
            if fuzz.rng.integers(3) == 0:
                changes = [fuzz.mutate_together(request)]
            else:
                changes = [fuzz.mutate(request) for _ in range(int(fuzz.rng.integers(1, 3)))]
            fuzz.step_id += 1
            request.step_id = fuzz.step_id
            before = state_digest(fuzz.state)
            try:
                fuzz.apply(request)
                accepted += 1
            except PagekeeperError:
                refused += 1
                if state_digest(fuzz.state) != before:
                    problems.append(f"{changes}: refused, but the state changed")
            except Exception as exc:  # what the servicer would answer INTERNAL
                last = traceback.extract_tb(exc.__traceback__)[-1]
                problems.append(
                    f"{changes}: {type(exc).__name__}: {exc} "
                    f"({last.filename.rsplit('/', 1)[-1]}:{last.lineno})"
                )
                if len(problems) >= 20:
                    break
        fuzz.restore_running()
    return {"steps": accepted + refused, "accepted": accepted, "refused": refused,
            "problems": problems}  # fmt: skip
