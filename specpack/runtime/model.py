"""Our compact decoder for Llama / Mistral / Qwen2 / Qwen3 (SmolLM is Llama), gpt-fast style.

One forward runs T new tokens against a static KV cache with an explicit mask, so a chain of drafts
or a tree of them is verified in one pass. Rolling back after a rejection only lowers the cache's
length pointer: slots past it are never attended and get overwritten by the next forward.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specpack.errors import InputError
from specpack.runtime.config import RopeScaling, TargetSpec


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # normalise in fp32, scale in the model dtype (as transformers does)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> Tensor:
    """Inverse frequencies [head_dim/2], fp32, with Llama-3 or linear scaling (transformers' formulas)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate in between
    old_len, lo, hi = scaling.original_max_position_embeddings, scaling.low_freq_factor, scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / lo, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < old_len / hi) * ~(wavelen > old_len / lo)
    return torch.where(medium, smoothed, scaled)


def rope_tables(inv_freq: Tensor, max_len: int, dtype, device) -> tuple[Tensor, Tensor]:
    """cos, sin: [max_len, head_dim] for positions 0..max_len-1 (half-split layout)."""
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)  # [S, hd/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(device, dtype), emb.sin().to(device, dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: [T, heads, hd]; cos, sin: [T, 1, hd]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class KVCache(nn.Module):
    """Keys and values of `layers` layers: [layers, 1, kv_heads, max_len, head_dim], preallocated.

    `length` = slots holding committed tokens. Roll back by assigning a smaller `length`."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, max_len: int, dtype, device):
        super().__init__()
        shape = (layers, 1, kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("slots", torch.arange(max_len, device=device), persistent=False)
        self.length = 0

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def mask(self, T: int, block: Tensor | None) -> Tensor | None:
        """Which cache slots each of T new tokens (about to fill slots length..length+T) may attend:
        every committed slot, plus `block` [T, T] among the new ones (causal when None)."""
        start = self.length
        if block is None:
            if T == 1:
                return None  # one token sees everything: no mask needed
            return self.slots[None, : start + T] <= self.slots[start : start + T, None]  # [T, S]
        return torch.cat([block.new_ones(T, start), block], dim=1)  # [T, S]


class Attention(nn.Module):
    """Multi-head attention with GQA, fused q/k/v, optional q/k RMSNorm (Qwen3) and RoPE."""

    def __init__(self, dim_in: int, dim_out: int, heads: int, kv_heads: int, head_dim: int,
                 qkv_bias: bool = False, o_bias: bool = False, qk_norm_eps: float | None = None):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.qkv_proj = nn.Linear(dim_in, (heads + 2 * kv_heads) * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(heads * head_dim, dim_out, bias=o_bias)
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps else None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                start: int, mask: Tensor | None) -> Tensor:
        # x: [T, dim_in]; k_cache, v_cache: [1, kv_heads, max_len, hd] (this layer's slice)
        T, hd = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.heads * hd, self.kv_heads * hd, self.kv_heads * hd], -1)
        q, k, v = q.view(T, self.heads, hd), k.view(T, self.kv_heads, hd), v.view(T, self.kv_heads, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        end = start + T
        k_cache[0, :, start:end] = k.transpose(0, 1)  # [kv_heads, T, hd]
        v_cache[0, :, start:end] = v.transpose(0, 1)
        # q: [1, heads, T, hd] against keys/values [1, kv_heads, end, hd]
        y = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k_cache[:, :, :end], v_cache[:, :, :end],
                                           attn_mask=mask, enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(y[0].transpose(0, 1).reshape(T, self.heads * hd))


class MLP(nn.Module):
    """SwiGLU with gate and up fused into one matrix: [gate; up] = [2·I, H]."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(dim, 2 * hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, s: TargetSpec):
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.self_attn = Attention(s.hidden_size, s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim,
                                   s.attention_bias, s.o_proj_bias, s.rms_norm_eps if s.qk_norm else None)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.mlp = MLP(s.hidden_size, s.intermediate_size)

    def forward(self, x, cos, sin, k_cache, v_cache, start, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, start, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Output(NamedTuple):
    logits: Tensor  # [T, V] fp32 (or [1, V] with last_only)
    aux: Tensor | None  # [T, len(capture)·H]: hidden states entering the captured layers, concatenated


class Transformer(nn.Module):
    """The target decoder. Call `setup_cache(max_len)` before `forward`."""

    def __init__(self, spec: TargetSpec):
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(Block(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.cache: KVCache | None = None
        self.register_buffer("cos", None, persistent=False)  # [max_len, hd] RoPE tables, with the cache
        self.register_buffer("sin", None, persistent=False)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @torch.inference_mode()
    def setup_cache(self, max_len: int) -> None:
        """Make room for `max_len` positions (reallocating only when it grows) and empty the cache."""
        s = self.spec
        if self.cache is None or self.cache.max_len < max_len:
            self.cache = KVCache(s.num_layers, s.num_kv_heads, s.head_dim, max_len, self.dtype, self.device)
            inv_freq = rope_inv_freq(s.head_dim, s.rope_theta, s.rope_scaling)
            self.cos, self.sin = rope_tables(inv_freq, max_len, self.dtype, self.device)
        self.cache.length = 0

    @torch.inference_mode()
    def forward(self, tokens: Tensor, positions: Tensor | None = None, mask: Tensor | None = None,
                capture: Sequence[int] = (), last_only: bool = False) -> Output:
        """Run T new tokens after the cached ones; they fill cache slots length..length+T.

        tokens: [T] ids; positions: [T] (default: their slots); mask: [T, T] bool among the new
        tokens (default causal; a tree passes its ancestor mask); capture: layer ids whose *input*
        hidden state to return (transformers' `hidden_states[i]`; 0 = embeddings)."""
        cache, T = self.cache, tokens.shape[0]
        start = cache.length
        if start + T > cache.max_len:
            raise InputError(f"{start + T} positions do not fit the KV cache of {cache.max_len}",
                             hint="call setup_cache with a larger max_len")
        if positions is None:
            positions = cache.slots[start : start + T]
        cos, sin = self.cos[positions, None], self.sin[positions, None]  # [T, 1, hd]
        attn_mask = cache.mask(T, mask)
        x = self.embed_tokens(tokens)  # [T, H]
        captured = {}
        for i, layer in enumerate(self.layers):
            if i in capture:
                captured[i] = x
            x = layer(x, cos, sin, cache.k[i], cache.v[i], start, attn_mask)
        cache.length = start + T
        if last_only:
            x = x[-1:]
        logits = self.lm_head(self.norm(x)).float()
        aux = torch.cat([captured[i] for i in capture], dim=-1) if capture else None
        return Output(logits, aux)
