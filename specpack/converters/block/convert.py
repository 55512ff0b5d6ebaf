"""Block drafters — DFlash, DSpark and LiLiCorr — in every published layout → one canonical drafter
(kind `block`; docs/format.md).

    detect(path)  -> the layout name, or None
    convert(path, target, aux=None, block=None, source=None, allow_mismatch=False) -> ConvertedDrafter

One module per source family (dflash, dspark, lilicorr), each with `LAYOUTS`, `detect(config, names)`
and `read(layout, path, config, tensors, target) -> Reading`; `canonical.build` settles and checks
the bindings for all of them. Detection order matters: a LiLiCorr or DSpark checkpoint may declare
`DFlashDraftModel`, so those families look first.
"""

from __future__ import annotations

from pathlib import Path

from specpack.converters.base import AuxOverride, BlockOverrides, ConvertedDrafter
from specpack.converters.block import dflash, dspark, lilicorr, llamacpp
from specpack.converters.block.canonical import build
from specpack.converters.block.common import (has_weights, load_mask_embedding, load_tensors, read_config,
                                              source_of, tensor_names)
from specpack.converters.target_hf import Target
from specpack.errors import InputError
from specpack.schemas import BLOCK_LAYOUTS, Source

KIND = "block"
FAMILIES = (lilicorr, dspark, dflash)
LAYOUTS = BLOCK_LAYOUTS


def detect(path: Path) -> str | None:
    """The layout name of the block drafter at `path`, or None when it is not one."""
    path = Path(path)
    if path.suffix == ".gguf":
        return llamacpp.detect(path)
    if not (path / "config.json").is_file() or not has_weights(path):
        return None
    config, names = read_config(path), tensor_names(path)
    return next((layout for family in FAMILIES if (layout := family.detect(config, names))), None)


def convert(path: Path, target: Target, aux: AuxOverride | None = None, block: BlockOverrides | None = None,
            source: Source | None = None, allow_mismatch: bool = False) -> ConvertedDrafter:
    """Read the block drafter at `path`, settle and check its bindings against `target`, canonicalise it."""
    path = Path(path)
    if path.suffix == ".gguf":  # llama.cpp's DFlash / DSpark drafter GGUF
        return build(llamacpp.read(path), target, aux, block, source_of(path, source), allow_mismatch)
    config, tensors = read_config(path), _mx_scale_names(read_config(path), load_tensors(path))
    for family in FAMILIES:
        layout = family.detect(config, set(tensors))
        if layout:
            break
    else:
        raise InputError(f"'{path}' is not a block drafter in a known layout", hint="known: " + ", ".join(LAYOUTS))
    reading = family.read(layout, path, config, tensors, target)
    _add_mask_embedding(reading)
    return build(reading, target, aux, block, source_of(path, source), allow_mismatch)


def _mx_scale_names(config: dict, tensors: dict) -> dict:
    """MXFP8 scales stored as `X.weight_scale_inv` (MiniMax's releases) carried as `X.weight_scale`, the
    name vLLM's MXFP8 linear reads (modelopt.py): a rename, the bytes unchanged."""
    qc = config.get("quantization_config")
    if not (isinstance(qc, dict) and qc.get("quant_method") == "mxfp8"):
        return tensors
    return {(n.removesuffix("_inv") if n.endswith(".weight_scale_inv") and n.removesuffix("_inv") not in tensors
             else n): t for n, t in tensors.items()}


def _add_mask_embedding(r) -> None:
    """`mask_embedding.pt` beside the weights becomes the tensor `mask_embedding`; a `mask_hidden`
    weight is refused, as vLLM refuses it (qwen3_dflash.py @ 036a00d1)."""
    stated = [v for v, _ in r.says.get("mask_token_id", [])]
    embedding, problems = load_mask_embedding(r.path, stated[0] if len(set(stated)) == 1 else None)
    r.problems += problems
    if embedding is not None:
        r.tensors["mask_embedding"] = embedding
        r.names["mask_embedding"] = "mask_embedding.pt"
    r.problems += [f"tensor '{n}': a mask_hidden weight is not a mask embedding (vLLM refuses it; ship "
                   "mask_embedding.pt)" for n in r.tensors if "mask_hidden" in n]
