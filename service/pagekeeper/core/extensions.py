"""The optional C extensions of the core (``_native``: page hashing; ``_poolops``: the page
pool's per-page loops). Each is built with the package where its toolchain is
(``setup.py`` marks them optional) and gives the same results as the Python code it
replaces; an environment switch set to ``0`` keeps the Python code (a comparison, a
suspicion)."""

from __future__ import annotations

import importlib
import os
from types import ModuleType


def load_extension(name: str, switch: str) -> ModuleType | None:
    """``pagekeeper.core.<name>``, or None when it is not built or ``switch`` is ``0``."""
    if os.environ.get(switch, "1") == "0":
        return None
    try:
        return importlib.import_module(f"pagekeeper.core.{name}")
    except ImportError:
        return None
