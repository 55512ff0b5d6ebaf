"""DFlash drafters: z-lab `DFlashDraftModel` (and ModelOpt's export of the same format), vLLM
speculators `DFlashSpeculator`, and the Nemotron 3.5 DFlash layout.

- z-lab (dflash/model.py @ 44947fbf7111) and ModelOpt `DFlashExporter` ("z-lab compatible":
  modelopt/torch/export/plugins/hf_spec_export.py @ a2fbac7bad8a): flat Qwen3 config, `block_size`,
  `dflash_config {mask_token_id, target_layer_ids}` (output of layer i), tensors `layers.*`, `fc`,
  `hidden_norm`, `norm`; fill-in queries (the anchor slot predicts nothing). The two differ in who
  wrote the config: transformers' save_pretrained writes `transformers_version`, ModelOpt does not
  (the label only; both read the same way).
- speculators (src/speculators/models/dflash/{config,core}.py @ c05b95b3): `transformer_layer_config`,
  `aux_hidden_state_layer_ids` (input of layer i, "speculators uses the layer id directly":
  convert/dflash/converter.py), `block_size`, `mask_token_id`, `draft_vocab_size`, `sample_from_anchor`
  (from v0.7.0; before it, fill-in only: core.py @ ff71b1e6 proposes block_size - 1 tokens),
  `sliding_window_non_causal`; saved embed_tokens / lm_head are the verifier's, d2t/t2d when reduced.
- Nemotron 3.5 (sglang dflash_utils.py @ 00731f0b `is_nemotron_35_draft_config`): `has_embed_tokens`
  (own embedding), no lm_head, eagle_aux ids = target_layer_ids + 1, sample_from_anchor false.
"""

from __future__ import annotations

from pathlib import Path

from specpack.converters.block.common import (size, Reading, speculators_attention, speculators_flat, state_all_ids,
                                              state_anchor_markers, state_block_size, state_mask_token, state_own_tables,
                                              state_sinks, state_target_ids, unsupported_variant)
from specpack.converters.speculators import verifier_statements
from specpack.errors import UnsupportedError

LAYOUTS = ("zlab-dflash", "modelopt-dflash", "speculators-dflash", "nemotron35-dflash")
ZLAB_FILL_IN = "z-lab DFlash's definition (dflash/model.py @ 44947fb: the mask slots predict their own positions)"


def detect(config: dict, names) -> str | None:
    archs = set(config.get("architectures") or [])
    if config.get("speculators_model_type") == "dflash" or "DFlashSpeculator" in archs:
        return "speculators-dflash"
    if "DFlashDraftModel" not in archs:
        return None
    if "has_embed_tokens" in config:
        return "nemotron35-dflash"
    return "zlab-dflash" if "transformers_version" in config else "modelopt-dflash"


def read(layout: str, path: Path, raw: dict, tensors: dict, target) -> Reading:
    bad = unsupported_variant(raw, tensors)
    if bad:
        raise UnsupportedError(f"'{path}' is a DFlash variant specpack does not run", problems=bad,
                               hint="plain DFlash, DSpark and LiLiCorr drafters are supported")
    if layout == "speculators-dflash":
        return _speculators(path, raw, tensors, target)
    r = Reading(layout, path, raw, raw, dict(tensors), {})
    r.say("algorithm", "dflash", "architectures DFlashDraftModel")
    r.say("query_layout", "fill_in", ZLAB_FILL_IN)
    state_anchor_markers(r)
    state_all_ids(r)
    state_mask_token(r)
    state_block_size(r)
    state_sinks(r, size(raw, "num_hidden_layers"))
    state_own_tables(r)
    return r


def _speculators(path: Path, raw: dict, tensors: dict, target) -> Reading:
    flat = speculators_flat(raw)
    if flat is None:
        kind = raw["transformer_layer_config"].get("model_type")
        raise UnsupportedError(f"'{path}': speculators DFlash with a {kind} decoder layer; the DFlash layer is a "
                               "Qwen3 layer", hint="re-export with a Qwen3 layer")
    r = Reading("speculators-dflash", path, flat, raw, dict(tensors), {})
    r.made_for, bad = verifier_statements(raw, target)
    r.problems += bad
    r.say("algorithm", "dflash", "speculators_model_type dflash")
    if isinstance(raw.get("sample_from_anchor"), bool):
        state_anchor_markers(r)
    else:
        r.say("query_layout", "fill_in", "speculators DFlash before sample_from_anchor existed (core.py @ ff71b1e6: "
                                         "block_size - 1 speculative tokens)")
    state_target_ids(r, (raw.get("aux_hidden_state_layer_ids"), "input_of_layer", "aux_hidden_state_layer_ids"))
    state_mask_token(r)
    state_block_size(r)
    state_sinks(r, size(flat, "num_hidden_layers"))
    r.attention = speculators_attention(flat, raw, size(flat, "num_hidden_layers"))
    return r
