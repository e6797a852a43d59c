"""Core fixtures: ``pool_loops`` runs a test once with the page pool's C loops (where they
are built) and once with its Python loops, for the modules that ask for it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pagekeeper.core import pool as pool_module

POOL_LOOPS = ["python"] + (["native"] if pool_module.native_pool() else [])


@pytest.fixture(params=POOL_LOOPS)
def pool_loops(request: pytest.FixtureRequest) -> Iterator[str]:
    """Pools made during the test run the given loops (``PagePool`` reads the module's
    accelerator when it is made)."""
    saved = pool_module._ops
    if request.param == "python":
        pool_module._ops = None
    try:
        yield request.param
    finally:
        pool_module._ops = saved
