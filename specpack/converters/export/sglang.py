"""SGLang: EAGLE-3 heads in the `LlamaForCausalLMEagle3` layout; n-gram as `--speculative-algorithm
NGRAM`; MTP as `--speculative-algorithm EAGLE` (what `NEXTN` becomes), DeepSeek/GLM with a NextN
draft checkpoint written here, Qwen3-Next reading its `mtp.*` layers from the target.

Sources followed:
- python/sglang/srt/models/llama_eagle3.py: `midlayer.*`, `fc` sized `target_hidden_size * 3`,
  `d2t` read as hot-token offsets, `t2d` skipped, `tie_word_embeddings` makes lm_head the embedding
  (so it is written false), and the decoder layer keeps the un-normed residual (no
  `norm_before_residual`).
- EAGLE worker `set_embed(target embed)`: SGLang always gives the head the target's embedding, so a
  head with its own, different embedding cannot be served faithfully.
- models/llama.py `set_eagle3_layers_to_capture`: ids from
  `eagle_config.eagle_aux_hidden_state_layer_ids` are shifted `+1` ("for the ith layer, it takes
  the output of the (i-1)th layer"), i.e. SGLang's ids count *output of layer i*.
- server_args.py: `--speculative-algorithm EAGLE3|NGRAM`, `--speculative-draft-model-path`,
  `--speculative-num-steps`, `--speculative-eagle-topk`, `--speculative-num-draft-tokens`,
  `--speculative-ngram-{min,max}-match-window-size`, `--tp`.
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
"""

from __future__ import annotations

import json
import shutil

from specpack.converters.export import _mtp
from specpack.converters.export._common import (EngineExport, ExportContext, aux_problems,
                                                hf_draft_config, midlayer_names, output_of_layer,
                                                quote, save_tensors, write_json)

NAME = "sglang"
MTP = {"mtp-deepseek": _mtp.EngineMtp("embedding_first", "final_norm_output", "post_norm", "first",
                                      max_layers=1, separate_weights=True),
       "mtp-mimo": _mtp.EngineMtp("hidden_first", "final_norm_output", "post_norm", "first", max_layers=1),
       "mtp-qwen3-next": _mtp.EngineMtp("embedding_first", "final_norm_output", "post_norm", "first",
                                        max_layers=1)}
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
        return problems
    if d.kind != "eagle3":
        return [f"SGLang export of {d.kind} drafters is not implemented"]
    problems = aux_problems(manifest)
    if d.norm_before_residual:
        problems.append("the head uses norm_before_residual, which SGLang's EAGLE-3 layer lacks")
    if d.embedding_source == "drafter":
        problems.append("the head has its own embedding, but SGLang always uses the target's")
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
             "drafting."]
    return EngineExport(_serve(ctx, flags), {"flags": _flat(flags)}, notes, ids, "output_of_layer")


def write_ngram(ctx: ExportContext, head=None, tensors=None) -> EngineExport:
    d = ctx.manifest.drafter
    flags = {"--speculative-algorithm": "NGRAM", "--speculative-num-draft-tokens": ctx.draft_len + 1,
             "--speculative-ngram-min-match-window-size": d.min_n,
             "--speculative-ngram-max-match-window-size": d.max_n}
    write_json(ctx.out / "launch_flags.json", _flat(flags))
    notes = ["SGLang's n-gram drafter keeps a trie of earlier matches and may propose a tree; "
             "outputs stay lossless, only speed can differ from specpack's prompt lookup."]
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


def _serve(ctx: ExportContext, flags: dict) -> str:
    args = " \\\n  ".join(k if v is None else f"{k} {quote(v)}" for k, v in flags.items())
    return (f"python -m sglang.launch_server --model-path {quote(ctx.artifact)} "
            f"--tp {ctx.tensor_parallel} \\\n  {args}")


KINDS = {"eagle3": write_eagle3, "ngram": write_ngram, "mtp": write_mtp}
