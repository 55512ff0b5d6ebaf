"""Export an artifact's drafter in the form a distributed serving engine loads.

The package hands on the names of writer.py."""

from __future__ import annotations

from specpack.exports.writer import (
    ENGINES, export_engine, check_tensor_parallel, engine_limits)

__all__ = ["ENGINES", "export_engine", "check_tensor_parallel", "engine_limits"]
