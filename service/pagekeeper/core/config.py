"""Pool configuration: the page pool and its KV-cache groups.

All groups draw pages from one shared pool (every page has the same bytes, as in vLLM's
hybrid allocator); each group has its own page size in tokens and its own table layout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, TypeGuard

from pagekeeper.core.errors import ConfigError

HASH_ALGORITHMS = ("sha256_cbor", "xxhash_cbor")


class GroupKind(str, Enum):
    """How a KV-cache group lays out a request's pages."""

    FULL = "full"
    """Full attention: one page per ``page_size`` tokens, all kept."""
    SLIDING_WINDOW = "sliding_window"
    """Sliding window of ``window`` tokens: pages that fall out become the null page."""
    CHUNKED_LOCAL = "chunked_local"
    """Chunked local attention (``chunk`` tokens): pages before the current chunk are null."""
    MAMBA = "mamba"
    """State space: one live state page per request (plus per-page cached states when
    ``enable_state_caching``)."""


def _is_int(value: object) -> TypeGuard[int]:
    """An int, and not a bool (``True`` is an int to Python, not a size to anyone)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_switch(field: str, value: object) -> None:
    """Refuse (naming ``field``) a setting that must be a boolean and is not."""
    # A TOML string such as "false" is truthy: a switch takes true or false only.
    if not isinstance(value, bool):
        raise ConfigError(field, f"must be true or false, got {value!r}")


@dataclass(frozen=True, slots=True)
class GroupConfig:
    """One KV-cache group: layers that share a table layout."""

    kind: GroupKind = GroupKind.FULL
    page_size: int = 16
    window: int | None = None
    chunk: int | None = None
    enable_state_caching: bool = False
    name: str = ""

    def validate(self, where: str) -> None:
        if not isinstance(self.kind, GroupKind):
            raise ConfigError(f"{where}.kind", f"unknown kind {self.kind!r}")
        if not _is_int(self.page_size) or self.page_size < 1:
            raise ConfigError(
                f"{where}.page_size", f"must be a positive int, got {self.page_size!r}"
            )
        if self.kind is GroupKind.SLIDING_WINDOW:
            if not _is_int(self.window) or self.window < 1:
                raise ConfigError(f"{where}.window", f"must be an int >= 1, got {self.window!r}")
        elif self.window is not None:
            raise ConfigError(f"{where}.window", "only a sliding_window group has a window")
        if self.kind is GroupKind.CHUNKED_LOCAL:
            if not _is_int(self.chunk) or self.chunk < 1:
                raise ConfigError(f"{where}.chunk", f"must be an int >= 1, got {self.chunk!r}")
            if self.chunk % self.page_size != 0:
                raise ConfigError(
                    f"{where}.chunk",
                    f"must be a multiple of page_size {self.page_size}, got {self.chunk}",
                )
        elif self.chunk is not None:
            raise ConfigError(f"{where}.chunk", "only a chunked_local group has a chunk")
        check_switch(f"{where}.enable_state_caching", self.enable_state_caching)
        if not isinstance(self.name, str):
            raise ConfigError(f"{where}.name", f"must be a string, got {self.name!r}")
        if self.enable_state_caching and self.kind is not GroupKind.MAMBA:
            raise ConfigError(f"{where}.enable_state_caching", "only a mamba group caches states")

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "page_size": self.page_size,
            "window": self.window,
            "chunk": self.chunk,
            "enable_state_caching": self.enable_state_caching,
            "name": self.name,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "groups[0]") -> GroupConfig:
        unknown = set(data) - {
            "kind",
            "page_size",
            "window",
            "chunk",
            "enable_state_caching",
            "name",
        }
        if unknown:
            raise ConfigError(f"{where}.{sorted(unknown)[0]}", "unknown field")
        try:
            kind = GroupKind(data.get("kind", "full"))
        except ValueError:
            raise ConfigError(
                f"{where}.kind",
                f"unknown kind {data.get('kind')!r}; one of {[k.value for k in GroupKind]}",
            ) from None
        group = cls(
            kind=kind,
            page_size=data.get("page_size", 16),
            window=data.get("window"),
            chunk=data.get("chunk"),
            enable_state_caching=data.get("enable_state_caching", False),
            name=data.get("name", ""),
        )
        group.validate(where)
        return group


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """The whole pool. ``num_pages`` includes the null page (page 0)."""

    num_pages: int = 4096
    groups: tuple[GroupConfig, ...] = field(default_factory=lambda: (GroupConfig(),))
    enable_prefix_caching: bool = True
    hash_algorithm: str = "sha256_cbor"
    max_model_len: int = 8192

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not _is_int(self.num_pages) or self.num_pages < 2:
            raise ConfigError(
                "num_pages",
                f"must be an int >= 2 (page 0 is the null page), got {self.num_pages!r}",
            )
        check_switch("enable_prefix_caching", self.enable_prefix_caching)
        if self.num_pages >= 2**31 - 1:
            raise ConfigError("num_pages", "must fit in int32")
        if not isinstance(self.groups, tuple) or not self.groups:
            raise ConfigError("groups", "at least one KV-cache group is required")
        if len(self.groups) > 254:
            raise ConfigError("groups", "at most 254 KV-cache groups")
        for i, group in enumerate(self.groups):
            if not isinstance(group, GroupConfig):
                raise ConfigError(f"groups[{i}]", "must be a GroupConfig")
            group.validate(f"groups[{i}]")
        if self.hash_algorithm not in HASH_ALGORITHMS:
            raise ConfigError(
                "hash_algorithm", f"unknown {self.hash_algorithm!r}; one of {list(HASH_ALGORITHMS)}"
            )
        if not _is_int(self.max_model_len) or self.max_model_len < 1:
            raise ConfigError(
                "max_model_len", f"must be a positive int, got {self.max_model_len!r}"
            )
        # Several groups share one chain of page hashes computed at the smallest page size;
        # a larger page is named by the last small-page hash it covers (as vLLM does).
        hash_page_size = min(g.page_size for g in self.groups)
        for i, group in enumerate(self.groups):
            if group.page_size % hash_page_size != 0:
                raise ConfigError(
                    f"groups[{i}].page_size",
                    f"must be a multiple of the smallest page size {hash_page_size}",
                )
        # Each group must be able to hold at least one request of one page plus the null page.
        if self.num_pages < 1 + len(self.groups):
            raise ConfigError(
                "num_pages",
                f"too few pages: {self.num_pages} cannot give each of "
                f"{len(self.groups)} groups one page",
            )

    @property
    def hash_page_size(self) -> int:
        return min(g.page_size for g in self.groups)

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_pages": self.num_pages,
            "groups": [g.to_dict() for g in self.groups],
            "enable_prefix_caching": self.enable_prefix_caching,
            "hash_algorithm": self.hash_algorithm,
            "max_model_len": self.max_model_len,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PoolConfig:
        unknown = set(data) - {
            "num_pages",
            "groups",
            "enable_prefix_caching",
            "hash_algorithm",
            "max_model_len",
        }
        if unknown:
            raise ConfigError(sorted(unknown)[0], "unknown field")
        raw_groups: Sequence[Mapping[str, Any]] = data.get("groups") or [{}]
        if not isinstance(raw_groups, (list, tuple)):
            raise ConfigError("groups", "must be a list of tables")
        groups = tuple(GroupConfig.from_dict(g, f"groups[{i}]") for i, g in enumerate(raw_groups))
        return cls(
            num_pages=data.get("num_pages", 4096),
            groups=groups,
            enable_prefix_caching=data.get("enable_prefix_caching", True),
            hash_algorithm=data.get("hash_algorithm", "sha256_cbor"),
            max_model_len=data.get("max_model_len", 8192),
        )
