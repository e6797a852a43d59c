"""Durable state: every mutation is in the command log before it is acknowledged, and a
restart (latest snapshot + replay of the log) gives back the same state, page for page.

=================  ======================================================================
``values``         the safe binary encoding of value trees (records, snapshots)
``commands``       commands <-> log record bodies
``log``            journal segments (records with CRCs), snapshot files and their SQLite
                   registrations, durability levels
``snapshot``       snapshot bytes, the state digest
``recovery``       :class:`Durability`: open/lock a data dir, recover, journal, snapshot
=================  ======================================================================
"""

from __future__ import annotations

from pagekeeper.durability.log import DurabilityLevel
from pagekeeper.durability.recovery import (
    Durability,
    DurabilityError,
    DurabilityStats,
    RecoveryReport,
)
from pagekeeper.durability.snapshot import state_digest

__all__ = [
    "Durability",
    "DurabilityError",
    "DurabilityLevel",
    "DurabilityStats",
    "RecoveryReport",
    "state_digest",
]
