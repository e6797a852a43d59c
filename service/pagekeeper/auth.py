"""Bearer tokens: the credentials gRPC calls, same-node socket connections and HTTP admin
endpoints present, given inline (``token``) or in a file (``token_file``).

A token file holds one token per line (blank lines and lines starting with ``#`` are
skipped); every token listed is accepted. That is how a token is rotated without a
restart or a window of refused calls: add the new token as a second line, move the
clients to it, then delete the old line. The service re-reads a changed file every
:data:`pagekeeper.tls.RELOAD_INTERVAL_S` and at once on ``SIGHUP``; a file that no longer
loads (missing, empty, a malformed line) leaves the tokens in force unchanged and is
reported once per change. Every gRPC call is checked against the tokens in force when it
arrives; a same-node socket connection, which presents its token once in its hello, is
checked again on its next call after a reload and closed if its token was removed.

Tokens in a file are printable ASCII without spaces (what an HTTP ``Authorization``
header and gRPC metadata carry unchanged). Token values are never logged or shown.
"""

from __future__ import annotations

import hmac
import logging
import os
import stat
from dataclasses import dataclass

from pagekeeper.core.errors import ConfigError
from pagekeeper.files import FileStamp, file_stamp
from pagekeeper.settings import Settings
from pagekeeper_client.token_file import read_tokens

log = logging.getLogger("pagekeeper")


def read_token_file(path: str, field: str) -> tuple[str, ...]:
    """The tokens listed in ``path`` (:mod:`pagekeeper_client.token_file`'s format), or
    ConfigError naming ``field``."""
    try:
        return read_tokens(path)
    except ValueError as exc:
        raise ConfigError(field, str(exc)) from None


class BearerTokens:
    """The tokens accepted for one purpose, fixed or followed from a file.

    ``generation`` changes whenever the accepted set does, so a holder of a token checked
    earlier (a socket connection) knows when to check it again."""

    def __init__(
        self,
        tokens: tuple[str, ...],
        path: str | None = None,
        field: str = "",
        stamp: FileStamp | None = None,
    ) -> None:
        if not tokens:
            raise ValueError("BearerTokens needs at least one token")
        self.path = path
        self.field = field
        self._set(tokens)
        self.generation = 0
        self.num_reloads = 0
        self._stamp = stamp  # the file's when it was read (taken before the read)
        self._failed_stamp: FileStamp | None = None

    @classmethod
    def from_file(cls, path: str, field: str) -> BearerTokens:
        stamp = file_stamp(path)
        tokens = read_token_file(path, field)
        _warn_if_readable_by_others(path)
        return cls(tokens, path, field, stamp)

    def _set(self, tokens: tuple[str, ...]) -> None:
        self._tokens = tuple(t.encode() for t in tokens)
        self._headers = tuple(b"Bearer " + t for t in self._tokens)

    @property
    def count(self) -> int:
        return len(self._tokens)

    @property
    def first(self) -> str:
        """The first token listed (what the service's own probe presents)."""
        return self._tokens[0].decode()

    def accepts(self, given: bytes) -> bool:
        """Whether ``given`` is one of the tokens (each compared in constant time)."""
        ok = False
        for token in self._tokens:
            ok |= hmac.compare_digest(given, token)
        return ok

    def accepts_header(self, given: bytes) -> bool:
        """Whether ``given`` is ``Bearer <one of the tokens>``."""
        ok = False
        for header in self._headers:
            ok |= hmac.compare_digest(given, header)
        return ok

    def reload_if_changed(self, *, force: bool = False) -> bool:
        """Re-read the file if it changed since it was read (``force``: whether or not it
        seems to: SIGHUP); True when the accepted tokens changed. Raises ConfigError (the
        tokens in force stay) when the file does not load, once per change unless forced.
        Fixed tokens never change."""
        if self.path is None:
            return False
        stamp = file_stamp(self.path)
        unchanged = stamp == self._stamp or (stamp is not None and stamp == self._failed_stamp)
        if unchanged and not force:
            return False
        try:
            tokens = read_token_file(self.path, self.field)
        except ConfigError:
            # A missing file has no stamp: reported once until it comes back.
            self._failed_stamp = stamp
            if stamp is None:
                self._stamp = None
            raise
        self._stamp = stamp
        self._failed_stamp = None
        before = self._tokens
        self._set(tokens)
        if self._tokens == before:
            return False
        _warn_if_readable_by_others(self.path)
        self.generation += 1
        self.num_reloads += 1
        return True


class PresentedToken:
    """A token accepted once, where it is not presented again (a same-node socket
    connection's hello, a stream's opening call): :meth:`is_revoked` says whether it has
    since been removed. It looks again only when the accepted tokens changed, so a call
    pays one int compare."""

    __slots__ = ("generation", "token", "tokens")

    def __init__(self, tokens: BearerTokens, token: bytes) -> None:
        self.tokens = tokens
        self.token = token
        self.generation = tokens.generation

    def is_revoked(self) -> bool:
        tokens = self.tokens
        if tokens.generation == self.generation:
            return False
        self.generation = tokens.generation
        return not tokens.accepts(self.token)


def _warn_if_readable_by_others(path: str) -> None:
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        log.warning(
            "token file %s is readable by its group or others (mode %o); prefer 0400 or 0600",
            path,
            stat.S_IMODE(mode),
        )


@dataclass(eq=False)
class ServerTokens:
    """The service's credentials: ``calls`` guards gRPC and the same-node socket, ``admin``
    the HTTP admin endpoints (the same object as ``calls`` unless an admin token is set)."""

    calls: BearerTokens | None
    admin: BearerTokens | None

    def holders(self) -> tuple[BearerTokens, ...]:
        """Each distinct file-backed holder, for the reload task."""
        out: list[BearerTokens] = []
        for holder in (self.calls, self.admin):
            if holder is not None and holder.path is not None and holder not in out:
                out.append(holder)
        return tuple(out)


def _holder(value: str | None, path: str | None, field: str) -> BearerTokens | None:
    if path is not None:
        return BearerTokens.from_file(path, field)
    if value is not None:
        return BearerTokens((value,))
    return None


def load_server_tokens(settings: Settings) -> ServerTokens:
    """The tokens ``settings`` names, files read and checked (raises ConfigError)."""
    calls = _holder(settings.token, settings.token_file, "server.token_file")
    if settings.admin_token_file is not None and settings.admin_token_file == settings.token_file:
        return ServerTokens(calls=calls, admin=calls)  # one file: one holder, one reload
    admin = _holder(settings.admin_token, settings.admin_token_file, "server.admin_token_file")
    return ServerTokens(calls=calls, admin=admin if admin is not None else calls)


def first_token(settings: Settings) -> str | None:
    """The token a client of this configuration presents (the first in a token file)."""
    if settings.token_file is not None:
        return read_token_file(settings.token_file, "server.token_file")[0]
    return settings.token


__all__ = [
    "BearerTokens",
    "PresentedToken",
    "ServerTokens",
    "first_token",
    "load_server_tokens",
    "read_token_file",
]
