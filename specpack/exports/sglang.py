"""SGLang: EAGLE-3 heads in the `LlamaForCausalLMEagle3` layout; n-gram as `--speculative-algorithm
NGRAM`; MTP as `--speculative-algorithm EAGLE` (what `NEXTN` becomes), DeepSeek/GLM with a NextN
draft checkpoint written here, Qwen3-Next reading its `mtp.*` layers from the target.

Versions: every flag written here was checked against the released sglang 0.5.9 and 0.5.10 wheels
(sglang/srt/server_args.py) and sgl-project/sglang main (python/sglang/srt/server_args.py at
001067fffe33427bee0ed2f007fb7551a1d76b44, arg_groups/fields/spec.py at 015c872628e3); the n-gram flags
need v0.5.10 or later (NGRAM_SINCE below).

Sources followed:
- python/sglang/srt/models/llama_eagle3.py: `midlayer.*`, `fc` sized `target_hidden_size * 3`,
  `d2t` read as hot-token offsets, `t2d` skipped, `tie_word_embeddings` makes lm_head the embedding
  (so it is written false), and the decoder layer keeps the un-normed residual (no
  `norm_before_residual`); `load_weights` loads the head's own `embed_tokens` when it has one.
- models/llama.py `set_embed`: the EAGLE worker hands the head the target's embedding, which replaces
  the head's own unless `target_hidden_size != hidden_size` (then `set_embed` returns early and the
  head keeps its own). So an own embedding of the target's width cannot be served faithfully, and a
  narrower head without one would run with an unloaded embedding.
- models/llama.py `set_eagle3_layers_to_capture`: ids from
  `eagle_config.eagle_aux_hidden_state_layer_ids` are shifted `+1` ("for the ith layer, it takes
  the output of the (i-1)th layer"), i.e. SGLang's ids count *output of layer i*; `LlamaModel.forward`
  captures `hidden_states + residual` before layer i runs, and before layer 0 the residual is None,
  so id -1 (our aux layer 0, the embeddings) fails in the first forward.
- server_args.py: `--speculative-algorithm EAGLE3|NGRAM`, `--speculative-draft-model-path`,
  `--speculative-num-steps`, `--speculative-eagle-topk`, `--speculative-num-draft-tokens`,
  `--tp-size` (alias `--tensor-parallel-size`), `--trust-remote-code`.
- N-gram, v0.5.10 and main: `--speculative-ngram-max-trie-depth` (PR #21181 renamed it from
  `--speculative-ngram-branch-length`), `--speculative-ngram-{min,max}-bfs-breadth`,
  `--speculative-ngram-match-type`, `--speculative-ngram-capacity`; PR #21225 removed
  `--speculative-ngram-{min,max}-match-window-size` (SGLang's own server-args test asserts they are
  gone). cpp_ngram/trie.cpp (main at 0d1d60f59add; jit_kernel/csrc/ngram_corpus in 0.5.10): the trie
  stores every path of up to `max_trie_depth` tokens and matches every context suffix up to that depth,
  so a match of n tokens can continue `max_trie_depth - n` tokens. arg_groups/speculative_hook.py
  `_handle_ngram` (main at 004c82e07d87): `--speculative-num-draft-tokens` counts the root (the last
  context token), and `--speculative-eagle-topk` is overwritten with the maximum BFS breadth.
- MTP. server_args.py: `NEXTN` is rewritten to `EAGLE`; for DeepseekV3ForCausalLM / Glm4MoeForCausalLM
  a missing draft path defaults to the target's. configs/model_config.py `_config_draft_model`: as a
  draft, DeepseekV3ForCausalLM -> DeepseekV3ForCausalLMNextN, Glm4MoeForCausalLM ->
  Glm4MoeForCausalLMNextN, MiMoForCausalLM -> MiMoMTP, Qwen3NextForCausalLM -> Qwen3NextForCausalLMMTP
  (num_nextn_predict_layers forced to 1). The EAGLE worker runs that one-layer draft model
  `--speculative-num-steps` times, feeding each step the hidden states the previous one returned,
  with the target's embedding and lm_head (`set_embed_and_head`).
- scripts/export_deepseek_nextn.py: the NextN checkpoint is the target's config with
  `num_hidden_layers: 1`, `architectures: [DeepseekV3ForCausalLMNextN]`, and layer L's tensors
  renamed `model.layers.{L}.` -> `model.layers.0.`, without `embed_tokens` and `shared_head.head`.
  models/deepseek_v2.py / glm4_moe.py `load_weights(is_nextn=True)` read layer 0 when
  num_hidden_layers is 1 (else layer L); older deepseek_nextn.py accepts only that exported form
  ("Only 1 nextn layer is supported").
- models/deepseek_nextn.py, glm4_moe_nextn.py: `eh_proj(cat(enorm(emb), hnorm(h)))` and the output
  is `shared_head.norm(hidden, residual)` (post-norm, also what the next step receives).
  mimo_mtp.py: one layer (every `model.mtp_layers.{i}` maps onto it), `input_proj(cat(hidden_layernorm
  (h), token_layernorm(emb)))`, `final_layernorm` output; but mimo.py's target is a Qwen2Model, which
  returns the final-norm output. qwen3_next_mtp.py: `fc(cat(pre_fc_norm_embedding(emb),
  pre_fc_norm_hidden(h)))`, one `mtp.layers.0`, normed output.
- Block drafters (config and ids: export/_block.py). arg_groups/fields/spec.py @ 015c872628e3:
  `--speculative-algorithm DFLASH|DSPARK`, `--speculative-num-draft-tokens` (for DFLASH the verify
  window: the anchor plus the draft tokens; `--speculative-dflash-block-size` is its alias),
  `--speculative-dspark-block-size` (gamma, the draft tokens; "the verify window is gamma + 1").
  arg_groups/speculative_hook.py `_handle_dspark`: with gamma set, a `--speculative-num-draft-tokens`
  other than gamma + 1 is a ValueError, and without it the window is set to gamma + 1; both are
  written, so the export states the window instead of leaving it to the hook.
  speculative/dflash_utils.py @ 00731f0b: `dflash_config.target_layer_ids` count output of layer i
  ("SGLang captures before layer i, so the model hook will typically add +1"), negative ids refused,
  sinks (dflash_config.attention_sink_bias) and windows (layer_types + sliding_window) read, no
  causality read; the 1+N query layout with its own embed_tokens only for quantized Nemotron 3.5
  checkpoints (`is_nemotron_35_draft_config`: W4A16_NVFP4). models/dflash.py @ 003b23d7: the DFlash
  draft "intentionally does not include token embeddings or an LM head". models/dspark.py and
  dspark_components/dspark_config.py @ 01f47623: `Qwen3DSparkModel`; DeepSpec's anchor-first block
  (slot k predicts anchor+k+1; speculators-format checkpoints refused for the 1+N layout);
  markov_rank > 0 required, vanilla/gated/rnn heads; `embed_tokens.`, `lm_head.` skipped (the target's
  are used); the confidence head is built and its weights required (unless its ragged verify mode is
  static). LiLiCorr (models/lilicorr.py @ 085551a8) is SGLang PR #37462, not merged: refused.
"""

from __future__ import annotations

import json
import shutil

from specpack.exports import _block, _mtp
from specpack.exports._common import (EngineExport, ExportContext, aux_problems, capture_problems,
                                                embedding_problems, hf_draft_config, midlayer_names,
                                                output_of_layer, quote, save_tensors, write_json)

NAME = "sglang"
CHECKED = "the sglang 0.5.9 and 0.5.10 wheels and main at 001067fffe33"
NGRAM_SINCE = "0.5.10"  # first release with --speculative-ngram-max-trie-depth and no match-window flags
MTP = {"mtp-deepseek": _mtp.EngineMtp("embedding_first", "final_norm_output", "post_norm", "first",
                                      max_layers=1, separate_weights=True),
       "mtp-mimo": _mtp.EngineMtp("hidden_first", "final_norm_output", "post_norm", "first", max_layers=1),
       "mtp-qwen3-next": _mtp.EngineMtp("embedding_first", "final_norm_output", "post_norm", "first",
                                        max_layers=1),
       "mtp-nemotron-h": "SGLang serves it as NemotronHForCausalLMMTP (configs/model_config.py), whose forward was "
                         "not checked against SGLang's source here: export to vLLM, whose nemotron_h_mtp.py was"}
NEXTN = {"DeepseekV3ForCausalLM": "DeepseekV3ForCausalLMNextN",
         "Glm4MoeForCausalLM": "Glm4MoeForCausalLMNextN"}
NEXTN_PREFIX = "model.layers.0."


def limits(manifest, draft_len: int = 1) -> list[str]:
    d = manifest.drafter
    if d.kind == "ngram":
        return []
    if d.kind == "mtp":
        problems = _mtp.problems("SGLang", MTP, manifest, draft_len)
        if d.source_layout == "mtp-deepseek" and manifest.target.architecture not in NEXTN:
            problems.append(f"SGLang has no NextN draft model for {manifest.target.architecture}")
        if d.source_layout == "mtp-qwen3-next" and manifest.target.architecture != "Qwen3NextForCausalLM":
            problems.append(f"SGLang serves {manifest.target.architecture}'s MTP as Qwen3_5ForCausalLMMTP, whose forward "
                            "was not checked against SGLang's source here (Qwen3NextForCausalLMMTP was)")
        return problems
    if d.kind == "block":
        return _block_limits(d)
    if d.kind == "release_dspark":
        if d.source_layout == "deepseek-v41-dspark":
            return ["SGLang has no DeepSeek-V4.1 model in the sources read here: upstream registers no "
                    "DeepseekV41ForCausalLM (a fork's models/deepseek_v41.py does), and its bundled-DSpark rule "
                    "(checkpoint_bundles_dspark_draft) reads dspark_* keys at the config's top level, where V4.1 "
                    "keeps them in text_config"]
        return [] if d.source_layout == "deepseek-v4-dspark" else [
            "SGLang's DSpark path loads Qwen3DSparkModel drafts and the dspark_* stages a target config declares "
            f"({CHECKED}); DSparkMiniMaxDraftModel is in a fork's patch set (models/minimax_m3_dspark.py), not there"]
    if d.kind != "eagle3":
        return [f"SGLang export of {d.kind} drafters is not implemented"]
    problems = capture_problems(manifest, "sglang", "SGLang") + aux_problems(manifest)
    problems += embedding_problems(manifest)
    if 0 in d.aux_hidden_states.layer_ids:
        problems.append("aux layer 0 (the token embeddings) would be id -1 in SGLang's output-of-layer "
                        "ids; SGLang captures it as `hidden_states + residual` before layer 0, where the "
                        "residual is still None, so its first forward fails")
    if d.norm_before_residual:
        problems.append("the head uses norm_before_residual, which SGLang's EAGLE-3 layer lacks")
    if d.embedding_source == "drafter" and d.hidden_size == manifest.target.hidden_size:
        problems.append("the head has its own embedding, but SGLang replaces it with the target's when "
                        "their widths are equal")
    return problems


def write_eagle3(ctx: ExportContext, head: dict, tensors: dict) -> EngineExport:
    ids = output_of_layer(ctx.manifest.drafter.aux_hidden_states.layer_ids)
    write_json(ctx.out / "config.json",
               hf_draft_config(ctx, head, ["LlamaForCausalLMEagle3"], ids))
    save_tensors(ctx.out / "model.safetensors", midlayer_names(tensors))
    flags = {"--speculative-algorithm": "EAGLE3", "--speculative-draft-model-path": ctx.final_out,
             "--speculative-num-steps": ctx.draft_len, "--speculative-eagle-topk": 1,
             "--speculative-num-draft-tokens": ctx.draft_len + 1}
    notes = ["A chain of `--speculative-num-steps` tokens (top-k 1): SGLang counts the verified root "
             "token in `--speculative-num-draft-tokens`. Raise top-k and draft tokens for tree "
             "drafting.", f"Flags checked against {CHECKED}."]
    if ctx.manifest.drafter.embedding_source == "drafter":
        notes.append("The head carries its own `embed_tokens` of its own width; SGLang keeps it because "
                     "`target_hidden_size` differs from `hidden_size`.")
    return EngineExport(_serve(ctx, flags), {"flags": _flat(flags)}, notes, ids, "output_of_layer")


BLOCK = {("dflash", "fill_in"): None, ("dspark", "anchor_first"): None,
         ("dspark", "fill_in"): "SGLang's DSpark drafts DeepSpec's anchor-first block; its 1+N layout is reserved "
                                "for quantized Nemotron 3.5 checkpoints (dflash_utils.py @ 00731f0b)",
         ("dflash", "anchor_first"): "SGLang's DFLASH drafts the fill-in block and its DSPARK requires a Markov head "
                                     "(dspark_config.py @ 01f47623)",
         ("lilicorr", "fill_in"): "SGLang's LiLiCorr model is SGLang PR #37462, not merged"}


def _block_limits(d) -> list[str]:
    problems = _block.algorithm_problems(d, "SGLang", BLOCK) + _block.id_problems(d, "SGLang")
    problems += _block.table_problems(d, "SGLang", False, False, False, False)
    problems += _block.attention_problems(d, "SGLang", causal=False, sliding=True, sinks=True)
    if d.algorithm == "dspark" and not d.markov:
        problems.append("SGLang's DSpark requires markov_rank > 0 (dspark_config.py @ 01f47623)")
    if d.algorithm == "dspark" and not d.confidence:
        problems.append("SGLang's DSpark builds a confidence head and refuses a checkpoint without its weights "
                        "(models/dspark.py @ 01f47623)")
    return problems


def write_block(ctx: ExportContext, head: dict, tensors: dict) -> EngineExport:
    d, D = ctx.manifest.drafter, ctx.draft_len
    arch = "Qwen3DSparkModel" if d.algorithm == "dspark" else "DFlashDraftModel"
    _block.write_draft(ctx, ctx.out, head, tensors, arch)
    flags = {"--speculative-algorithm": "DSPARK" if d.algorithm == "dspark" else "DFLASH",
             "--speculative-draft-model-path": ctx.final_out}
    flags["--speculative-num-draft-tokens"] = D + 1  # the verify window: the anchor and the D draft tokens
    count = f"--speculative-num-draft-tokens {D + 1} (SGLang counts the anchor with the {D} draft tokens)"
    if d.algorithm == "dspark":  # gamma; speculative_hook.py refuses a window other than gamma + 1
        flags["--speculative-dspark-block-size"] = D
        count = f"--speculative-dspark-block-size {D} (gamma, the draft tokens) and {count}"
    write_json(ctx.out / "launch_flags.json", _flat(flags))
    ids = output_of_layer(list(d.target_features.layer_ids))
    notes = ["Flags checked against sgl-project/sglang arg_groups/fields/spec.py at 015c872628e3."]
    return EngineExport(_serve(ctx, flags), {"flags": _flat(flags)}, notes, ids, "output_of_layer",
                        bindings=_block.bindings(ctx, "SGLang", count, ids, "output_of_layer"))


def write_ngram(ctx: ExportContext, head=None, tensors=None) -> EngineExport:
    d, D = ctx.manifest.drafter, ctx.draft_len
    # the trie holds paths of max_trie_depth tokens: a match of max_n tokens must still leave D to propose
    flags = {"--speculative-algorithm": "NGRAM", "--speculative-num-draft-tokens": D + 1,
             "--speculative-ngram-max-trie-depth": d.max_n + D}
    write_json(ctx.out / "launch_flags.json", _flat(flags))
    notes = [f"Needs SGLang {NGRAM_SINCE} or later; flags checked against {CHECKED}. For 0.5.9 and older "
             "replace the trie-depth flag by `--speculative-ngram-min-match-window-size "
             f"{d.min_n} --speculative-ngram-max-match-window-size {d.max_n} "
             f"--speculative-ngram-branch-length {d.max_n + D}` (0.5.10 renamed the last one and removed the "
             "window flags).",
             f"SGLang matches every suffix of the context up to the trie depth ({d.max_n + D} = the "
             f"artifact's longest n-gram {d.max_n} + {D} draft tokens); the artifact's minimum n "
             f"({d.min_n}) has no SGLang setting. Its trie also keeps earlier requests' tokens and may "
             "propose a tree (`--speculative-ngram-max-bfs-breadth 1` keeps it to chains); outputs stay "
             "lossless, only the proposals, and so the speed, can differ from specpack's prompt lookup."]
    return EngineExport(_serve(ctx, flags), {"flags": _flat(flags)}, notes)


def write_mtp(ctx: ExportContext, head=None, tensors=None) -> EngineExport:
    d = ctx.manifest.drafter
    if d.source_layout == "mtp-deepseek":
        draft, reads = ctx.final_out, _write_nextn(ctx)
        notes = ["The NextN checkpoint here is the MTP layer, byte for byte, as SGLang's "
                 "export_deepseek_nextn.py lays it out; SGLang shares the target's embedding and lm_head."]
        if d.location == "target":
            notes.append("SGLang releases that read layer L from the target itself also accept the command "
                         "without --speculative-draft-model-path.")
    else:
        draft, reads = ctx.artifact, _mtp.check_reads(ctx, "SGLang")
        notes = ["No weights are written: SGLang loads the target again as its own MTP draft model."]
    flags = {"--speculative-algorithm": "EAGLE", "--speculative-draft-model-path": draft,
             "--speculative-num-steps": ctx.draft_len, "--speculative-eagle-topk": 1,
             "--speculative-num-draft-tokens": ctx.draft_len + 1}
    if _mtp.remote_code(ctx):
        flags["--trust-remote-code"] = None
    write_json(ctx.out / "launch_flags.json", _flat(flags))
    notes.append("A chain of `--speculative-num-steps` tokens (top-k 1); `NEXTN` is an alias of `EAGLE`.")
    notes.append(f"Flags checked against {CHECKED}.")
    return EngineExport(_serve(ctx, flags), {"flags": _flat(flags)}, notes,
                        bindings=_mtp.bindings(ctx, "SGLang", MTP[d.source_layout], reads))


def _write_nextn(ctx: ExportContext) -> str:
    """The MTP layer as SGLang's NextN draft checkpoint in OUT; returns what it holds, in words."""
    config = json.loads((ctx.artifact / "config.json").read_text())
    config.update(num_hidden_layers=1, architectures=[NEXTN[ctx.manifest.target.architecture]])
    write_json(ctx.out / "config.json", config)
    for code in ctx.artifact.glob("*.py"):  # the config's auto_map, for --trust-remote-code
        shutil.copyfile(code, ctx.out / code.name)
    sources = _mtp.canonical_tensors(ctx)
    names = _mtp.layout_names("mtp-deepseek", list(sources), lambda k: NEXTN_PREFIX)
    _mtp.copy_tensors(ctx.out / "model.safetensors", {names[c]: src for c, src in sources.items()})
    return f"the NextN checkpoint here: `{NEXTN_PREFIX}*` ({len(names)} tensors, `model.safetensors`)"


def _flat(flags: dict) -> dict:
    return {k: "" if v is None else str(v) for k, v in flags.items()}


def write_release_dspark(ctx: ExportContext, head=None, tensors=None) -> EngineExport:
    """SGLang's bundled-DSpark rule (dspark_config.py `checkpoint_bundles_dspark_draft`, speculative_hook.py
    `_handle_dspark`): a target config with dspark_* markers is its own draft; a different draft path is
    refused, and the hook sets the draft tokens to block + 1 itself."""
    d = ctx.manifest.drafter
    flags = {"--speculative-algorithm": "DSPARK"}
    write_json(ctx.out / "launch_flags.json", _flat(flags))
    notes = [f"No weights and no --speculative-draft-model-path: SGLang reads the {d.layers} DSpark stages from the "
             "target itself (a different draft path is refused) and drafts blocks of dspark_block_size "
             f"{d.block_size} (--speculative-num-draft-tokens becomes {d.block_size + 1}).",
             "SGLang refuses bundled DSpark with decode PP > 1 and context parallelism."]
    return EngineExport(_serve(ctx, flags), {"flags": _flat(flags)}, notes)


def _serve(ctx: ExportContext, flags: dict) -> str:
    args = " \\\n  ".join(k if v is None else f"{k} {quote(v)}" for k, v in flags.items())
    return (f"python -m sglang.launch_server --model-path {quote(ctx.artifact)} "
            f"--tp-size {ctx.tensor_parallel} \\\n  {args}")


KINDS = {"eagle3": write_eagle3, "ngram": write_ngram, "mtp": write_mtp, "block": write_block,
         "release_dspark": write_release_dspark}
