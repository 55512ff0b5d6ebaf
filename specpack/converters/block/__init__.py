"""Block drafters — DFlash, DSpark and LiLiCorr — in every published layout → one canonical drafter
(kind `block`; docs/format.md).

The package hands on the names of convert.py: `detect(path)`, `convert(path, target, ...)`, `LAYOUTS`."""

from __future__ import annotations

from specpack.converters.block.convert import FAMILIES, KIND, LAYOUTS, convert, detect

__all__ = ["FAMILIES", "KIND", "LAYOUTS", "convert", "detect"]
