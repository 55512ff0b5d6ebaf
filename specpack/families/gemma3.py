"""Gemma 3 (`gemma3` wrapping `gemma3_text`, and text-only `gemma3_text`): sliding-window layers with a
full layer every `sliding_window_pattern`-th (or as `layer_types` states), per-head q/k norms, four norms
per layer (stored zero-centred), dense GeGLU MLPs, the lm_head tied to the embedding. A published
multimodal checkpoint keeps its decoder under `language_model.model.` (v5 re-saves:
`model.language_model.`), the SigLIP tower and projector carried untouched. Its `text_config` states
few keys: the rest are transformers' defaults, filled in here. No MTP. Sources: transformers
models/gemma3 (configuration :73-158, modeling :132, :468), vLLM models/gemma3.py :153-185,
gemma3_mm.py :515-523."""

from __future__ import annotations

from specpack.families.base import (Arch, Layer, Tensor, architecture_of, attention_tensors, embedding_tensors,
                                    geometry, layer_types, mlp_tensors, vector)

MODEL_TYPES = ("gemma3", "gemma3_text")
ARCHITECTURES = ("Gemma3ForConditionalGeneration", "Gemma3ForCausalLM")
PREFIXES = ("language_model.model.", "model.language_model.", "model.")
# Gemma3TextConfig's defaults (transformers configuration_gemma3.py :73-98), for the keys a published
# text_config leaves out
DEFAULTS = dict(hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
                num_key_value_heads=4, head_dim=256, vocab_size=262208, max_position_embeddings=131072,
                sliding_window=4096)


def describe(config: dict, text: dict) -> Arch:
    text = {**DEFAULTS, **text}
    g = geometry(text, ("intermediate_size", "head_dim"))
    every, window = text.get("sliding_window_pattern") or 6, text.get("sliding_window")
    kinds = layer_types(text, g["num_layers"], lambda i: "sliding_attention" if (i + 1) % every else "full_attention")
    layers = tuple(Layer("sliding", "dense", window) if k == "sliding_attention" else Layer("full", "dense")
                   for k in kinds)
    nested = "text_config" in config
    p = PREFIXES[0] if nested else "model."
    tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
    return Arch("gemma3", architecture_of(config), config.get("model_type", "gemma3"), layers=layers,
                text_config=nested, prefix=p, embed=p + "embed_tokens.weight", norm=p + "norm.weight",
                lm_head=None if tied else "lm_head.weight", kv_width=2 * g["num_kv_heads"] * g["head_dim"],
                details={"prefixes": PREFIXES if nested else ("model.",)}, **g)


def tensors(arch: Arch, fused: bool = False) -> dict[str, Tensor]:
    H, out = arch.hidden_size, embedding_tensors(arch)
    for i in range(arch.num_layers):
        p = f"{arch.prefix}layers.{i}."
        out.update({p + f"{n}.weight": vector(H) for n in ("input_layernorm", "post_attention_layernorm",
                                                             "pre_feedforward_layernorm", "post_feedforward_layernorm")})
        out.update(attention_tensors(p + "self_attn.", H, arch.num_heads, arch.num_kv_heads, arch.head_dim,
                                     qk_norm="head"))
        out.update(mlp_tensors(p + "mlp.", H, arch.intermediate_size))
    return out
