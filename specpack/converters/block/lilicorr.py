"""LiLiCorr drafters: a DFlash backbone (fill-in) plus a correlator that scores the k candidates of
every slot jointly (`lilicorr.*`).

- vLLM lilicorr.py @ 08f95fe5: `architectures: [LiLiCorrDraftModel]`, geometry in dflash_config
  (`lilicorr_candidate_topk`, `_hidden_size` (null/0 = the drafter's), `_num_layers`, `_num_heads`,
  `_mlp_ratio`, `_factor_dim`, `_vector_eps`, `_logit_scale`; `lilicorr_enabled` false is refused),
  tensor names and shapes (canonical here), the full target vocabulary.
- Older exports index the MLPs as nn.Sequential; SGLang renames them (models/lilicorr.py @ 085551a8:
  feature_mlp.0 -> feature_norm, feature_mlp.1/.3 -> feature_mlp.up_proj/down_proj, .mlp.0/.2 ->
  .mlp.up_proj/down_proj), and so does this module.
- A checkpoint that declares `DFlashDraftModel` with LiLiCorr markers or tensors "loads as plain
  DFlash and silently ignores the head" (ModelOpt LiLiCorr export test; vLLM and SGLang route on the
  architecture, TensorRT-LLM on `projector_type`/`lilicorr_enabled`): refused until
  --block-algorithm says which it is.
"""

from __future__ import annotations

from pathlib import Path

from specpack.converters.block.common import (size, Reading, dflash_config, state_all_ids, state_anchor_markers,
                                              state_block_size, state_mask_token, state_sinks, unsupported_variant)
from specpack.errors import UnsupportedError

LAYOUTS = ("lilicorr", "lilicorr-sequential")
SEQUENTIAL = (("feature_mlp.0.", "feature_norm."), ("feature_mlp.1.", "feature_mlp.up_proj."),
              ("feature_mlp.3.", "feature_mlp.down_proj."), (".mlp.0.", ".mlp.up_proj."), (".mlp.2.", ".mlp.down_proj."))
GEOMETRY = {"candidate_topk": int, "num_layers": int, "num_heads": int, "mlp_ratio": float, "factor_dim": int,
            "vector_eps": float, "logit_scale": float}


def detect(config: dict, names) -> str | None:
    archs = set(config.get("architectures") or [])
    markers = any(k.startswith("lilicorr_") for k in dflash_config(config)) or \
        dflash_config(config).get("projector_type") == "lilicorr"
    head = any(n.startswith("lilicorr.") for n in names)
    if "LiLiCorrDraftModel" in archs or ("DFlashDraftModel" in archs and (markers or head)):
        return "lilicorr-sequential" if any(_renamed(n) != n for n in names) else "lilicorr"
    return None


def _renamed(name: str) -> str:
    if not name.startswith("lilicorr."):
        return name
    for old, new in SEQUENTIAL:
        name = name.replace(old, new)
    return name


def read(layout: str, path: Path, raw: dict, tensors: dict, target) -> Reading:
    bad = unsupported_variant(raw, tensors)
    if bad:
        raise UnsupportedError(f"'{path}' is a LiLiCorr variant specpack does not run", problems=bad,
                               hint="LiLiCorr over a plain DFlash backbone is supported")
    r = Reading(layout, path, raw, raw, {_renamed(k): v for k, v in tensors.items()},
                {_renamed(k): k for k in tensors if _renamed(k) != k})
    _state_algorithm(r)
    r.say("query_layout", "fill_in", "LiLiCorr's definition (vLLM lilicorr.py @ 08f95fe5: B-1 candidate slots)")
    state_anchor_markers(r)
    state_all_ids(r)
    state_mask_token(r)
    state_block_size(r)
    state_sinks(r, size(raw, "num_hidden_layers"))
    r.lilicorr = _geometry(r)
    return r


def _state_algorithm(r: Reading) -> None:
    archs, dc = set(r.raw.get("architectures") or []), dflash_config(r.raw)
    if "LiLiCorrDraftModel" in archs:
        r.say("algorithm", "lilicorr", "architectures LiLiCorrDraftModel")
    if "DFlashDraftModel" in archs:
        r.say("algorithm", "dflash", "architectures DFlashDraftModel (vLLM and SGLang load it as plain DFlash and drop "
                                     "the correlator)")
    if dc.get("projector_type") == "lilicorr":
        r.say("algorithm", "lilicorr", "dflash_config.projector_type lilicorr")
    if isinstance(dc.get("lilicorr_enabled"), bool):
        r.say("algorithm", "lilicorr" if dc["lilicorr_enabled"] else "dflash",
              f"dflash_config.lilicorr_enabled = {str(dc['lilicorr_enabled']).lower()}")
    if any(n.startswith("lilicorr.") for n in r.tensors):
        r.say("algorithm", "lilicorr", "the lilicorr.* tensors")


def _geometry(r: Reading) -> dict | None:
    """LiLiCorr's correlator geometry; every field is required (vector_eps and logit_scale change the
    scores without changing any shape, so nothing else could reveal a lost value)."""
    dc = dflash_config(r.raw)
    missing = [f"lilicorr_{k}" for k in GEOMETRY if dc.get(f"lilicorr_{k}") is None]
    if missing:
        r.problems.append("LiLiCorr geometry missing from dflash_config: " + ", ".join(missing)
                          + " (no default reproduces the trained correlator)")
        return None
    try:
        geo = {k: cast(dc[f"lilicorr_{k}"]) for k, cast in GEOMETRY.items()}
    except (TypeError, ValueError):
        r.problems.append("LiLiCorr geometry in dflash_config is not numeric")
        return None
    geo["hidden_size"] = int(dc.get("lilicorr_hidden_size") or r.raw.get("hidden_size") or 0)
    bad = [k for k in ("candidate_topk", "num_heads", "factor_dim", "hidden_size") if geo[k] <= 0]
    if geo["num_layers"] < 0 or geo["mlp_ratio"] <= 0:
        bad.append("num_layers/mlp_ratio")
    if geo["hidden_size"] > 0 and geo["num_heads"] > 0 and geo["hidden_size"] % geo["num_heads"]:
        bad.append(f"hidden_size {geo['hidden_size']} not divisible by num_heads {geo['num_heads']}")
    if bad:
        r.problems.append("LiLiCorr geometry out of range: " + ", ".join(bad))
        return None
    return geo


def shapes(g: dict, model_hidden: int, block: int) -> dict[str, tuple]:
    """The correlator's tensors as vLLM names and shapes them (lilicorr.py @ 08f95fe5): every Linear
    has a bias (ReplicatedLinear's default); token_proj only when its width differs."""
    h, k, f, nh, m = g["hidden_size"], g["candidate_topk"], g["factor_dim"], g["num_heads"], int(g["hidden_size"] *
                                                                                                 g["mlp_ratio"])
    p, shapes = "lilicorr.", {}

    def linear(name, out, inp):
        shapes.update({f"{p}{name}.weight": (out, inp), f"{p}{name}.bias": (out,)})

    if h != model_hidden:
        linear("token_proj", h, model_hidden)
    linear("pass_hidden_proj", h, model_hidden)
    linear("context_proj", h, model_hidden)
    shapes.update({f"{p}feature_norm.weight": (5,), f"{p}feature_norm.bias": (5,),
                   f"{p}slot_embedding": (1, 1, block - 1, 1, h), f"{p}rank_embedding": (1, 1, 1, k, h),
                   f"{p}relative_slot_bias": (nh, 2 * block - 1), f"{p}same_slot_bias": (nh,),
                   f"{p}output_norm.weight": (h,), f"{p}anchor_norm.weight": (h,)})
    linear("feature_mlp.up_proj", h, 5)
    linear("feature_mlp.down_proj", h, h)
    for layer in range(g["num_layers"]):
        q = f"layers.{layer}."
        shapes.update({f"{p}{q}attn_norm.weight": (h,), f"{p}{q}mlp_norm.weight": (h,),
                       f"{p}{q}attn.in_proj_weight": (3 * h, h), f"{p}{q}attn.in_proj_bias": (3 * h,)})
        linear(f"{q}attn.out_proj", h, h)
        linear(f"{q}mlp.up_proj", m, h)
        linear(f"{q}mlp.down_proj", h, m)
    linear("factor_input_proj", h, 3 * h)
    for name in ("out_head", "in_head", "anchor_out_head"):
        linear(name, f, h)
    return shapes
