"""Converters: one module per source family, sharing the verbs `detect` and `convert`/`load`.

- `target_hf`: Hugging Face target directories (configs and headers only)
- `eagle3`: EAGLE-3 heads (official, SGLang/SpecForge, ModelOpt layouts)
- `block`: block drafters — DFlash, DSpark, LiLiCorr — in every published layout (→ kind `block`)
- `speculators`: EAGLE-3 heads in the vLLM speculators layout (→ the same canonical head)
- `mtp`: MTP layers (DeepSeek-V3/GLM, Qwen3-Next, MiMo), in the target or a separate head dir
- `release_dspark`: DSpark drafters as releases ship them (DeepSeek-V4's stages in its weights, MiniMax-M3.1's
  `dspark/` folder), in their engine's own architecture
- `draft_model`: a separate small causal LM sharing the target's tokenizer
- `ngram`: prompt-lookup drafters (parameters only)
"""

from __future__ import annotations

from pathlib import Path

from specpack.converters import block, draft_model, eagle3, mtp, ngram, release_dspark, speculators
from specpack.errors import InputError, UnsupportedError

# family -> module, in detection order (the first whose `detect` names a layout wins); block drafters
# first: they hold `fc` and `layers.0.*` like a ModelOpt EAGLE-3 head, and speculators configs of them
DRAFTER_FAMILIES = {"release_dspark": release_dspark, "block": block, "speculators": speculators, "eagle3": eagle3,
                    "mtp": mtp, "draft_model": draft_model}


def detect_drafter(spec: str) -> tuple[str, str]:
    """(family, layout) of the drafter named by `spec`: 'ngram', 'mtp' (the target's own MTP
    layers), 'dspark-stages' (its own DSpark stages) or a directory. `family` is a key of
    DRAFTER_FAMILIES or 'ngram'."""
    if ngram.detect(spec):
        return "ngram", "ngram"
    if str(spec) == "mtp":
        return "mtp", mtp.IN_TARGET
    if str(spec) == release_dspark.SPEC:
        return release_dspark.KIND, release_dspark.deepseek_v4.LAYOUT
    path = Path(spec)
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_drafter(path)
    if not path.is_dir():
        raise InputError(f"drafter '{spec}' is neither 'ngram', 'mtp', '{release_dspark.SPEC}' nor a directory",
                         hint="pass a drafter directory (config.json + weights), 'mtp', 'ngram' or 'bundled'")
    for family, module in DRAFTER_FAMILIES.items():
        layout = module.detect(path)
        if layout:
            return family, layout
    raise InputError(f"'{spec}' is not a drafter in any known layout",
                     hint="supported: EAGLE-3 heads (" + ", ".join(eagle3.LAYOUTS) + "), block drafters (" +
                          ", ".join(block.LAYOUTS) + "), MTP heads (" + ", ".join(mtp.LAYOUTS) +
                          "), MiniMax-M3.1's dspark/, draft models (Hugging Face causal LMs), 'mtp', 'dspark-stages' and "
                          "'ngram'")


def _gguf_drafter(path: Path) -> tuple[str, str]:
    """A llama.cpp drafter GGUF: EAGLE-3, DFlash and DSpark are read; another architecture is refused,
    naming it."""
    from specpack.converters import eagle3_gguf

    layout = eagle3_gguf.detect(path)
    if layout is not None:
        return "eagle3", layout
    layout = block.detect(path)
    if layout is not None:
        return "block", layout
    from specpack.converters.gguf import NEXTN_LAYOUT, gguf_architecture, has_nextn, open_gguf

    if has_nextn(path):
        return "mtp", NEXTN_LAYOUT
    arch = gguf_architecture(open_gguf(path))
    raise UnsupportedError(f"'{path}' is a llama.cpp '{arch}' GGUF, not a drafter GGUF specpack reads",
                           hint="llama.cpp drafter GGUFs of general.architecture eagle3 and dflash (DFlash, DSpark) "
                                "are read, and a deepseek2 GGUF's nextn block (an MTP head); a target GGUF goes "
                                "through `specpack import-gguf`")
