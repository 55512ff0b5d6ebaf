"""Converters: one module per source family, sharing the verbs `detect` and `convert`/`load`.

The package hands on the names of detect.py."""

from __future__ import annotations

from specpack.converters.detect import (
    DRAFTER_FAMILIES, detect_drafter)

__all__ = ["DRAFTER_FAMILIES",
           "detect_drafter"]
