"""Llama / Mistral / Qwen2 / Qwen3 / Qwen3-MoE layers (runtime.models.dense) as graph modules: a key and
a value [kv_heads, head_dim] per layer and token."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from specpack.exports.onnx.layers import Block, CacheSlot, attend, linear, mlp_of, param, rms, rope


def cache(spec) -> CacheSlot:
    return CacheSlot(("key", "value"), (spec.num_kv_heads, spec.head_dim))


def rope_parameters(spec):
    """(inv_freq, factor) of the runtime's RoPE tables."""
    from specpack.runtime.models.dense import rope_inv_freq

    return rope_inv_freq(spec.head_dim, spec.rope_theta, spec.rope_scaling), 1.0


def block(layer, spec, seen: dict) -> Block:
    return Block(layer, Attention(layer.self_attn, spec.rms_norm_eps, seen), mlp_of(layer, seen), spec.rms_norm_eps,
                 seen)


class Attention(nn.Module):
    """Fused q/k/v, optional q/k RMSNorm (Qwen3), RoPE, GQA over the cache. -> (y, [k, v] new slots)"""

    def __init__(self, attn, eps: float, seen: dict):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.eps = attn.heads, attn.kv_heads, attn.head_dim, eps
        self.qkv_w, self.qkv_b = linear(attn.qkv_proj, seen)
        self.o_w, self.o_b = linear(attn.o_proj, seen)
        self.q_norm = param(attn.q_norm.weight if attn.q_norm is not None else None, seen)
        self.k_norm = param(attn.k_norm.weight if attn.k_norm is not None else None, seen)

    def project(self, x, cos, sin):
        """x [T, H] -> q [T, heads, hd], k and v [T, kv_heads, hd] (normed and roped as the runtime does)."""
        T, hd = x.shape[0], self.head_dim
        q, k, v = F.linear(x, self.qkv_w, self.qkv_b).split(
            [self.heads * hd, self.kv_heads * hd, self.kv_heads * hd], -1)
        q, k, v = q.reshape(T, self.heads, hd), k.reshape(T, self.kv_heads, hd), v.reshape(T, self.kv_heads, hd)
        if self.q_norm is not None:
            q, k = rms(q, self.q_norm, self.eps), rms(k, self.k_norm, self.eps)
        return rope(q, cos, sin), rope(k, cos, sin), v

    def forward(self, x, cos, sin, mask, past):
        past_k, past_v = past
        q, k, v = self.project(x, cos, sin)
        y = attend(q, k, v, past_k, past_v, mask)
        return F.linear(y, self.o_w, self.o_b), [k, v]
