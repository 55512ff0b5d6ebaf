"""DSpark drafters (a DFlash backbone + a sequential Markov head + a confidence head) in every
published layout, and DeepSeek's `dflash_*_block7` (the same builder without the heads):

- DeepSpec `Qwen3DSparkModel` (deepspec/modeling/dspark/qwen3/{config,modeling}.py @ afdfa7c9382a):
  a copy of the target config plus `block_size`, `target_layer_ids` (output of layer i, -1 = the
  embeddings), `mask_token_id`, `num_anchors`, `markov_rank`, `markov_head_type`,
  `enable_confidence_head`, `confidence_head_with_markov`; slot k predicts anchor+k+1 (anchor-first);
  tensors `markov_head.markov_w1/w2`, `confidence_head.proj`, frozen copies of the target's
  embed_tokens and lm_head. config/dflash/dflash_qwen3_4b.py: markov_rank 0, no confidence head.
- speculators `DSparkSpeculator` (models/dspark/config.py @ c05b95b3): the DFlash speculator fields plus
  the heads; `sample_from_anchor` (default true since v0.7.0, commit a0be7bb6) — a config without it
  predates that field and is refused without --block-layout (SGLang refuses such checkpoints outright:
  dspark_config.py @ 01f47623).
- ModelOpt `DSparkExporter` (hf_spec_export.py @ a2fbac7bad8a): `DFlashDraftModel` + dflash_config
  {projector_type dspark, shift_label, markov_rank, markov_head_type, use_confidence_head}; flat
  tensors `markov_w1`, `markov_w2`, `gate_proj`, `joint_proj`, `confidence_proj` (modeling_dspark.py:
  shift_label true = next-token alignment = anchor-first; the confidence head reads [hidden, W1[prev]]).
- SpecForge `DSparkDraftModel` + model_type qwen3 (specforge/modeling/draft/dspark.py @ 1c2c647c): the
  DFlash config with top-level Markov/confidence fields and DeepSpec tensor names; nothing in it says
  which query layout it was trained with, so --block-layout settles it unless the config does.
- Nemotron 3.5 (sglang dflash_utils.py @ 00731f0b): `Qwen3DSparkModel` + has_embed_tokens, both id
  conventions, sample_from_anchor false, dspark_bonus_anchor true.
- vLLM's own `Qwen3DSparkModel` configs (what its speculators converter writes: explicit markers).
"""

from __future__ import annotations

from pathlib import Path

from specpack.converters.block.common import (size, CONFIDENCE, MARKOV, Reading, dflash_config, speculators_attention,
                                              speculators_flat, state_all_ids, state_anchor_markers, state_block_size,
                                              state_mask_token, state_own_tables, state_sinks, state_target_ids,
                                              unsupported_variant)
from specpack.converters.speculators import verifier_statements
from specpack.errors import UnsupportedError

LAYOUTS = ("deepspec-dspark", "deepseek-dflash", "speculators-dspark", "modelopt-dspark", "specforge-dspark",
           "nemotron35-dspark", "vllm-dspark")
DEEPSPEC_KEYS = {"block_size", "target_layer_ids", "mask_token_id", "num_anchors", "markov_rank",
                 "enable_confidence_head", "num_target_layers"}
DEEPSPEC_ANCHOR_FIRST = ("DeepSpec's definition (qwen3/modeling.py @ afdfa7c: label offsets 1..B, slot k predicts "
                         "anchor+k+1)")
MODELOPT_NAMES = {"markov_w1.weight": MARKOV["vanilla"][0], "markov_w2.weight": MARKOV["vanilla"][1],
                  "gate_proj.weight": MARKOV["gated"][0], "gate_proj.bias": MARKOV["gated"][1],
                  "joint_proj.weight": MARKOV["rnn"][0], "joint_proj.bias": MARKOV["rnn"][1],
                  "confidence_proj.weight": CONFIDENCE[0], "confidence_proj.bias": CONFIDENCE[1]}


def detect(config: dict, names) -> str | None:
    archs = set(config.get("architectures") or [])
    if config.get("speculators_model_type") == "dspark" or "DSparkSpeculator" in archs:
        return "speculators-dspark"
    if "DSparkDraftModel" in archs:
        return "specforge-dspark"
    if "Qwen3DSparkModel" in archs:
        if "has_embed_tokens" in config:
            return "nemotron35-dspark"
        if DEEPSPEC_KEYS <= set(config) and "dflash_config" not in config:
            return "deepseek-dflash" if _deepspec_plain(config) else "deepspec-dspark"
        return "vllm-dspark"
    heads = any(n in MODELOPT_NAMES or n.startswith(("markov_head.", "confidence_head.")) for n in names)
    if "DFlashDraftModel" in archs and (dflash_config(config).get("projector_type") == "dspark" or heads):
        return "nemotron35-dspark" if "has_embed_tokens" in config else "modelopt-dspark"
    return None


def _deepspec_plain(config: dict) -> bool:
    return not config.get("markov_rank") and not config.get("enable_confidence_head")


def read(layout: str, path: Path, raw: dict, tensors: dict, target) -> Reading:
    bad = unsupported_variant(raw, tensors)
    if bad:
        raise UnsupportedError(f"'{path}' is a DFlash variant specpack does not run", problems=bad,
                               hint="plain DFlash, DSpark and LiLiCorr drafters are supported")
    if layout == "specforge-dspark" and raw.get("model_type") != "qwen3":
        raise UnsupportedError(f"'{path}': DSparkDraftModel with model_type {raw.get('model_type')!r}",
                               hint="DSparkDraftModel is a Qwen3 drafter only with model_type qwen3 (vLLM "
                                    "speculative.py @ 002e77c1); otherwise it names DeepSeek-V4's embedded DSpark, "
                                    "whose target specpack does not decode")
    flat = speculators_flat(raw) if layout == "speculators-dspark" else raw
    if flat is None:
        raise UnsupportedError(f"'{path}': speculators DSpark with a non-Qwen3 decoder layer",
                               hint="the DSpark backbone is a Qwen3 layer")
    names = MODELOPT_NAMES if layout == "modelopt-dspark" else {}
    r = Reading(layout, path, flat, raw, {names.get(k, k): v for k, v in tensors.items()},
                {names[k]: k for k in tensors if k in names})
    _state_layout(r)
    _state_heads(r, size(flat, "hidden_size"))
    _state_algorithm(r)
    state_mask_token(r)
    state_block_size(r)
    layers = size(flat, "num_hidden_layers")
    state_sinks(r, layers)
    state_own_tables(r)
    if layout == "speculators-dspark":
        r.made_for, bad = verifier_statements(raw, target)
        r.problems += bad
        r.attention = speculators_attention(flat, raw, layers)
        state_target_ids(r, (raw.get("aux_hidden_state_layer_ids"), "input_of_layer", "aux_hidden_state_layer_ids"))
    else:
        state_all_ids(r)
    return r


def _state_layout(r: Reading) -> None:
    state_anchor_markers(r)
    if r.layout in ("deepspec-dspark", "deepseek-dflash"):
        r.say("query_layout", "anchor_first", DEEPSPEC_ANCHOR_FIRST)
    shift = dflash_config(r.raw).get("shift_label")
    if r.layout == "modelopt-dspark" and isinstance(shift, bool):
        r.say("query_layout", "anchor_first" if shift else "fill_in",
              f"dflash_config.shift_label = {str(shift).lower()} (ModelOpt: true = next-token alignment)")


def _state_algorithm(r: Reading) -> None:
    heads = bool(r.says.get("markov_rank") and any(v for v, _ in r.says["markov_rank"])) or \
        any(v for v, _ in r.says.get("confidence", []))
    where = {"deepseek-dflash": "DeepSpec Qwen3DSparkModel without Markov or confidence head (dflash_*_block7)",
             "modelopt-dspark": "dflash_config.projector_type dspark"}.get(r.layout, f"{r.layout} layout")
    r.say("algorithm", "dspark" if heads else "dflash", where + ("" if heads else ", no Markov or confidence head"))


def _state_heads(r: Reading, hidden: int) -> None:
    """The Markov and confidence heads: what the config says and what the tensors show."""
    dc, raw = dflash_config(r.raw), r.raw
    modelopt = r.layout == "modelopt-dspark"
    src = dc if modelopt else raw
    r.say("markov_rank", src.get("markov_rank"), ("dflash_config." if modelopt else "") + "markov_rank")
    r.say("markov_rank", raw.get("dspark_markov_rank"), "dspark_markov_rank")
    w1 = r.tensors.get(MARKOV["vanilla"][0])
    rank = w1.shape[1] if w1 is not None and w1.ndim == 2 else 0
    r.say("markov_rank", rank, f"{r.source_name(MARKOV['vanilla'][0])} shape" if w1 is not None
          else "no markov_w1 tensor")
    r.say("markov_type", src.get("markov_head_type"), ("dflash_config." if modelopt else "") + "markov_head_type")
    r.say("markov_type", raw.get("dspark_markov_head_type"), "dspark_markov_head_type")
    if w1 is not None:
        kind = "gated" if MARKOV["gated"][0] in r.tensors else "rnn" if MARKOV["rnn"][0] in r.tensors else "vanilla"
        r.say("markov_type", kind, "the Markov head's tensors")
    for key in (("use_confidence_head",) if modelopt else ("enable_confidence_head",)):
        value = src.get(key)
        r.say("confidence", value if isinstance(value, bool) else None, ("dflash_config." if modelopt else "") + key)
    proj = r.tensors.get(CONFIDENCE[0])
    r.say("confidence", proj is not None, "the confidence_head tensors" if proj is not None
          else "no confidence_head tensors")
    r.say("confidence_with_markov", True if modelopt else raw.get("confidence_head_with_markov"),
          "ModelOpt DSparkModule (confidence_proj reads [hidden, W1[prev]])" if modelopt
          else "confidence_head_with_markov")
    if proj is not None and proj.ndim == 2 and rank and proj.shape[1] in (hidden, hidden + rank):
        r.say("confidence_with_markov", proj.shape[1] == hidden + rank, f"{r.source_name(CONFIDENCE[0])} width")
