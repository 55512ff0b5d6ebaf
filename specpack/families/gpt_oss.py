"""gpt-oss (`gpt_oss`): attention with q/k/v/o biases and a learned sink logit per head, layers
alternating sliding (even) and full (odd) as `layer_types` states, every layer a mixture of experts
with a biased router (`mlp.router`) and fused expert tensors: unquantized `gate_up_proj [E, H, 2I]`,
`down_proj [E, I, H]` (stored in, out), or as published in MXFP4 `gate_up_proj_blocks/_scales` (see
quant.py) beside bf16 `gate_up_proj_bias [E, 2I]`, `down_proj_bias [E, H]`. No MTP; EAGLE-3 heads are
its drafters. Sources: transformers models/gpt_oss (configuration :51-97, modeling :74-129), vLLM
models/gpt_oss.py :176, :640-688, :1416-1444."""

from __future__ import annotations

from specpack.families.base import (Arch, Experts, Layer, Tensor, architecture_of, attention_tensors,
                                    embedding_tensors, expert_tensors, geometry, layer_types, vector)

MODEL_TYPES = ("gpt_oss",)
ARCHITECTURES = ("GptOssForCausalLM",)


def describe(config: dict, text: dict) -> Arch:
    g = geometry(text, ("intermediate_size", "head_dim"))
    experts = Experts(text.get("num_local_experts") or text.get("num_experts") or 0,
                      text.get("num_experts_per_tok") or text.get("experts_per_token") or 0, g["intermediate_size"])
    window = text.get("sliding_window")
    kinds = layer_types(text, g["num_layers"], lambda i: "sliding_attention" if i % 2 == 0 else "full_attention")
    layers = tuple(Layer("sliding", "moe", window) if k == "sliding_attention" else Layer("full", "moe") for k in kinds)
    return Arch("gpt_oss", architecture_of(config), config.get("model_type", "gpt_oss"), layers=layers,
                experts=experts, kv_width=2 * g["num_kv_heads"] * g["head_dim"],
                lm_head=None if config.get("tie_word_embeddings") else "lm_head.weight", **g)


def tensors(arch: Arch, fused: bool = True) -> dict[str, Tensor]:
    H, E, out = arch.hidden_size, arch.experts.routed, embedding_tensors(arch)
    for i in range(arch.num_layers):
        p = f"{arch.prefix}layers.{i}."
        out.update({p + "input_layernorm.weight": vector(H), p + "post_attention_layernorm.weight": vector(H),
                    p + "self_attn.sinks": vector(arch.num_heads), p + "mlp.router.weight": Tensor((E, H)),
                    p + "mlp.router.bias": vector(E), p + "mlp.experts.gate_up_proj_bias": vector(2 * arch.experts.size, E),
                    p + "mlp.experts.down_proj_bias": vector(H, E)})
        out.update(attention_tensors(p + "self_attn.", H, arch.num_heads, arch.num_kv_heads, arch.head_dim,
                                     bias=True, o_bias=True))
        out.update(expert_tensors(p + "mlp.experts.", H, arch.experts, fused=True, transposed=True))
    return out
