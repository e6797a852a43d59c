"""Reading and editing a data dir's journal segments the way damage or an older version
would leave them (tests only: the service goes through :class:`CommandLog`)."""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterable, Iterator
from pathlib import Path

from pagekeeper.durability.log import (
    _RECORD_HEADER,
    _SEGMENT_FILE,
    _SEGMENT_HEADER,
    _SEGMENT_MAGIC,
    DB_NAME,
    JOURNAL_DIR,
    CommandLog,
    record_crc,
)

Record = tuple[int, int, bytes]
"""(seq, crc, body)"""


def segment_paths(data_dir: Path) -> list[Path]:
    return sorted((Path(data_dir) / JOURNAL_DIR).glob("segment-*.pkj"))


def first_seq(path: Path) -> int:
    """The seq a segment's name says it starts at."""
    match = _SEGMENT_FILE.fullmatch(path.name)
    assert match is not None, f"{path} is not a journal segment"
    return int(match.group(1))


def _segment_records(path: Path) -> Iterator[tuple[int, int, int, memoryview]]:
    """``(offset, seq, crc, body)`` of each record of one segment, as the log reads them."""
    return CommandLog._segment_records(first_seq(path), path)


def _read(path: Path) -> list[Record]:
    return [(seq, crc, bytes(body)) for _, seq, crc, body in _segment_records(path)]


def _write(path: Path, first: int, records: list[Record]) -> None:
    out = [_SEGMENT_HEADER.pack(_SEGMENT_MAGIC, first)]
    for seq, crc, body in records:
        out += [_RECORD_HEADER.pack(len(body), crc, seq), body]
    path.write_bytes(b"".join(out))


def record_offsets(path: Path) -> list[int]:
    """Where each record of one segment starts (its header)."""
    return [offset for offset, _, _, _ in _segment_records(path)]


def records(data_dir: Path) -> list[Record]:
    """Every record of every segment, in order."""
    return [r for path in segment_paths(data_dir) for r in _read(path)]


def edit_record(
    data_dir: Path,
    seq: int,
    *,
    body: bytes | None = None,
    crc: int | None = None,
    new_seq: int | None = None,
    drop: bool = False,
) -> None:
    """Replace record ``seq``'s body, CRC and/or seq field as stored (no CRC recomputed),
    or drop it."""
    for path in segment_paths(data_dir):
        found = _read(path)
        if any(s == seq for s, _, _ in found):
            edited = []
            for s, c, b in found:
                if s == seq:
                    if drop:
                        continue
                    s = s if new_seq is None else new_seq
                    c, b = c if crc is None else crc, b if body is None else body
                edited.append((s, c, b))
            _write(path, first_seq(path), edited)
            return
    raise KeyError(f"no record {seq} in {data_dir}")


def cut_inside(data_dir: Path, seq: int) -> None:
    """Cut record ``seq``'s segment in the middle of that record (a torn write): it and
    everything after it in the file are gone."""
    for path in segment_paths(data_dir):
        for offset, s, _, body in _segment_records(path):
            if s == seq:
                os.truncate(path, offset + _RECORD_HEADER.size + len(body) // 2)
                return
    raise KeyError(f"no record {seq} in {data_dir}")


def insert_rows(db: sqlite3.Connection, rows: Iterable[Record]) -> None:
    """Records as format 2 kept them: rows of table ``log``."""
    db.executemany("INSERT INTO log (seq, crc, body) VALUES (?, ?, ?)", rows)


def to_format_2(data_dir: Path) -> None:
    """Move every segment record into table ``log`` and drop the segments, as format 2
    kept them."""
    moved = records(data_dir)
    db = sqlite3.connect(Path(data_dir) / DB_NAME)
    insert_rows(db, moved)
    db.execute("UPDATE meta SET value = '2' WHERE key = 'format_version'")
    db.commit()
    db.close()
    for path in segment_paths(data_dir):
        path.unlink()


def lose_the_disk(log: CommandLog) -> None:
    """Every later write of ``log`` fails, as on a disk gone away: the segment being
    appended to is swapped for a read-only descriptor and the database is closed."""
    assert log._segment_fd is not None, "no segment open yet: append a record first"
    readonly = os.open(os.devnull, os.O_RDONLY)
    os.dup2(readonly, log._segment_fd)
    os.close(readonly)
    log._db.close()


__all__ = [
    "Record",
    "cut_inside",
    "edit_record",
    "first_seq",
    "insert_rows",
    "lose_the_disk",
    "record_crc",
    "record_offsets",
    "records",
    "segment_paths",
    "to_format_2",
]
