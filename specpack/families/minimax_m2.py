"""MiniMax-M2 / M2.1 / M2.5 / M2.7 (`minimax_m2`): full attention with q/k RMSNorm over the whole
projection (not per head), every layer a mixture of experts named `block_sparse_moe.experts.{e}.w1/w2/w3`
with a sigmoid router and correction bias; no shared expert. Its config advertises MTP modules
(`use_mtp`, `num_mtp_modules`) whose weights were not published (MiniMax-M2#47): an MTP drafter is
refused, EAGLE-3 and n-gram serve it. Sources: transformers models/minimax_m2 (configuration :71-100,
modeling :292-308, :341-350), vLLM models/minimax_m2.py :84-117, :215-230, :374-380."""

from __future__ import annotations

from specpack.families.base import (Arch, Experts, Layer, Tensor, architecture_of, attention_tensors,
                                    embedding_tensors, expert_tensors, geometry, vector)

MODEL_TYPES = ("minimax_m2",)
ARCHITECTURES = ("MiniMaxM2ForCausalLM",)
NAMES = ("w1", "w3", "w2")  # gate, up, down


def describe(config: dict, text: dict) -> Arch:
    g = geometry(text, ("intermediate_size",))
    experts = Experts(text.get("num_local_experts") or text.get("num_experts") or 0,
                      text.get("num_experts_per_tok") or 0, g["intermediate_size"])
    layers = tuple(Layer("full", "moe") for _ in range(g["num_layers"]))
    return Arch("minimax_m2", architecture_of(config), config.get("model_type", "minimax_m2"), layers=layers,
                experts=experts, kv_width=2 * g["num_kv_heads"] * g["head_dim"],
                lm_head=None if config.get("tie_word_embeddings") else "lm_head.weight",
                details={"advertised_mtp": text.get("num_mtp_modules") if text.get("use_mtp") else 0}, **g)


def tensors(arch: Arch, fused: bool = False) -> dict[str, Tensor]:
    H, out = arch.hidden_size, embedding_tensors(arch)
    for i in range(arch.num_layers):
        p = f"{arch.prefix}layers.{i}."
        out.update({p + "input_layernorm.weight": vector(H), p + "post_attention_layernorm.weight": vector(H)})
        out.update(attention_tensors(p + "self_attn.", H, arch.num_heads, arch.num_kv_heads, arch.head_dim,
                                     qk_norm="full"))
        m = p + "block_sparse_moe."
        out.update({m + "gate.weight": Tensor((arch.experts.routed, H)),
                    m + "e_score_correction_bias": vector(arch.experts.routed)})
        out.update(expert_tensors(m + "experts.", H, arch.experts, fused, NAMES))
    return out
