"""The drafters, one module per kind, and their registry (see base.py for what each implements).

The package hands on the names of registry.py."""

from __future__ import annotations

from specpack.runtime.drafters.registry import (
    DRAFTERS, load_drafter)

__all__ = ["DRAFTERS", "load_drafter"]
