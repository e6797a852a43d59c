"""The bearer-token file format, read alike by the service (``--token-file``, every token
accepted) and its clients (``PAGEKEEPER_TOKEN_FILE``, the first one presented): one token
a line, blank lines and lines starting with ``#`` skipped, each token printable ASCII
without spaces (what an HTTP ``Authorization`` header and gRPC metadata carry unchanged)."""

from __future__ import annotations

MAX_BYTES = 1024 * 1024


def read_tokens(path: str) -> tuple[str, ...]:
    """The tokens ``path`` lists, in order, duplicates dropped; ValueError naming the file
    (and the line) when it cannot be read or is not a token file."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_BYTES:
        raise ValueError(f"{path} is over 1 MiB: not a token file")
    tokens: list[str] = []
    for number, raw in enumerate(data.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith(b"#"):
            continue
        if not all(0x21 <= c <= 0x7E for c in line):
            raise ValueError(
                f"{path} line {number}: a token must be printable ASCII without spaces"
            )
        tokens.append(line.decode("ascii"))
    if not tokens:
        raise ValueError(f"{path} lists no token (one a line; '#' starts a comment)")
    return tuple(dict.fromkeys(tokens))
