"""How many examples the property tests draw.

Each test names the count ``make test`` affords; ``PAGEKEEPER_PROPERTY_SCALE`` multiplies
every one (``make props`` runs the property tests with it raised, as a longer campaign).
Tests that name no count get Hypothesis's 100, scaled alike (the profile in conftest).
"""

from __future__ import annotations

import os


def _scale() -> float:
    raw = os.environ.get("PAGEKEEPER_PROPERTY_SCALE", "1")
    try:
        value = float(raw)
    except ValueError:
        raise SystemExit(f"PAGEKEEPER_PROPERTY_SCALE must be a number, got {raw!r}") from None
    if not value > 0:
        raise SystemExit(f"PAGEKEEPER_PROPERTY_SCALE must be > 0, got {raw!r}")
    return value


SCALE = _scale()


def examples(count: int) -> int:
    """``count`` examples times the scale (at least one)."""
    return max(1, round(count * SCALE))
