"""Qwen3-Next (`qwen3_next`) and Qwen3.5 / 3.6 (`qwen3_5`, `qwen3_5_moe`): hybrid decoders of Gated
DeltaNet linear-attention layers and gated full-attention layers (q_proj doubled: query and gate per
head), `layer_types` or one full layer every `full_attention_interval`; Qwen3-Next and Qwen3.5-MoE
route every layer through experts plus a gated shared expert, Qwen3.5 is dense. MTP modules live at
top-level `mtp.*` (fc [H, 2H] over cat(norm(embedding), norm(hidden)): embedding first; one full-attention
layer each). Qwen3.5 nests its decoder in `text_config`, tensors under `model.language_model.` (text-only
exports: `model.`), `lm_head` and `mtp.*` at the top.

Linear-attention tensors differ: Qwen3-Next fuses `in_proj_qkvz` / `in_proj_ba` grouped per key head,
Qwen3.5 keeps `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a` flat. Sources: transformers
models/qwen3_next (configuration :88-133, modeling :241-302, :643-741, :936-975), models/qwen3_5
(configuration :81-118, modeling :555-598, :836-866); vLLM qwen3_next_mtp.py :63-158, qwen3_5_mtp.py
:82-164, layers/mamba/mamba_utils.py :280-300 (the recurrent state)."""

from __future__ import annotations

from specpack.families.base import (Arch, Experts, Layer, Mtp, Tensor, architecture_of, attention_tensors,
                                    check_sizes, embedding_tensors, expert_tensors, geometry, is_moe, layer_types,
                                    mlp_tensors, vector)

MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text")
ARCHITECTURES = ("Qwen3NextForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
                 "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")
LINEAR = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
          "linear_conv_kernel_dim")


def describe(config: dict, text: dict) -> Arch:
    g = geometry(text, ("head_dim",))
    check_sizes(text, LINEAR)
    model_type = config.get("model_type", "qwen3_next")
    next_ = model_type == "qwen3_next"
    moe = next_ or "moe" in model_type
    routed = (text.get("num_experts") or text.get("num_local_experts") or 0) if moe else 0
    experts = Experts(routed, text.get("num_experts_per_tok") or 0, text.get("moe_intermediate_size") or 0, 1,
                      text.get("shared_expert_intermediate_size") or 0) if moe else None
    every = text.get("full_attention_interval") or 4
    kinds = layer_types(text, g["num_layers"], lambda i: "full_attention" if (i + 1) % every == 0 else "linear_attention",
                        ("full_attention", "linear_attention"))
    layers = tuple(Layer("full" if kind == "full_attention" else "linear",
                         "moe" if moe and (not next_ or is_moe(text, i, routed)) else "dense")
                   for i, kind in enumerate(kinds))
    nk, nv, dk, dv, K = (text[k] for k in LINEAR)
    conv = 2 * nk * dk + nv * dv
    key = "num_nextn_predict_layers" if next_ else "mtp_num_hidden_layers"
    n = text.get(key, None if next_ else 0)  # Qwen3-Next's config states none: counted from the checkpoint
    mtp = Mtp(n or 0, "mtp-qwen3-next", "mtp.layers.{k}.", key, "embedding_first") if n != 0 else None
    nested = "text_config" in config
    tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    return Arch("qwen3_next", architecture_of(config), model_type, layers=layers, experts=experts, mtp=mtp,
                text_config=nested, kv_width=2 * g["num_kv_heads"] * g["head_dim"],
                conv_state=conv * (K - 1), ssm_state=nv * dv * dk, ssm_bytes=_ssm_bytes(text),
                lm_head=None if tied else "lm_head.weight",
                **_prefix("model.language_model." if nested else "model."),
                details={"fused_linear": next_, "linear": (nk, nv, dk, dv, K),
                         "prefixes": ("model.language_model.", "model.") if nested else ("model.",)}, **g)


def _ssm_bytes(text: dict) -> int:
    """Qwen3.5 states mamba_ssm_dtype float32 (vLLM keeps the SSM state so); Qwen3-Next none (the model dtype)."""
    return 4 if text.get("mamba_ssm_dtype") == "float32" else 0


def _prefix(p: str) -> dict:
    return dict(prefix=p, embed=p + "embed_tokens.weight", norm=p + "norm.weight")


def linear_attention_tensors(arch: Arch, p: str) -> dict[str, Tensor]:
    H, (nk, nv, dk, dv, K) = arch.hidden_size, arch.details["linear"]
    key, value = nk * dk, nv * dv
    if arch.details["fused_linear"]:
        proj = {p + "in_proj_qkvz.weight": Tensor((2 * key + 2 * value, H), True),
                p + "in_proj_ba.weight": Tensor((2 * nv, H), True)}
    else:
        proj = {p + "in_proj_qkv.weight": Tensor((2 * key + value, H), True), p + "in_proj_z.weight": Tensor((value, H), True),
                p + "in_proj_b.weight": Tensor((nv, H), True), p + "in_proj_a.weight": Tensor((nv, H), True)}
    return {**proj, p + "conv1d.weight": Tensor((2 * key + value, 1, K)), p + "dt_bias": vector(nv),
            p + "A_log": vector(nv), p + "norm.weight": vector(dv), p + "out_proj.weight": Tensor((H, value), True)}


def layer_tensors(arch: Arch, p: str, layer: Layer, fused: bool) -> dict[str, Tensor]:
    H = arch.hidden_size
    out = {p + "input_layernorm.weight": vector(H), p + "post_attention_layernorm.weight": vector(H)}
    if layer.attention == "linear":
        out.update(linear_attention_tensors(arch, p + "linear_attn."))
    else:
        out.update(attention_tensors(p + "self_attn.", H, arch.num_heads, arch.num_kv_heads, arch.head_dim,
                                     q_rows=2 * arch.num_heads * arch.head_dim, qk_norm="head"))
    if layer.mlp == "dense":
        return {**out, **mlp_tensors(p + "mlp.", H, arch.intermediate_size)}
    e = arch.experts
    out.update({p + "mlp.gate.weight": Tensor((e.routed, H)), p + "mlp.shared_expert_gate.weight": Tensor((1, H))})
    out.update(expert_tensors(p + "mlp.experts.", H, e, fused))
    return {**out, **mlp_tensors(p + "mlp.shared_expert.", H, e.shared_size)}


def tensors(arch: Arch, fused: bool = False) -> dict[str, Tensor]:
    out = embedding_tensors(arch)
    for i, layer in enumerate(arch.layers):
        out.update(layer_tensors(arch, f"{arch.prefix}layers.{i}.", layer, fused))
    return out


def mtp_fusion(arch: Arch, k: int) -> dict[str, str]:
    """Shared by every module: one fc and its norms (vLLM qwen3_next_mtp.py :65-113)."""
    return {"embed_norm": "mtp.pre_fc_norm_embedding.weight", "hidden_norm": "mtp.pre_fc_norm_hidden.weight",
            "proj": "mtp.fc.weight", "final_norm": "mtp.norm.weight"}


def mtp_block(arch: Arch, k: int, fused: bool = False) -> tuple[str, dict[str, Tensor]]:
    """Module k's layer: full attention, the family's MLP."""
    p = f"mtp.layers.{k}."
    return p, layer_tensors(arch, p, Layer("full", "moe" if arch.experts else "dense"), fused)
