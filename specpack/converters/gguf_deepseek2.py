"""llama.cpp's `deepseek2` GGUF layout (DeepSeek-V2/V3; GLM-4.7-Flash with its nextn block), as the
llama.cpp the llama-cpp-python 0.3.36 sdist vendors names it: tensor names from `gguf-py/gguf/
constants.py` (MODEL_ARCH.DEEPSEEK2's tensors) and `tensor_mapping.py` (the Hugging Face names each is
converted from), the conversion rules from `conversion/deepseek.py` DeepseekV2Model (experts stacked
into one 3-D tensor per projection; `kv_b_proj` split into `attn_k_b`, transposed, and `attn_v_b`;
`e_score_correction_bias` as `exp_probs_b.bias`; one MQA KV head) and `conversion/glm.py`
Glm4MoeLiteModel (the nextn block kept as `blk.{L+k}.nextn.*` after the L trunk blocks, with
`{arch}.nextn_predict_layers`), and what `src/models/deepseek2.cpp` loads.

GGUF leaf -> Hugging Face leaf under `model.layers.{i}.` (weights, `.weight` on both sides), read both
ways: the llama.cpp export writes with it inverted.
"""

from __future__ import annotations

import numpy as np

ARCH = "deepseek2"
GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
          "output.weight": "lm_head.weight"}
BLOCK = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_q_a": "self_attn.q_a_proj",
         "attn_q_a_norm": "self_attn.q_a_layernorm", "attn_q_b": "self_attn.q_b_proj",
         "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa", "attn_kv_a_norm": "self_attn.kv_a_layernorm",
         "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
         "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
         "ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
         "ffn_up_shexp": "mlp.shared_experts.up_proj", "ffn_down_shexp": "mlp.shared_experts.down_proj"}
# the nextn (MTP) block's own tensors; its attention and MoE use BLOCK's names
NEXTN = {"nextn.eh_proj": "eh_proj", "nextn.enorm": "enorm", "nextn.hnorm": "hnorm",
         "nextn.embed_tokens": "embed_tokens", "nextn.shared_head_head": "shared_head.head",
         "nextn.shared_head_norm": "shared_head.norm"}
EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
ROUTER_BIAS = ("exp_probs_b.bias", "mlp.gate.e_score_correction_bias")  # (GGUF leaf, HF leaf): no .weight
KV_B = ("attn_k_b", "attn_v_b", "self_attn.kv_b_proj")


def split_kv_b(kv_b: np.ndarray, heads: int, nope: int, v_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """kv_b_proj [heads * (nope + v), lora] -> (k_b [heads, lora, nope], v_b [heads, v, lora]), as
    DeepseekV2Model.modify_tensors splits it for MLA's absorbed form."""
    if kv_b.shape[0] != heads * (nope + v_dim):
        raise ValueError(f"kv_b_proj has {kv_b.shape[0]} rows, expected heads {heads} x (nope {nope} + v {v_dim})")
    per_head = kv_b.reshape(heads, nope + v_dim, kv_b.shape[-1])
    return np.ascontiguousarray(per_head[:, :nope].swapaxes(1, 2)), np.ascontiguousarray(per_head[:, nope:])


def join_kv_b(k_b: np.ndarray, v_b: np.ndarray) -> np.ndarray:
    """The inverse of split_kv_b: (k_b [heads, lora, nope], v_b [heads, v, lora]) -> kv_b_proj."""
    per_head = np.concatenate([k_b.swapaxes(1, 2), v_b], axis=1)
    return per_head.reshape(-1, per_head.shape[-1])
