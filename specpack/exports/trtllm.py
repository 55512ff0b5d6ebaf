"""TensorRT-LLM (PyTorch backend): an EAGLE-3 draft directory plus `extra-llm-api-config.yml`
with its `speculative_config`; n-gram as `decoding_type: NGram`; MTP inside a DeepSeek-V3 / GLM-4.5
or Qwen3-Next target as `decoding_type: MTP` (config only).

Sources followed (NVIDIA/TensorRT-LLM main; the commit each file was read at is given):
- tensorrt_llm/llmapi/llm_args.py (0004396720054fd8e205cbf616f21f0b57c6b412):
  `DecodingBaseConfig.speculative_model` (alias `speculative_model_dir`, written here because both
  old and new releases accept it), `max_draft_len`; `Eagle3DecodingConfig` (`decoding_type: Eagle3`,
  `eagle3_one_model`, `eagle3_layers_to_capture`: "Defaults to {1, num_layers//2-1,
  num_layers-4}", i.e. *output of layer i*; a set, so states are taken in layer order; -1 means
  the final post-norm state); `NGramDecodingConfig` (`max_matching_ngram_size`).
- tensorrt_llm/_torch/models/modeling_speculative.py: `Eagle3DraftModel` reads the HF layout
  (`midlayer.*`, or `layers.0.*` remapped), sizes `fc` as target hidden × number of captured
  layers, shares the target's embedding when the head's width equals the target's (else creates its
  own and loads it from the head), keeps the un-normed residual (no `norm_before_residual`), and
  loads `d2t` when the vocabularies differ.
- trtllm-serve (tensorrt_llm/commands/serve.py): `--backend pytorch`, `--tp_size`,
  `--extra_llm_api_options` (alias of `--config`), `--trust_remote_code`.
- MTP. llm_args.py `MTPDecodingConfig`: `decoding_type: MTP`, `max_draft_len` = draft tokens per
  step; `num_nextn_predict_layers` is now an internal field read from the checkpoint, and a user
  value is remapped to `max_draft_len` with a deprecation warning (PR #12341, "decouple MTP
  num_nextn_predict_layers from max_draft_len"); `spec_dec_mode`: one checkpoint layer and no
  `use_mtp_vanilla` is MTP-Eagle (the layer repeated), else vanilla (step k runs checkpoint layer k).
  modeling_speculative.py `MTPForCausalLM` (00679c66c3e38f6d2651ad0a5bef0f94d862e36c): the MTP layer
  class per model type (`deepseek_v3` DeepseekV3MTP, `glm4_moe` Glm4MTP, `qwen3_next` Qwen3NextMTP);
  no MiMo.
- _torch/models/modeling_deepseekv3.py `DeepseekV3MTP.forward`: `eh_proj(cat(enorm(emb), hnorm(h)))`
  and returns `shared_head.norm(hidden, residual)` (post-norm, what the next step receives); the
  target model's last layer fuses the final norm, so layer 0 gets the final-norm output; MTP layers
  are read from the target checkpoint (`model.layers.{L+k}.*`), embedding and head shared.
- _torch/models/modeling_qwen3_next.py (00022b040996780da248347927318fecb55ae7e9) `Qwen3NextMTP`:
  `fc(cat(pre_fc_norm_embedding(emb), pre_fc_norm_hidden(h)))`, embedding first, every norm
  zero-centred (`use_gemma`, weight + 1), output `shared_head.norm(hidden, residual)` (post-norm,
  chained); `setup_aliases` makes the target's last layer apply `model.norm`, so layer 0 is fed the
  final-norm output; `Qwen3NextForCausalLM` forces one MTP layer (MTP-Eagle: that layer at every
  step). checkpoints/hf/qwen3_next_weight_mapper.py (32e0e21a97db39e71cae476e68bf37ef606907d7) reads
  `mtp.fc`, `mtp.norm`, `mtp.pre_fc_norm_{embedding,hidden}` and `mtp.layers.{i}.*` from the target.
  These bind as the artifact's canonical Qwen3-Next MTP does; docs/source/models/supported-models.md
  (00b6d5a25c30) still marks MTP "No" for Qwen3NextForCausalLM (the README says so).
- The batch-size schedule `draft_len_schedule`, and the decoding modes that read it: export/_schedule.py.
- Block drafters (draft dir: export/_block.py). llm_args.py (0004396720054fd8e205cbf616f21f0b57c6b412):
  `DFlashDecodingConfig` (`decoding_type: DFlash`, `max_draft_len` = K draft tokens, K + 1 per step,
  `mask_token_id`, `target_layer_ids` read like dflash_config.target_layer_ids: output of layer i) and
  `DSparkDecodingConfig` (`decoding_type: DSpark`, `mask_token_id`, `target_layer_ids`, `block_size`
  "Number of draft positions produced per block ... Should equal max_draft_len" (anchor-first),
  `markov_rank` ("0 disables the head"), `markov_head_type` vanilla|gated|rnn; the confidence head is
  scaffolding in this revision, `enable_confidence_scheduling` arrives in 1.4.0rc4). LiLiCorr runs
  through the DFlash path routed on `projector_type: lilicorr` / `lilicorr_enabled`, with
  `has_own_lm_head` and no causal drafts (_torch/models/modeling_lilicorr.py @ 8d62b3e5). Bindings
  not shown in those sources (own embedding, reduced vocab, mask embedding, per-layer causality,
  windows, sinks) are refused rather than guessed.
"""

from __future__ import annotations

from specpack.exports import _block, _mtp, _schedule
from specpack.exports._common import (EngineExport, ExportContext, aux_problems, capture_problems,
                                                embedding_problems, hf_draft_config, midlayer_names,
                                                output_of_layer, quote, save_tensors, write_json)

NAME = "trtllm"
CONFIG = "extra-llm-api-config.yml"
DRAFT_DIR = "draft"
MTP = {"mtp-deepseek": _mtp.EngineMtp("embedding_first", "final_norm_output", "post_norm", "mod"),
       "mtp-qwen3-next": _mtp.EngineMtp("embedding_first", "final_norm_output", "post_norm", "first",
                                        max_layers=1),
       "mtp-mimo": "TensorRT-LLM has no MiMo model (modeling_speculative.py MTPForCausalLM)",
       "mtp-nemotron-h": "TensorRT-LLM runs it one-model (NemotronHMTP), whose forward was not checked against its source "
                         "here: export to vLLM (nemotron_h_mtp.py read)"}
MTP_ARCHS = {"mtp-deepseek": ("DeepseekV3ForCausalLM", "Glm4MoeForCausalLM", "DeepseekV32ForCausalLM",
                              "GlmMoeDsaForCausalLM"),  # MTPForCausalLM's model types (deepseek_v32, glm_moe_dsa too)
             "mtp-qwen3-next": ("Qwen3NextForCausalLM", "Qwen3_5ForConditionalGeneration",
                                "Qwen3_5MoeForConditionalGeneration")}  # qwen3_5_text, qwen3_5_moe_text -> Qwen3NextMTP


def limits(manifest, draft_len: int = 1) -> list[str]:
    d = manifest.drafter
    if d.kind == "ngram":
        return []
    if d.kind == "mtp":
        problems = _mtp.problems("TensorRT-LLM", MTP, manifest, draft_len)
        archs = MTP_ARCHS.get(d.source_layout, ())
        if archs and manifest.target.architecture not in archs:
            problems.append(f"TensorRT-LLM runs {d.source_layout} MTP layers for {', '.join(archs)} only")
        return problems
    if d.kind == "block":
        return _block_limits(d)
    if d.kind == "release_dspark":
        return [f"TensorRT-LLM has no {d.source_layout} draft: it picks DFlash, LiLiCorr or DFlash2 drafters from a "
                "checkpoint's markers (dflash_config, architectures) and loads neither DeepSeek-V4 / V4.1's DSpark stages "
                "nor DSparkMiniMaxDraftModel"]
    if d.kind != "eagle3":
        return [f"TensorRT-LLM export of {d.kind} drafters is not implemented"]
    problems = capture_problems(manifest, "trtllm", "TensorRT-LLM") + aux_problems(manifest, n_aux_fixed=False)
    problems += embedding_problems(manifest)
    if 0 in d.aux_hidden_states.layer_ids:
        problems.append("aux layer 0 (the embeddings) would be id -1, which TensorRT-LLM reads "
                        "as the final hidden state")
    if d.norm_before_residual:
        problems.append("the head uses norm_before_residual, which TensorRT-LLM's EAGLE-3 layer lacks")
    if d.embedding_source == "drafter" and d.hidden_size == manifest.target.hidden_size:
        problems.append("the head has its own embedding, but TensorRT-LLM shares the target's")
    return problems


def write_eagle3(ctx: ExportContext, head: dict, tensors: dict) -> EngineExport:
    ids = output_of_layer(ctx.manifest.drafter.aux_hidden_states.layer_ids)
    draft = ctx.out / DRAFT_DIR
    draft.mkdir()
    write_json(draft / "config.json", hf_draft_config(ctx, head, ["LlamaForCausalLMEagle3"], ids))
    save_tensors(draft / "model.safetensors", midlayer_names(tensors))
    spec = {"decoding_type": "Eagle3", "max_draft_len": ctx.draft_len,
            "speculative_model_dir": str(ctx.final_out / DRAFT_DIR), "eagle3_one_model": True,
            "eagle3_layers_to_capture": ids}
    schedule = _with_schedule(ctx, spec)
    _write_yaml(ctx, spec)
    notes = ["`eagle3_layers_to_capture` counts *output of layer i* and is a set: TensorRT-LLM "
             "concatenates the captured states in layer order, as the head was trained."]
    return EngineExport(_serve(ctx), {"speculative_config": spec}, notes, ids, "output_of_layer", schedule=schedule)


BLOCK = {("dflash", "fill_in"): None, ("lilicorr", "fill_in"): None, ("dspark", "anchor_first"): None,
         ("dflash", "anchor_first"): None,  # DSparkDecodingConfig with markov_rank 0
         ("dspark", "fill_in"): "TensorRT-LLM's DSpark drafts an anchor-first block (block_size = max_draft_len)"}


def _block_limits(d) -> list[str]:
    problems = _block.algorithm_problems(d, "TensorRT-LLM", BLOCK) + _block.id_problems(d, "TensorRT-LLM")
    problems += _block.table_problems(d, "TensorRT-LLM", False, d.algorithm == "lilicorr", False, False)
    problems += _block.attention_problems(d, "TensorRT-LLM", causal=False, sliding=False, sinks=False)
    return problems


def write_block(ctx: ExportContext, head: dict, tensors: dict) -> EngineExport:
    d = ctx.manifest.drafter
    dspark = d.query_layout == "anchor_first"  # anchor-first blocks run as DSpark, Markov head or not
    arch = {"lilicorr": "LiLiCorrDraftModel"}.get(d.algorithm, "Qwen3DSparkModel" if dspark else "DFlashDraftModel")
    _block.write_draft(ctx, ctx.out / DRAFT_DIR, head, tensors, arch)
    ids = output_of_layer(list(d.target_features.layer_ids))
    spec = {"decoding_type": "DSpark" if dspark else "DFlash", "max_draft_len": ctx.draft_len,
            "speculative_model_dir": str(ctx.final_out / DRAFT_DIR), "mask_token_id": d.mask_token_id,
            "target_layer_ids": ids}
    if dspark:
        spec.update(block_size=d.block_size, markov_rank=d.markov.rank if d.markov else 0,
                    markov_head_type=d.markov.type if d.markov else "vanilla")
    schedule = _with_schedule(ctx, spec, "TensorRT-LLM's DSpark mode takes no dynamic draft length (interface.py "
                                         "support_dynamic_draft_len leaves DSPARK out)" if dspark else None)
    _write_yaml(ctx, spec)
    count = f"max_draft_len {ctx.draft_len} (draft tokens; TensorRT-LLM verifies max_draft_len + 1)"
    notes = ["`target_layer_ids` count *output of layer i*, as in the draft's dflash_config.",
             "Fields checked against NVIDIA/TensorRT-LLM tensorrt_llm/llmapi/llm_args.py @ 0004396720054fd8e205cbf6."]
    if d.confidence:
        notes.append("The confidence head is carried in the draft weights; TensorRT-LLM releases before "
                     "1.4.0rc4 do not use it (outputs are unchanged, only the verified length is not adapted).")
    return EngineExport(_serve(ctx), {"speculative_config": spec}, notes, ids, "output_of_layer",
                        bindings=_block.bindings(ctx, "TensorRT-LLM", count, ids, "output_of_layer"), schedule=schedule)


def write_ngram(ctx: ExportContext, head=None, tensors=None) -> EngineExport:
    d = ctx.manifest.drafter
    spec = {"decoding_type": "NGram", "max_draft_len": ctx.draft_len,
            "max_matching_ngram_size": d.max_n}
    schedule = _with_schedule(ctx, spec)
    _write_yaml(ctx, spec)
    notes = [f"TensorRT-LLM matches n-grams from {d.max_n} tokens down to 1; the artifact's "
             f"minimum n ({d.min_n}) has no TensorRT-LLM setting. Outputs stay lossless; only the "
             "proposals, and so the speed, can differ."]
    return EngineExport(_serve(ctx), {"speculative_config": spec}, notes, schedule=schedule)


def write_mtp(ctx: ExportContext, head=None, tensors=None) -> EngineExport:
    spec = {"decoding_type": "MTP", "max_draft_len": ctx.draft_len}
    layers = ctx.manifest.drafter.num_layers
    schedule = _with_schedule(ctx, spec, f"TensorRT-LLM runs these {layers} MTP layers as vanilla MTP, which ignores "
                                         "it (speculative/utils.py)" if layers > 1 else None)
    _write_yaml(ctx, spec)
    reads = _mtp.check_reads(ctx, "TensorRT-LLM")
    notes = ["No weights are written: TensorRT-LLM builds the MTP module from the target checkpoint "
             "(one-model MTP); `max_draft_len` is the number of draft tokens per step.",
             "Releases before NVIDIA/TensorRT-LLM PR #12341 read the draft length from "
             "`num_nextn_predict_layers` (same value); current ones remap that key to `max_draft_len` "
             "with a deprecation warning and read the checkpoint's MTP layer count themselves."]
    if ctx.manifest.drafter.source_layout == "mtp-qwen3-next":
        notes.append("TensorRT-LLM's support matrix (docs/source/models/supported-models.md) still marks "
                     "MTP \"No\" for Qwen3NextForCausalLM, although its code runs `Qwen3NextMTP` with the "
                     "bindings stated above: validate acceptance on your workload before relying on it.")
    how = MTP[ctx.manifest.drafter.source_layout]
    return EngineExport(_serve(ctx, _mtp.remote_code(ctx)), {"speculative_config": spec}, notes,
                        bindings=_mtp.bindings(ctx, "TensorRT-LLM", how, reads), schedule=schedule)


def _with_schedule(ctx: ExportContext, spec: dict, unsupported: str | None = None) -> list[str]:
    """The profile's crossover as `draft_len_schedule` where this decoding mode reads one; README lines."""
    c = ctx.crossover
    if c is None:
        return []
    if unsupported:
        return _schedule.measured_lines(c) + [f"No `draft_len_schedule` written: {unsupported}."]
    spec["draft_len_schedule"] = _schedule.trtllm(c)
    return _schedule.trtllm_lines(c)


def _write_yaml(ctx: ExportContext, spec: dict) -> None:
    import yaml

    (ctx.out / CONFIG).write_text(yaml.safe_dump({"speculative_config": spec}, sort_keys=False))


def _serve(ctx: ExportContext, trust_remote_code: bool = False) -> str:
    remote = " --trust_remote_code" if trust_remote_code else ""
    return (f"trtllm-serve {quote(ctx.artifact)} --backend pytorch --tp_size {ctx.tensor_parallel}{remote} "
            f"\\\n  --extra_llm_api_options {quote(ctx.final_out / CONFIG)}")


KINDS = {"eagle3": write_eagle3, "ngram": write_ngram, "mtp": write_mtp, "block": write_block}
