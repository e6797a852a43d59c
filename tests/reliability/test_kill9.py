"""``kill -9`` a process writing the durable state, at random points, several times on one
data directory; recover and compare with a twin that never crashed (see kill9.py)."""

from __future__ import annotations

import pytest

from tests.reliability.kill9 import run_campaign


@pytest.mark.parametrize(
    ("pool", "level", "seed"), [("full", "process", 1), ("hybrid", "fsync", 2)]
)
def test_kill9_loses_no_acknowledged_record(tmp_path, pool, level, seed):
    result = run_campaign(tmp_path, seed=seed, crashes=4, pool=pool, level=level, max_acks=150)
    assert result.crashes == 4
    assert result.lost_acked == 0, result.rounds
    assert result.records > 0


def test_a_torn_journal_and_wal_recover_a_consistent_prefix(tmp_path):
    """Power loss without fsync may cut the newest journal segment and the WAL anywhere:
    what survives is a prefix, and the state is exactly the twin's at that prefix."""
    result = run_campaign(tmp_path, seed=3, crashes=3, tear_every=1, max_acks=120)
    assert result.torn >= 1 and result.crashes == 3
