"""What the engine exports share: the export context, the canonical head, aux id conventions,
the flat Hugging Face draft config, file writers and the README every export carries."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from specpack._atomic import save_safetensors
from specpack.converters.safetensors_header import TensorMeta, read_header
from specpack.exports._schedule import Crossover
from specpack.schemas import Manifest

README = "README.md"


@dataclass(frozen=True)
class ExportContext:
    artifact: Path  # absolute path of the verified artifact
    manifest: Manifest
    out: Path  # the staging dir being written
    final_out: Path  # absolute path the export will have once renamed (used in commands)
    draft_len: int
    tensor_parallel: int
    crossover: Crossover | None = None  # a validated profile's draft length up to its max concurrency
    schedule_notes: tuple[str, ...] = ()  # README lines on a profile found but not written
    gguf_type: str = "f32"  # llama.cpp: the target GGUF's file type (_gguf.GGUF_TYPES)
    gguf_pre: str | None = None  # llama.cpp: the tokenizer's pre-tokenizer, where its hash does not name it


@dataclass(frozen=True)
class EngineExport:
    """What an engine writer produced, beside the files it wrote into `ctx.out`."""

    command: str
    config_summary: dict
    notes: list[str] = field(default_factory=list)
    aux_layer_ids: list[int] | None = None
    aux_convention: str | None = None
    bindings: list[str] = field(default_factory=list)  # README "Bindings" lines (MTP)
    schedule: list[str] = field(default_factory=list)  # README lines on the draft length by concurrency


def load_head(artifact: Path) -> tuple[dict, dict]:
    """(canonical drafter config, canonical tensors) of an EAGLE-3 or block-drafter artifact."""
    from safetensors.torch import load_file

    drafter = Path(artifact) / "drafter"
    return json.loads((drafter / "config.json").read_text()), load_file(drafter / "model.safetensors")


def output_of_layer(ids_in: list[int]) -> list[int]:
    """Canonical ids count 'input of layer i' (HF hidden_states[i]); engines that count 'output of
    layer i' name the same tensor i - 1."""
    return [i - 1 for i in ids_in]


# target architectures whose model in the engine captures no EAGLE-3 aux hidden states (read in each
# engine's model files; /tmp research notes of session 19: SGLang python/sglang/srt/models, TensorRT-LLM
# tensorrt_llm/_torch/models; vLLM 0.32 model_executor/models SupportsEagle3), or where that was not verified
NO_EAGLE3_CAPTURE = {
    "vllm": {"Glm4MoeForCausalLM": "glm4_moe.py implements no SupportsEagle3",
             "Gemma3ForConditionalGeneration": "gemma3_mm.py implements no SupportsEagle3",
             "Gemma3ForCausalLM": "gemma3.py implements no SupportsEagle3"},
    "sglang": {"NemotronHForCausalLM": "nemotron_h.py has set_dflash_layers_to_capture only",
               "Gemma3ForConditionalGeneration": "gemma3_mm.py neither defines nor delegates set_eagle3_layers_to_capture",
               "Qwen3_5ForConditionalGeneration": "the inherited capture was not seen to reach the Qwen3.5 decoder",
               "Qwen3_5MoeForConditionalGeneration": "the inherited capture was not seen to reach the Qwen3.5 decoder",
               "Mistral3ForConditionalGeneration": "its Llava wrapper was not seen to capture aux states"},
    "trtllm": {"MiniMaxM2ForCausalLM": "modeling_minimaxm2.py captures no hidden states",
               "Gemma3ForCausalLM": "modeling_gemma3.py captures no hidden states",
               "Gemma3ForConditionalGeneration": "modeling_gemma3.py captures no hidden states",
               "Mistral3ForConditionalGeneration": "its inner MistralForCausalLM is no SpecDecOneEngineForCausalLM",
               "GlmMoeDsaForCausalLM": "its Eagle3 registration was not verified"},
}


def capture_problems(manifest: Manifest, engine: str, label: str) -> list[str]:
    """An EAGLE-3 head (or another aux-fed drafter) on a target whose model in `engine` captures no aux
    hidden states: refused, with what was read."""
    why = NO_EAGLE3_CAPTURE.get(engine, {}).get(manifest.target.architecture)
    return [f"{label}'s {manifest.target.architecture} cannot feed a {manifest.drafter.kind} drafter: {why}"] if why else []


def aux_problems(manifest: Manifest, n_aux_fixed: bool = True) -> list[str]:
    """Reasons an engine that captures aux states in layer order (all three do) cannot feed this
    head; `n_aux_fixed`: the engine sizes `fc` for exactly three states."""
    ids = manifest.drafter.aux_hidden_states.layer_ids
    problems = []
    if ids != sorted(ids):
        problems.append(f"aux layer ids {ids} are not ascending, but engines concatenate captured "
                        "states in layer order")
    if n_aux_fixed and len(ids) != 3:
        problems.append(f"the head fuses {len(ids)} hidden states; this engine's EAGLE-3 fc takes 3")
    return problems


def embedding_problems(manifest: Manifest) -> list[str]:
    """A head of another width than the target with no embedding of its own cannot be fed token
    embeddings by any engine (builds refuse it; this guards artifacts built before they did)."""
    d, width = manifest.drafter, manifest.target.hidden_size
    if d.embedding_source == "drafter" or d.hidden_size == width:
        return []
    return [f"the head (hidden {d.hidden_size}) has no embedding of its own and cannot use the target's "
            f"(hidden {width}): rebuild it from a head export that carries its embed_tokens.weight"]


def hf_draft_config(ctx: ExportContext, head: dict, architectures: list[str],
                    aux_output_ids: list[int]) -> dict:
    """A flat Llama config in the EAGLE-3 HF layout (official / SGLang / TRT-LLM readers)."""
    t = ctx.manifest.target
    config = {
        "architectures": architectures, "model_type": "llama",
        "hidden_size": head["hidden_size"], "intermediate_size": head["intermediate_size"],
        "num_attention_heads": head["num_attention_heads"],
        "num_key_value_heads": head["num_key_value_heads"], "head_dim": head["head_dim"],
        "num_hidden_layers": 1, "hidden_act": head["hidden_act"],
        "rms_norm_eps": head["rms_norm_eps"], "rope_theta": head["rope_theta"],
        "max_position_embeddings": max(head["max_position_embeddings"], t.max_position_embeddings),
        "vocab_size": head["target_vocab_size"], "draft_vocab_size": head["draft_vocab_size"],
        "target_hidden_size": head["target_hidden_size"],
        "tie_word_embeddings": False,  # the head has its own lm_head (SGLang would tie otherwise)
        "torch_dtype": ctx.manifest.drafter.dtype,
        "norm_before_residual": head["norm_before_residual"],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_output_ids,
                         "use_aux_hidden_state": True},
    }
    if head.get("rope_scaling"):
        config["rope_scaling"] = head["rope_scaling"]
    return with_quantization(config, head)


def with_quantization(config: dict, head: dict) -> dict:
    """`config` with the drafter's quantization_config as its source stated it (engines pick the
    scheme's kernels from it); unchanged for a float drafter."""
    if head.get("quantization_config"):
        config["quantization_config"] = head["quantization_config"]
    return config


def midlayer_names(tensors: dict) -> dict:
    """Canonical `layers.0.*` → the HF layout's `midlayer.*`; every other name is kept."""
    return {(f"midlayer.{k.removeprefix('layers.0.')}" if k.startswith("layers.0.") else k): v
            for k, v in tensors.items()}


def save_tensors(path: Path, tensors: dict) -> None:
    save_safetensors({k: v.contiguous() for k, v in tensors.items()}, path, metadata={"format": "pt"})


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def quote(value) -> str:
    return shlex.quote(str(value))


# how each engine names a checkpoint's quantization (it reads it from config.json's quantization_config,
# TensorRT-LLM from hf_quant_config.json first): vLLM layers/quantization/{fp8,compressed_tensors,modelopt,
# mxfp4}.py, SGLang's quantization registry, TensorRT-LLM QuantAlgo (families/quant.py's sources)
QUANT_NAMES = {
    "vllm": {"fp8-block": "fp8", "fp8": "fp8", "ct-fp8": "compressed-tensors", "ct-nvfp4": "compressed-tensors",
             "ct-int4": "compressed-tensors", "modelopt-nvfp4": "modelopt_fp4", "modelopt-fp8": "modelopt",
             "modelopt-mixed": "modelopt_mixed", "mxfp4": "gpt_oss_mxfp4", "mxfp8": "modelopt_mxfp8"},
    "sglang": {"fp8-block": "fp8", "fp8": "fp8", "ct-fp8": "compressed-tensors", "ct-nvfp4": "compressed-tensors",
               "ct-int4": "compressed-tensors", "modelopt-nvfp4": "modelopt_fp4", "modelopt-fp8": "modelopt_fp8",
               "modelopt-mixed": "modelopt_mixed", "mxfp4": "mxfp4"},
    "trtllm": {"fp8-block": "FP8_BLOCK_SCALES", "fp8": "FP8", "modelopt-nvfp4": "NVFP4", "modelopt-fp8": "FP8",
               "modelopt-mixed": "MIXED_PRECISION", "mxfp4": "W4A16_MXFP4 (before SM 100), W4A8_MXFP4_MXFP8"},
}


def target_lines(manifest, engine: str) -> list[str]:
    """README lines on the target as its family reads it, and its quantization as `engine` names it."""
    a = manifest.target.arch
    if a is None:
        return []
    from collections import Counter

    kinds = ", ".join(f"{n}× {k}" for k, n in Counter(a.layer_kinds).items())
    lines = ["## Target", "", f"- {manifest.target.architecture} ({a.family} family): {kinds}"]
    if a.experts:
        lines.append(f"- {a.experts.active} of {a.experts.routed} routed experts a token; "
                     f"{a.active_parameters:,} of {a.total_parameters:,} parameters active")
    if a.quantization:
        lines.append(f"- {quantization_line(a.quantization, engine)}")
    return lines + [""]


def quantization_line(q, engine: str, whose: str = "the checkpoint's") -> str:
    """A quantized checkpoint (a target's or a drafter's) as `engine` names its scheme."""
    name = QUANT_NAMES.get(engine, {}).get(q.scheme)
    return (f"quantized: {q.scheme} ({q.quant_method}; {q.quantized_linear} linear weights packed, "
            f"{q.unquantized_linear} kept float, every packed weight and scale checked at build); "
            + (f"{engine} reads it from {whose} config as `{name}`" if name else
               f"no {engine} name for it was checked: see the engine's quantization support"))


def write_readme(ctx: ExportContext, engine: str, export: EngineExport) -> None:
    d = ctx.manifest.drafter
    files = sorted(p.relative_to(ctx.out).as_posix() for p in ctx.out.rglob("*") if p.is_file())
    lines = [f"# {ctx.manifest.name}: {d.kind} drafter exported for {engine}", "",
             f"Exported by specpack from the verified artifact `{ctx.artifact}` (format "
             f"v{ctx.manifest.format_version}). The target is that artifact directory itself: "
             "engines load it as the plain model.", "", "## Serve", "", "```bash",
             export.command, "```", ""]
    if export.aux_layer_ids is not None and d.kind == "eagle3":
        lines += [f"Aux hidden states: layers {export.aux_layer_ids}, counted as "
                  f"*{export.aux_convention.replace('_', ' ')} i* ({engine}'s convention; the "
                  f"artifact states {d.aux_hidden_states.layer_ids} as input of layer i).", ""]
    lines += target_lines(ctx.manifest, engine)
    if getattr(d, "quantization", None):
        lines += ["## Drafter", "", "- " + quantization_line(d.quantization, engine, "the draft") +
                  "; weights and scales carried bit for bit, `quantization_config` as the source states it", ""]
    if export.bindings:
        lines += ["## Bindings", ""] + [f"- {b}" for b in export.bindings] + [""]
    schedule = list(ctx.schedule_notes) + export.schedule
    if schedule:
        lines += ["## Draft length by concurrency", ""] + [f"- {s}" for s in schedule] + [""]
    lines += ["## Scale-out", "",
              f"`{ctx.tensor_parallel}` is the tensor-parallel size used above; set it to the GPUs "
              "per replica (it must divide the target's attention heads and KV heads). The drafter "
              "runs on every rank; pipeline parallelism and multi-node launch follow the engine's "
              "own flags.", ""]
    lines += ["## Files", ""] + [f"- `{f}`" for f in files + [README]] + [""]
    if export.notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in export.notes] + [""]
    (ctx.out / README).write_text("\n".join(lines))


def target_tensors(ctx) -> dict[str, tuple[Path, TensorMeta]]:
    """Every tensor of the artifact's target shards, from their headers (nothing loaded): name -> (the
    safetensors file, its header entry)."""
    out = {}
    for rel in ctx.manifest.target.weight_files:
        if rel.endswith(".safetensors"):
            out.update({n: (ctx.artifact / rel, m) for n, m in read_header(ctx.artifact / rel).items()})
    return out
