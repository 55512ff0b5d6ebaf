"""Converters: one module per source family, sharing the verbs `detect` and `convert`/`load`.

- `target_hf`: Hugging Face target directories (configs and headers only)
- `eagle3`: EAGLE-3 heads (official, SGLang/SpecForge, ModelOpt layouts)
- `ngram`: prompt-lookup drafters (parameters only)
"""

from __future__ import annotations

from pathlib import Path

from specpack.converters import eagle3, ngram
from specpack.errors import InputError

DRAFTER_FAMILIES = {"eagle3": eagle3}


def detect_drafter(spec: str) -> tuple[str, str]:
    """(kind, layout) of the drafter named by `spec`: 'ngram' or a directory."""
    if ngram.detect(spec):
        return "ngram", "ngram"
    path = Path(spec)
    if not path.is_dir():
        raise InputError(f"drafter '{spec}' is neither 'ngram' nor a directory",
                         hint="pass a drafter directory (config.json + weights) or 'ngram'")
    for kind, module in DRAFTER_FAMILIES.items():
        layout = module.detect(path)
        if layout:
            return kind, layout
    raise InputError(f"'{spec}' is not a drafter in any known layout",
                     hint="supported: EAGLE-3 heads (" + ", ".join(eagle3.LAYOUTS) + ") and 'ngram'")
