"""Kill -9 the real service under load several times (see service_crash.py)."""

from __future__ import annotations

from tests.reliability.service_crash import run_service_crashes


def test_service_survives_kill9_under_load(tmp_path):
    result = run_service_crashes(tmp_path / "svc", crashes=3, seed=1)
    assert result.crashes == 3
    assert result.acked_steps > 30 and result.attention_steps > 20
    assert result.requests_checked > 0
