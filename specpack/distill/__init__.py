"""`distill`: train a head for a target that has none, on the target's own outputs.

The package hands on the names of pipeline.py."""

from __future__ import annotations

from specpack.distill.pipeline import (
    distill, DistillResult)

__all__ = ["distill", "DistillResult"]
