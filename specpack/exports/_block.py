"""What the block-drafter exports share: the draft checkpoint every engine loads (z-lab DFlash /
DeepSpec DSpark format, both target-id conventions written out), the checks that refuse what an
engine cannot represent, and the README's binding lines.

The artifact's canonical tensor names are the z-lab / DeepSpec / vLLM names, so the weights are
written unchanged; only a separate mask embedding moves to `mask_embedding.pt`, where vLLM reads it
(qwen3_dflash.py @ 036a00d1 `_read_mask_embedding`). Both id conventions are written, so no reader
can shift them: `eagle_aux_hidden_state_layer_ids` counts input of layer i and vLLM reads it first
(eagle3_utils.py @ 0cfdd2e1); `dflash_config.target_layer_ids` and `target_layer_ids` count output of
layer i (z-lab, DeepSpec, SGLang, TensorRT-LLM; vLLM adds 1 to them when the first is absent). Both
query-layout flags are written too: vLLM revisions read `sample_from_anchor` or its opposite
`dspark_bonus_anchor` (dspark/speculator.py @ 02957b5a vs @ 6534e066).
"""

from __future__ import annotations

from pathlib import Path

from specpack.exports._common import ExportContext, output_of_layer, save_tensors, with_quantization, write_json

_SLIDING = "sliding_attention"


def algorithm_problems(d, engine: str, allowed: dict) -> list[str]:
    """`allowed`: (algorithm, query_layout) -> None, or the reason `engine` cannot run it."""
    key = (d.algorithm, d.query_layout)
    if key not in allowed:
        return [f"{engine} has no {d.algorithm} drafter with the {d.query_layout} query layout"]
    return [allowed[key]] if allowed[key] else []


def id_problems(d, engine: str) -> list[str]:
    ids = d.target_features.layer_ids
    out = []
    if ids != sorted(ids):
        out.append(f"target layer ids {ids} are not ascending, but engines concatenate captured states in layer order")
    if engine != "vLLM" and 0 in ids:
        out.append(f"target layer 0 (the embeddings) would be id -1 in {engine}'s output-of-layer ids, which it does "
                   "not read as the embeddings")
    return out


def table_problems(d, engine: str, embedding: bool, lm_head: bool, reduced: bool, mask_embedding: bool) -> list[str]:
    """Bindings `engine` cannot represent: an own embedding / lm_head, a reduced vocab, a mask embedding."""
    out = []
    if d.embedding_source == "drafter" and not embedding:
        out.append(f"the drafter has its own embedding, but {engine} feeds it the target's")
    if d.lm_head_source == "drafter" and not lm_head:
        out.append(f"the drafter has its own lm_head, but {engine} scores it with the target's")
    if d.vocab_map == "d2t" and not reduced:
        out.append(f"the drafter's vocabulary is reduced (d2t), which {engine}'s loader does not map")
    if d.mask_embedding and not mask_embedding:
        out.append(f"the drafter has its own mask embedding, which {engine} does not read")
    return out


def attention_problems(d, engine: str, causal: bool, sliding: bool, sinks: bool) -> list[str]:
    out = []
    if any(d.layer_causal) and not causal:
        out.append(f"draft layers {[i for i, c in enumerate(d.layer_causal) if c]} are causal within the block; "
                   f"{engine} reads no per-layer causality for this drafter")
    if any(d.sliding_window) and not sliding:
        out.append(f"draft layers use sliding windows {d.sliding_window}, which {engine} does not read")
    if d.attention_sinks and not sinks:
        out.append(f"the drafter uses attention sinks, which {engine} does not read")
    return out


def vllm_attention(d) -> tuple[dict, list[str]]:
    """Config fields from which vLLM's `_resolve_layer_attention` (qwen3_dflash.py @ 036a00d1)
    rebuilds the artifact's per-layer causality and windows, or why it cannot."""
    windows = [w for w in d.sliding_window if w]
    if len(set(windows)) > 1:
        return {}, [f"draft layers use different windows {d.sliding_window}; vLLM reads one window for all"]
    types = [_SLIDING if w else "full_attention" for w in d.sliding_window]
    fields = {"layer_types": types, "dflash_config": {}}
    if windows:
        fields["sliding_window"] = windows[0]
    if d.layer_causal != [t == _SLIDING for t in types]:  # vLLM's own rule: causal iff sliding
        if len(set(d.layer_causal)) > 1:
            return {}, [f"per-layer causality {d.layer_causal} is neither uniform nor 'causal iff sliding', the only "
                        "patterns vLLM's config can express"]
        fields["dflash_config"]["causal"] = d.layer_causal[0]
    return fields, []


def hf_config(ctx: ExportContext, head: dict, arch: str) -> dict:
    """The drafter's config in the z-lab / DeepSpec Hugging Face form, every binding explicit."""
    d, t = ctx.manifest.drafter, ctx.manifest.target
    ids_in = list(d.target_features.layer_ids)
    dc = {"mask_token_id": d.mask_token_id, "target_layer_ids": output_of_layer(ids_in), "block_size": d.block_size,
          "sample_from_anchor": d.query_layout == "anchor_first"}
    attention, _ = vllm_attention(d)
    dc.update(attention.pop("dflash_config", {}))
    if d.attention_sinks:
        dc["attention_sink_bias"] = True
    config = {
        "architectures": [arch], "model_type": "qwen3", "hidden_size": head["hidden_size"],
        "num_hidden_layers": head["num_layers"], "num_attention_heads": head["num_attention_heads"],
        "num_key_value_heads": head["num_key_value_heads"], "head_dim": head["head_dim"],
        "intermediate_size": head["intermediate_size"], "hidden_act": head["hidden_act"],
        "rms_norm_eps": head["rms_norm_eps"], "attention_bias": head["attention_bias"],
        "vocab_size": head["vocab_size"], "draft_vocab_size": head["draft_vocab_size"],
        "target_hidden_size": head["target_hidden_size"], "max_position_embeddings": t.max_position_embeddings,
        "rope_theta": head["rope_theta"], "is_neox_style": head["rope_style"] == "neox",
        "tie_word_embeddings": False, "torch_dtype": d.dtype, "num_target_layers": t.num_hidden_layers,
        "block_size": d.block_size, "mask_token_id": d.mask_token_id,
        "eagle_aux_hidden_state_layer_ids": ids_in, "target_layer_ids": output_of_layer(ids_in),
        "sample_from_anchor": d.query_layout == "anchor_first", "dspark_bonus_anchor": d.query_layout == "fill_in",
        "dflash_config": dc, **attention}
    if head.get("rope_scaling"):
        config["rope_scaling"] = head["rope_scaling"]
    if d.logit_scale is not None:
        config["logit_scale"] = d.logit_scale
    config.update(_head_fields(d, dc))
    return with_quantization(config, head)


def _head_fields(d, dc: dict) -> dict:
    if d.lilicorr:
        dc.update({f"lilicorr_{k}": v for k, v in d.lilicorr.model_dump().items()},
                  lilicorr_enabled=True, projector_type="lilicorr")
        return {"has_own_lm_head": d.lm_head_source == "drafter"}
    if d.algorithm != "dspark" and d.query_layout != "anchor_first":
        return {}
    return {"markov_rank": d.markov.rank if d.markov else 0,
            "markov_head_type": d.markov.type if d.markov else "vanilla",
            "enable_confidence_head": d.confidence is not None,
            "confidence_head_with_markov": bool(d.confidence and d.confidence.with_markov)}


def write_draft(ctx: ExportContext, out: Path, head: dict, tensors: dict, arch: str) -> list[str]:
    """config.json + model.safetensors (+ mask_embedding.pt) in `out`; returns the files written."""
    import torch

    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "config.json", hf_config(ctx, head, arch))
    weights = {k: v for k, v in tensors.items() if k != "mask_embedding"}
    save_tensors(out / "model.safetensors", weights)
    files = ["config.json", "model.safetensors"]
    if "mask_embedding" in tensors:
        torch.save({"mask_token_id": ctx.manifest.drafter.mask_token_id, "embedding": tensors["mask_embedding"]},
                   out / "mask_embedding.pt")
        files.append("mask_embedding.pt")
    return files


def bindings(ctx: ExportContext, engine: str, count: str, ids: list[int], convention: str) -> list[str]:
    """README lines: what the engine is told, in its own terms."""
    d = ctx.manifest.drafter
    lines = [f"{d.algorithm}, {d.query_layout} query layout, trained block {d.block_size} ({d.draft_slots} draft "
             f"slots); {engine} is asked for {ctx.draft_len} draft tokens: {count}.",
             f"Target layers {ids}, counted as *{convention.replace('_', ' ')} i* ({engine}'s convention; the artifact "
             f"states {d.target_features.layer_ids} as input of layer i). The draft config states both conventions: "
             "`eagle_aux_hidden_state_layer_ids` (input of) and `dflash_config.target_layer_ids` / `target_layer_ids` "
             "(output of).",
             f"Mask token {d.mask_token_id}" + (" with its own mask embedding (`mask_embedding.pt`)"
                                                if d.mask_embedding else "") + ".",
             f"Embedding: {d.embedding_source}; lm_head: {d.lm_head_source}; draft vocab {d.draft_vocab_size} "
             f"({d.vocab_map})."]
    if d.markov or d.confidence:
        markov = f"rank {d.markov.rank} ({d.markov.type})" if d.markov else "none"
        confidence = "none" if not d.confidence else "with the Markov embedding" if d.confidence.with_markov else "yes"
        lines.append(f"Markov head: {markov}; confidence head: {confidence}.")
    if ctx.draft_len < d.draft_slots:
        lines.append(f"Fewer draft tokens than trained slots ({ctx.draft_len} < {d.draft_slots}) shortens the "
                     "non-causal block the drafter attends over: expect lower acceptance than at "
                     f"{d.draft_slots}.")
    return lines
