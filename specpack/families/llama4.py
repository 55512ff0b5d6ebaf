"""Llama 4 (`Llama4ForConditionalGeneration`, decoder `llama4_text` in `text_config`): chunked local
attention on the RoPE layers (`no_rope_layers[i]` 1) and global NoPE attention on every fourth, a
mixture of experts every `interleave_moe_layer_step`-th layer (fused experts stored
`gate_up_proj [E, H, 2I]`, `down_proj [E, I, H]`, a shared expert, a router) and dense
`intermediate_size_mlp` MLPs between. Tensors under `language_model.model.` (v5 re-saves:
`model.language_model.`); the vision tower and projector are carried untouched. No MTP. Sources:
transformers models/llama4 (configuration :129-191, modeling :62-80, :403-407), vLLM models/llama4.py
:185-265, :340-357, :400-585, mllama4.py :1244-1253."""

from __future__ import annotations

from specpack.errors import InputError
from specpack.families.base import (Arch, Experts, Layer, Tensor, architecture_of, attention_tensors,
                                    embedding_tensors, expert_tensors, geometry, mlp_tensors, vector)

MODEL_TYPES = ("llama4", "llama4_text")
ARCHITECTURES = ("Llama4ForConditionalGeneration", "Llama4ForCausalLM")
PREFIXES = ("language_model.model.", "model.language_model.", "model.")


def describe(config: dict, text: dict) -> Arch:
    g = geometry(text, ("intermediate_size",), ("intermediate_size_mlp",))
    n, step = g["num_layers"], text.get("interleave_moe_layer_step") or 1
    rope, moe = _rope_layers(text, n), _moe_layers(text, n, step)
    chunk = text.get("attention_chunk_size")
    experts = Experts(text.get("num_local_experts") or 0, text.get("num_experts_per_tok") or 0,
                      g["intermediate_size"], 1, g["intermediate_size"])
    layers = tuple(Layer("chunked" if rope[i] and chunk else "full", "moe" if i in moe else "dense",
                         chunk if rope[i] and chunk else None) for i in range(n))
    nested = "text_config" in config
    p = PREFIXES[0] if nested else "model."
    head = "language_model.lm_head.weight" if nested else "lm_head.weight"
    return Arch("llama4", architecture_of(config), config.get("model_type", "llama4"), layers=layers,
                experts=experts, text_config=nested, prefix=p, embed=p + "embed_tokens.weight", norm=p + "norm.weight",
                lm_head=None if text.get("tie_word_embeddings") else head,
                kv_width=2 * g["num_kv_heads"] * g["head_dim"],
                details={"mlp_size": text.get("intermediate_size_mlp") or g["intermediate_size"],
                         "prefixes": PREFIXES if nested else ("model.",)}, **g)


def _rope_layers(text: dict, n: int) -> list[int]:
    """`no_rope_layers` (1: a RoPE layer), one per layer, else every `no_rope_layer_interval`-th NoPE
    (transformers' Llama4TextConfig.__post_init__)."""
    stated = text.get("no_rope_layers")
    if not stated:
        every = text.get("no_rope_layer_interval") or 4
        return [int((i + 1) % every != 0) for i in range(n)]
    if len(stated) != n or any(v not in (0, 1) for v in stated):
        raise InputError(f"text_config.no_rope_layers lists {len(stated)} entries {str(stated)[:60]}: it must hold one "
                         f"0 or 1 per decoder layer ({n})", hint="is this the release's own config.json?")
    return stated


def _moe_layers(text: dict, n: int, step: int) -> set[int]:
    """`moe_layers` (the MoE layers' indices), else every `interleave_moe_layer_step`-th layer."""
    stated = text.get("moe_layers")
    if stated is None:
        return set(range(step - 1, n, step))
    bad = [v for v in stated if v >= n]
    if bad:
        raise InputError(f"text_config.moe_layers names layers {bad[:8]} the model does not have (0..{n - 1})",
                         hint="is this the release's own config.json?")
    return set(stated)


def tensors(arch: Arch, fused: bool = True) -> dict[str, Tensor]:
    H, out = arch.hidden_size, embedding_tensors(arch)
    for i, layer in enumerate(arch.layers):
        p = f"{arch.prefix}layers.{i}."
        out.update({p + "input_layernorm.weight": vector(H), p + "post_attention_layernorm.weight": vector(H)})
        out.update(attention_tensors(p + "self_attn.", H, arch.num_heads, arch.num_kv_heads, arch.head_dim))
        f = p + "feed_forward."
        if layer.mlp == "dense":
            out.update(mlp_tensors(f, H, arch.details["mlp_size"]))
            continue
        out[f + "router.weight"] = Tensor((arch.experts.routed, H))
        out.update(expert_tensors(f + "experts.", H, arch.experts, fused, transposed=True))
        out.update(mlp_tensors(f + "shared_expert.", H, arch.experts.shared_size))
    return out
