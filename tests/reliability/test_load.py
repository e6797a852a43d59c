"""Several schedulers and workers at once for a bounded time (see load.py): no page, memory
or file-descriptor leak, latency percentiles recorded."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from tests.reliability.load import run_load

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts" / "reliability"


def test_load_leaks_nothing(tmp_path):
    result = run_load(tmp_path / "load", duration=6.0, num_schedulers=3, num_workers=2)
    assert result.errors == []
    assert result.steps > 100 and result.table_reads > 10
    assert result.steps_over_local_socket > 30  # scheduler 1 of 3 steps over the socket
    pages = result.pages_after
    assert pages["num_used_pages"] == 0
    assert pages["num_free_pages"] == pages["num_pages"] - 1
    assert result.rss_end_mb - result.rss_start_mb < 40, result
    assert result.fds_end <= result.fds_start + 4, result
    pauses = result.server_pauses  # the service watched its loop and its collections
    assert pauses["loop_lag_count"] >= 50, pauses  # ~20 a second
    assert pauses["gc0_count"] >= 1, pauses
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "load.json").write_text(
        json.dumps(
            {**dataclasses.asdict(result), "steps_per_second": result.steps_per_second},
            indent=2,
        )
    )
