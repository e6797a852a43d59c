"""``ExtraKeys`` into its protobuf message: one converter for the client (admissions,
lookups) and the service (stored events), whose ExtraKeys classes have the same fields.
Light on purpose (only the generated messages): the service imports it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pagekeeper_client._proto.pagekeeper.v1 import pagekeeper_pb2 as pb


class _MultiModalLike(Protocol):
    @property
    def identifier(self) -> str: ...
    @property
    def offset(self) -> int: ...
    @property
    def length(self) -> int: ...


class ExtraKeysLike(Protocol):
    """What the converter reads: the client's and the core's ``ExtraKeys`` alike."""

    @property
    def lora_name(self) -> str | None: ...
    @property
    def lora_path(self) -> str | None: ...
    @property
    def mm_inputs(self) -> Sequence[_MultiModalLike]: ...
    @property
    def cache_salt(self) -> str | None: ...


def extra_keys_to_pb(extra: ExtraKeysLike) -> pb.ExtraKeys:
    msg = pb.ExtraKeys(
        mm_inputs=[
            pb.MultiModalKey(identifier=m.identifier, offset=m.offset, length=m.length)
            for m in extra.mm_inputs
        ]
    )
    if extra.lora_name is not None:
        msg.lora_name = extra.lora_name
    if extra.lora_path is not None:
        msg.lora_path = extra.lora_path
    if extra.cache_salt is not None:
        msg.cache_salt = extra.cache_salt
    return msg
