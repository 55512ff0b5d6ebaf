"""Qwen3-MoE (`qwen3_moe`, e.g. Qwen3-30B-A3B): Qwen3 attention (q/k norms per head), every layer a
mixture of experts unless `mlp_only_layers` or `decoder_sparse_step` make it dense; no shared expert,
no MTP. Unquantized, it runs in specpack's runtime (runtime/models/moe.py). Sources: transformers
models/qwen3_moe (configuration :77-107, modeling :129, :310-315), vLLM models/qwen3_moe.py :387-391."""

from __future__ import annotations

from specpack.families import dense
from specpack.families.base import (Arch, Experts, Layer, Tensor, architecture_of, attention_tensors,
                                    embedding_tensors, expert_tensors, geometry, is_moe, mlp_tensors, vector)

MODEL_TYPES = ("qwen3_moe",)
ARCHITECTURES = ("Qwen3MoeForCausalLM",)


def describe(config: dict, text: dict) -> Arch:
    g = geometry(text, ("moe_intermediate_size",))
    routed = text.get("num_experts") or text.get("num_local_experts") or 0
    experts = Experts(routed, text.get("num_experts_per_tok") or 0, text["moe_intermediate_size"])
    window = text.get("sliding_window") if text.get("use_sliding_window") else None
    layers = tuple(Layer("sliding" if window else "full", "moe" if is_moe(text, i, routed) else "dense", window)
                   for i in range(g["num_layers"]))
    return Arch("qwen3_moe", architecture_of(config), config.get("model_type", "qwen3_moe"), layers=layers,
                experts=experts, kv_width=2 * g["num_kv_heads"] * g["head_dim"],
                lm_head=None if config.get("tie_word_embeddings") else "lm_head.weight",
                details={"attention_bias": bool(text.get("attention_bias"))}, runs=dense.runs(config), **g)


def tensors(arch: Arch, fused: bool = False) -> dict[str, Tensor]:
    H, out = arch.hidden_size, embedding_tensors(arch)
    for i, layer in enumerate(arch.layers):
        p = f"{arch.prefix}layers.{i}."
        out.update({p + "input_layernorm.weight": vector(H), p + "post_attention_layernorm.weight": vector(H)})
        out.update(attention_tensors(p + "self_attn.", H, arch.num_heads, arch.num_kv_heads, arch.head_dim,
                                     bias=arch.details["attention_bias"], qk_norm="head"))
        if layer.mlp == "moe":
            out[p + "mlp.gate.weight"] = Tensor((arch.experts.routed, H))
            out.update(expert_tensors(p + "mlp.experts.", H, arch.experts, fused))
        else:
            out.update(mlp_tensors(p + "mlp.", H, arch.intermediate_size))
    return out
