"""Which embedding and lm_head a block drafter uses, and its vocabulary map: a shipped copy of a
target table is compared with the target's bit for bit and, when equal, shared rather than stored
twice (vLLM shares it then too: `_should_share`, dflash/utils.py @ 055e47c2), with the SHA-256 of the
target tensor recorded; a copy that differs is the drafter's own. Reduced vocabularies need their
own lm_head and a d2t map (checked as EAGLE-3's are); t2d is derivable and not kept.
"""

from __future__ import annotations

import logging

from specpack.converters.block.common import Reading
from specpack.converters.target_hf import Target

log = logging.getLogger(__name__)


def sharing(r: Reading, geo, target: Target, algorithm: str) -> dict:
    """Which embedding and lm_head the drafter uses, checked against the target's; vocab map."""
    from specpack.converters.eagle3 import check_vocab_map

    out = {}
    for role, name, target_name in (("embedding", "embed_tokens.weight", target.embed_name),
                                    ("lm_head", "lm_head.weight", target.lm_head_name)):
        source, digest = _shared(r, name, target, target_name, geo, role)
        out[role], out[f"target_{role}_sha256"] = source, digest
    if geo.draft_vocab < geo.target_vocab:
        if out["lm_head"] != "drafter":
            r.problems.append(f"draft vocab {geo.draft_vocab} < target vocab {geo.target_vocab} needs the drafter's "
                              "own lm_head")
        _, problems = check_vocab_map(r.tensors, geo.draft_vocab, geo.target_vocab)
        r.problems += problems
        r.tensors.pop("t2d", None)  # derivable from d2t; canonical drafters keep d2t only
    elif "d2t" in r.tensors or "t2d" in r.tensors:
        if "d2t" in r.tensors and r.tensors["d2t"].any():
            r.problems.append("d2t maps a full draft vocabulary to other ids: a full vocab maps identically")
        r.tensors.pop("d2t", None)
        r.tensors.pop("t2d", None)
    if algorithm == "lilicorr" and geo.draft_vocab != geo.target_vocab:
        r.problems.append("LiLiCorr candidates require the full target vocabulary (vLLM lilicorr.py @ 08f95fe5)")
    return out


def _shared(r: Reading, name: str, target: Target, target_name: str, geo, role: str):
    """(`target` | `drafter`, SHA-256 of the target tensor when shared). A shipped copy equal to the
    target's, bit for bit, is not stored twice (vLLM shares it then too: `_should_share`)."""
    from specpack.converters.safetensors_header import tensor_sha256

    mine, entry = r.tensors.get(name), target.tensors.get(target_name)
    if mine is None:
        if geo.hidden != target.info.hidden_size:
            r.problems.append(f"the drafter (hidden {geo.hidden}) ships no {name} of its own and cannot use the "
                              f"target's (hidden {target.info.hidden_size})")
        return "target", tensor_sha256(target.root / entry[0], entry[1]) if entry else None
    if entry is not None and _same(mine, target.root / entry[0], target_name):
        del r.tensors[name]
        return "target", tensor_sha256(target.root / entry[0], entry[1])
    _say_kept(name, role, tuple(mine.shape), geo)
    return "drafter", None


def _say_kept(name: str, role: str, shape: tuple[int, ...], geo) -> None:
    """A drafter's own output layer is its design (trained, often over a reduced draft vocabulary): said at
    info level. An input embedding of the target's shape that differs was trained apart: a warning."""
    if role == "lm_head" and geo.draft_vocab < geo.target_vocab:
        log.info("the drafter's %s covers its own %d-token draft vocabulary (the target's %d): kept, by design",
                 name, geo.draft_vocab, geo.target_vocab)
    elif role == "lm_head":
        log.info("the drafter's %s %s was trained with the drafter: kept as its own", name, list(shape))
    else:
        log.warning("the drafter's %s differs from the target's embedding: keeping the drafter's own (was it "
                    "trained on another revision of the target?)", name)


def _same(tensor, file, name: str) -> bool:
    from safetensors import safe_open

    with safe_open(file, "pt") as f:
        theirs = f.get_slice(name)
        if tuple(theirs.get_shape()) != tuple(tensor.shape):
            return False
        other = f.get_tensor(name)
    return other.dtype == tensor.dtype and other.contiguous().view(-1).view(
        dtype=_bytes_dtype(other)).equal(tensor.contiguous().view(-1).view(dtype=_bytes_dtype(tensor)))


def _bytes_dtype(t):
    import torch

    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
