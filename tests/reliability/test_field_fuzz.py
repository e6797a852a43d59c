"""A short run of the field-level Step fuzz (``make fuzz`` runs a longer one)."""

from __future__ import annotations

import pytest

from tests.reliability.field_fuzz import run_field_fuzz


@pytest.mark.parametrize("hybrid", [False, True], ids=["full", "hybrid"])
def test_mutated_step_fields_are_refused_cleanly_or_applied_whole(hybrid):
    # Seed 11 found the computed-past-max_model_len growth on both pools (29e6948).
    figures = run_field_fuzz(seed=11, rounds=60, hybrid=hybrid)
    assert figures["problems"] == []
    # The mutations reach the checks (most are refused) and some steps stay valid.
    assert figures["refused"] > figures["steps"] // 2 and figures["accepted"] > 20
