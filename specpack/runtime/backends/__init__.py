"""Backends: where the target (and drafter) of a loaded artifact run. A plain dict registry.

The package hands on the names of common.py."""

from __future__ import annotations

from specpack.runtime.backends.common import (
    get, load, SlotCache, SharedCaches, cache_layout, new_slot_names, plan_calls, batch_layout, GraphTarget,
    chunks, GraphEagle3, GraphMtp, eagle3_files, mtp_files)

__all__ = ["get", "load", "SlotCache", "SharedCaches", "cache_layout", "new_slot_names", "plan_calls",
           "batch_layout", "GraphTarget", "chunks", "GraphEagle3", "GraphMtp", "eagle3_files", "mtp_files"]
