"""DSpark drafters as releases ship them, in their engine's own architecture (kind `release_dspark`):
checked tensor by tensor, bound to the target, run by engines (specpack's runtime does not decode
these targets). One module per layout:

- `deepseek_v4`: DeepSeek-V4 / V4-Pro / V4.1's stages inside the target's weights (layout B), bound in place
  by `--drafter dspark-stages` (what `--drafter bundled` picks);
- `minimax_m31`: MiniMax-M3.1's `dspark/` folder (layout C, DSparkMiniMaxDraftModel), carried once.

    detect(path)            -> the layout of a drafter folder, or None
    convert(path, target)   -> ConvertedDrafter  (a folder: layout C)
    convert_in_target(target), problems(target)  (layout B: deepseek_v4)
"""

from __future__ import annotations

from specpack.converters.release_dspark import deepseek_v4, minimax_m31
from specpack.converters.release_dspark.common import KIND
from specpack.converters.release_dspark.deepseek_v4 import SPEC, convert_in_target, problems
from specpack.converters.release_dspark.minimax_m31 import convert, detect

LAYOUTS = (*deepseek_v4.LAYOUTS, minimax_m31.LAYOUT)

__all__ = ["KIND", "LAYOUTS", "SPEC", "convert", "convert_in_target", "detect", "problems"]
