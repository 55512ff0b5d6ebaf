"""TensorRT-LLM (PyTorch backend): an EAGLE-3 draft directory plus `extra-llm-api-config.yml`
with its `speculative_config`; n-gram as `decoding_type: NGram`; MTP inside a DeepSeek-V3 / GLM-4.5
target as `decoding_type: MTP` (config only).

Sources followed:
- tensorrt_llm/llmapi/llm_args.py: `DecodingBaseConfig.speculative_model` (alias
  `speculative_model_dir`, written here because both old and new releases accept it),
  `max_draft_len`; `EagleDecodingConfig` / `Eagle3DecodingConfig` (`decoding_type: Eagle3`,
  `eagle3_one_model`, `eagle3_layers_to_capture`: "Defaults to {1, num_layers//2-1,
  num_layers-4}", i.e. *output of layer i*; a set, so states are taken in layer order; -1 means
  the final post-norm state); `NGramDecodingConfig` (`max_matching_ngram_size`).
- tensorrt_llm/_torch/models/modeling_speculative.py: `Eagle3DraftModel` reads the HF layout
  (`midlayer.*`, or `layers.0.*` remapped), sizes `fc` as target hidden × number of captured
  layers, shares the target's embedding when the head's width equals the target's, keeps the
  un-normed residual (no `norm_before_residual`), and loads `d2t` when the vocabularies differ.
- trtllm-serve: `--backend pytorch`, `--tp_size`, `--extra_llm_api_options`, `--trust_remote_code`.
- MTP. llm_args.py `MTPDecodingConfig`: `decoding_type: MTP`, `num_nextn_predict_layers` (= the
  draft length, `max_draft_len`), `use_mtp_vanilla`; one checkpoint layer and no vanilla: MTP Eagle
  (the layer repeated), else vanilla (step k runs checkpoint layer k mod n).
  docs/source/models/supported-models.md: MTP "Yes" for DeepseekV3ForCausalLM and Glm4MoeForCausalLM,
  "No" for Qwen3NextForCausalLM; no MiMo model.
- _torch/models/modeling_deepseekv3.py `DeepseekV3MTP.forward`: `eh_proj(cat(enorm(emb), hnorm(h)))`
  and returns `shared_head.norm(hidden, residual)` (post-norm, what the next step receives); the
  target model's last layer fuses the final norm, so layer 0 gets the final-norm output; MTP layers
  are read from the target checkpoint (`model.layers.{L+k}.*`), embedding and head shared.
"""

from __future__ import annotations

from specpack.converters.export import _mtp
from specpack.converters.export._common import (EngineExport, ExportContext, aux_problems,
                                                hf_draft_config, midlayer_names, output_of_layer,
                                                quote, save_tensors, write_json)

NAME = "trtllm"
CONFIG = "extra-llm-api-config.yml"
DRAFT_DIR = "draft"
MTP = {"mtp-deepseek": _mtp.EngineMtp("embedding_first", "final_norm_output", "post_norm", "mod"),
       "mtp-qwen3-next": "TensorRT-LLM's support matrix lists no MTP for Qwen3NextForCausalLM",
       "mtp-mimo": "TensorRT-LLM has no MiMo model"}
MTP_ARCHS = ("DeepseekV3ForCausalLM", "Glm4MoeForCausalLM")


def limits(manifest, draft_len: int = 1) -> list[str]:
    d = manifest.drafter
    if d.kind == "ngram":
        return []
    if d.kind == "mtp":
        problems = _mtp.problems("TensorRT-LLM", MTP, manifest, draft_len)
        if d.source_layout == "mtp-deepseek" and manifest.target.architecture not in MTP_ARCHS:
            problems.append(f"TensorRT-LLM runs MTP for {', '.join(MTP_ARCHS)} only")
        return problems
    if d.kind != "eagle3":
        return [f"TensorRT-LLM export of {d.kind} drafters is not implemented"]
    problems = aux_problems(manifest, n_aux_fixed=False)
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
    _write_yaml(ctx, spec)
    notes = ["`eagle3_layers_to_capture` counts *output of layer i* and is a set: TensorRT-LLM "
             "concatenates the captured states in layer order, as the head was trained."]
    return EngineExport(_serve(ctx), {"speculative_config": spec}, notes, ids, "output_of_layer")


def write_ngram(ctx: ExportContext, head=None, tensors=None) -> EngineExport:
    d = ctx.manifest.drafter
    spec = {"decoding_type": "NGram", "max_draft_len": ctx.draft_len,
            "max_matching_ngram_size": d.max_n}
    _write_yaml(ctx, spec)
    notes = [f"TensorRT-LLM matches n-grams from {d.max_n} tokens down to 1; the artifact's "
             f"minimum n ({d.min_n}) has no TensorRT-LLM setting. Outputs stay lossless; only the "
             "proposals, and so the speed, can differ."]
    return EngineExport(_serve(ctx), {"speculative_config": spec}, notes)


def write_mtp(ctx: ExportContext, head=None, tensors=None) -> EngineExport:
    spec = {"decoding_type": "MTP", "num_nextn_predict_layers": ctx.draft_len}
    _write_yaml(ctx, spec)
    reads = _mtp.check_reads(ctx, "TensorRT-LLM")
    notes = ["No weights are written: TensorRT-LLM builds the MTP module from the target checkpoint "
             "(one-model MTP); `num_nextn_predict_layers` is the number of draft tokens per step."]
    how = MTP[ctx.manifest.drafter.source_layout]
    return EngineExport(_serve(ctx, _mtp.remote_code(ctx)), {"speculative_config": spec}, notes,
                        bindings=_mtp.bindings(ctx, "TensorRT-LLM", how, reads))


def _write_yaml(ctx: ExportContext, spec: dict) -> None:
    import yaml

    (ctx.out / CONFIG).write_text(yaml.safe_dump({"speculative_config": spec}, sort_keys=False))


def _serve(ctx: ExportContext, trust_remote_code: bool = False) -> str:
    remote = " --trust_remote_code" if trust_remote_code else ""
    return (f"trtllm-serve {quote(ctx.artifact)} --backend pytorch --tp_size {ctx.tensor_parallel}{remote} "
            f"\\\n  --extra_llm_api_options {quote(ctx.final_out / CONFIG)}")


KINDS = {"eagle3": write_eagle3, "ngram": write_ngram, "mtp": write_mtp}
