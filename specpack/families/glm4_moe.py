"""GLM-4.5 / 4.6 / 4.7 (`glm4_moe`): grouped-query attention with q/k/v biases and optional per-head q/k
norms, the first `first_k_dense_replace` layers dense and the rest mixtures of experts (sigmoid router
with a correction bias, shared experts), and MTP layers in DeepSeek's naming at `model.layers.{L+k}`
(`num_nextn_predict_layers`). `head_dim` must be stated (5120 / 96 is no integer). Sources:
transformers models/glm4_moe (configuration :87-119, modeling :181, :402), vLLM models/glm4_moe.py
:141-150, :344, :353-357 and glm4_moe_mtp.py :98-128."""

from __future__ import annotations

from specpack.families.base import (Arch, Experts, Layer, Mtp, Tensor, architecture_of, attention_tensors,
                                    embedding_tensors, geometry, mlp_tensors, sigmoid_moe_tensors, vector)
from specpack.families import deepseek_mtp

MODEL_TYPES = ("glm4_moe",)
ARCHITECTURES = ("Glm4MoeForCausalLM",)


def describe(config: dict, text: dict) -> Arch:
    g = geometry(text, ("head_dim", "intermediate_size", "moe_intermediate_size"))
    routed, shared = text.get("n_routed_experts") or 0, text.get("n_shared_experts") or 0
    experts = Experts(routed, text.get("num_experts_per_tok") or 0, text["moe_intermediate_size"], shared,
                      shared * text["moe_intermediate_size"])
    dense = text.get("first_k_dense_replace") or 0
    layers = tuple(Layer("full", "moe" if routed and i >= dense else "dense") for i in range(g["num_layers"]))
    n = text.get("num_nextn_predict_layers") or 0
    mtp = Mtp(n, "mtp-deepseek", "model.layers.{n}.", "num_nextn_predict_layers", "embedding_first") if n else None
    return Arch("glm4_moe", architecture_of(config), config.get("model_type", "glm4_moe"), layers=layers,
                experts=experts, mtp=mtp, kv_width=2 * g["num_kv_heads"] * g["head_dim"],
                lm_head=None if config.get("tie_word_embeddings") else "lm_head.weight",
                details={"attention_bias": bool(text.get("attention_bias")), "qk_norm": bool(text.get("use_qk_norm"))},
                **g)


def layer_tensors(arch: Arch, p: str, moe: bool) -> dict[str, Tensor]:
    H = arch.hidden_size
    out = {p + "input_layernorm.weight": vector(H), p + "post_attention_layernorm.weight": vector(H)}
    out.update(attention_tensors(p + "self_attn.", H, arch.num_heads, arch.num_kv_heads, arch.head_dim,
                                 bias=arch.details["attention_bias"],
                                 qk_norm="head" if arch.details["qk_norm"] else None))
    m = p + "mlp."
    return {**out, **(sigmoid_moe_tensors(m, H, arch.experts) if moe else mlp_tensors(m, H, arch.intermediate_size))}


def tensors(arch: Arch, fused: bool = False) -> dict[str, Tensor]:
    out = embedding_tensors(arch)
    for i, layer in enumerate(arch.layers):
        out.update(layer_tensors(arch, f"{arch.prefix}layers.{i}.", layer.mlp == "moe"))
    return out


def mtp_fusion(arch: Arch, k: int) -> dict[str, str]:
    return deepseek_mtp.fusion(arch, k)


def mtp_block(arch: Arch, k: int, fused: bool = False) -> tuple[str, dict[str, Tensor]]:
    """MTP module k's decoder layer: a MoE layer at L + k."""
    p = deepseek_mtp.prefix(arch, k)
    return p, layer_tensors(arch, p, arch.experts.routed > 0)
