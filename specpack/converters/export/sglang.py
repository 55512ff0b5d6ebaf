"""SGLang: EAGLE-3 heads in the `LlamaForCausalLMEagle3` layout; n-gram as `--speculative-algorithm
NGRAM`.

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
"""

from __future__ import annotations

from specpack.converters.export._common import (EngineExport, ExportContext, aux_problems,
                                                hf_draft_config, midlayer_names, output_of_layer,
                                                quote, save_tensors, write_json)

NAME = "sglang"


def limits(manifest) -> list[str]:
    d = manifest.drafter
    if d.kind == "ngram":
        return []
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


def _flat(flags: dict) -> dict:
    return {k: str(v) for k, v in flags.items()}


def _serve(ctx: ExportContext, flags: dict) -> str:
    args = " \\\n  ".join(f"{k} {quote(v)}" for k, v in flags.items())
    return (f"python -m sglang.launch_server --model-path {quote(ctx.artifact)} "
            f"--tp {ctx.tensor_parallel} \\\n  {args}")


KINDS = {"eagle3": write_eagle3, "ngram": write_ngram}
