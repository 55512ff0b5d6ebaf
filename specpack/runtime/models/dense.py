"""Our compact decoder for Llama / Mistral / Qwen2 / Qwen3 (SmolLM is Llama), gpt-fast style.

One forward runs the new tokens of one or many sequences (`rows.Rows`) against a static KV cache
with one slot per sequence; each row attends its own sequence's committed positions plus a chain or
a tree among its new rows, so drafts of every sequence in a batch are verified in one pass.
Rolling back after a rejection only lowers a sequence's length: positions past it are never
attended and get overwritten by the next forward (a draft tree's accepted path is first moved next
to the prefix: `KVCache.compact`).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specpack.errors import InputError
from specpack.families.dense import RopeScaling, TargetSpec
from specpack.runtime.models.moe import SparseMoE
from specpack.runtime.models.rows import Rows, Segment, attend


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
    """Keys and values of `layers` layers for `slots` sequences, preallocated:
    [layers, slots, kv_heads, max_len, head_dim].

    `length` is slot 0's committed positions, for the single-sequence `forward`; the batched engine
    keeps one length per slot itself. Roll back by assigning a smaller length."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, max_len: int, dtype, device, slots: int = 1):
        super().__init__()
        shape = (layers, slots, kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.length = 0

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def slots(self) -> int:
        return self.k.shape[1]

    @torch.inference_mode()
    def compact(self, slot: int, src: Sequence[int], dst: Sequence[int]) -> None:
        """Move `slot`'s rows at positions `src` to `dst` in every layer (a verified tree's accepted
        path to the positions after the committed prefix; src >= dst, both ascending)."""
        s, d = torch.as_tensor(src, device=self.k.device), torch.as_tensor(dst, device=self.k.device)
        for cache in (self.k, self.v):
            if cache is not None:  # MLA's latent cache has no values
                cache[:, slot, :, d] = cache[:, slot, :, s]


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

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor, rows: Rows) -> Tensor:
        # x: [R, dim_in]; cos, sin: [R, 1, hd]; k_cache, v_cache: [slots, kv_heads, max_len, hd] (this layer)
        R, hd = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.heads * hd, self.kv_heads * hd, self.kv_heads * hd], -1)
        q, k, v = q.view(R, self.heads, hd), k.view(R, self.kv_heads, hd), v.view(R, self.kv_heads, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # each row into its own sequence's slot: [R, kv_heads, hd] (rounded to the cache's dtype)
        k_cache[rows.slot, :, rows.write] = k.to(k_cache.dtype)
        v_cache[rows.slot, :, rows.write] = v.to(v_cache.dtype)
        y = attend(q, k_cache, v_cache, rows)  # [R, heads, hd]
        return self.o_proj(y.reshape(R, self.heads * hd))


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
    """A decoder layer; `mlp`: a dense MLP, or the routed experts (moe.SparseMoE) on a Qwen3-MoE layer."""

    def __init__(self, s: TargetSpec, mlp: nn.Module | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.self_attn = Attention(s.hidden_size, s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim,
                                   s.attention_bias, s.o_proj_bias, s.rms_norm_eps if s.qk_norm else None)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.mlp = mlp if mlp is not None else MLP(s.hidden_size, s.intermediate_size)

    def forward(self, x, cos, sin, k_cache, v_cache, rows: Rows):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, rows)
        return x + self.mlp(self.post_attention_layernorm(x))


class Output(NamedTuple):
    logits: Tensor  # [K, V] fp32: the rows asked for (all T, or the last one with last_only)
    aux: Tensor | None  # [T, len(capture)·H]: hidden states entering the captured layers, concatenated


def embedding(num: int, dim: int) -> nn.Embedding:
    """nn.Embedding(num, dim), initialized as torch does, except on the meta device (a model about to be loaded):
    there torch's normal_ runs its Python decomposition, which imports ~800 modules (67 MiB, once a process) for
    values nobody reads."""
    if torch.empty(0).is_meta:
        return nn.Embedding(num, dim, _weight=torch.empty(num, dim))
    return nn.Embedding(num, dim)


class Decoder(nn.Module):
    """What our decoders share: embeddings, a stack of layers over a slotted cache, final norm and
    head; the forward over `Rows`. Subclasses build `layers` and implement `new_cache` and
    `_rope_tables`. Call `setup_cache` before a forward."""

    def __init__(self, spec):
        super().__init__()
        self.spec = spec
        self.embed_tokens = embedding(spec.vocab_size, spec.hidden_size)
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.cache = None
        self.kv_dtype: torch.dtype | None = None  # the KV cache's elements (None: the model's dtype)
        self.fused = None  # kernels.layers.FusedLayers when the layers run as C calls (see fuse_layers)
        self.screen = None  # kernels.screen.GreedyScreen over lm_head, for rows only an argmax reads
        self.register_buffer("cos", None, persistent=False)  # [max_len, rope dims] RoPE tables, with the cache
        self.register_buffer("sin", None, persistent=False)

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.kv_dtype or self.dtype

    @torch.inference_mode()
    def setup_cache(self, max_len: int, slots: int = 1) -> None:
        """Make room for `slots` sequences of `max_len` positions (reallocating only when either
        grows, or the cache's dtype changed) and empty the cache."""
        c = self.cache
        if c is None or c.max_len < max_len or c.slots < slots or c.k.dtype != self.cache_dtype:
            self.cache = None  # free the old one first
            self.cache = self.new_cache(len(self.layers), max_len, slots)
            self.cos, self.sin = self._rope_tables(max_len)
        self.cache.length = 0

    @torch.inference_mode()
    def forward(self, tokens: Tensor, positions: Tensor | None = None, mask: Tensor | None = None,
                capture: Sequence[int] = (), last_only: bool = False) -> Output:
        """One sequence (cache slot 0): T new tokens after the cached ones, filling positions
        length..length+T-1. positions: [T] RoPE positions (default: those); mask: [T, T] bool among
        the new tokens (default causal; a tree passes its ancestor mask); capture: layer ids whose
        *input* hidden state to return (transformers' `hidden_states[i]`; 0 = embeddings, the
        number of layers = the last layer's output before the final norm)."""
        start, T = self.cache.length, tokens.shape[0]
        rows = Rows.of([Segment(0, start, T, mask, positions)], self.device)
        out = self.forward_rows(tokens, rows, capture, [T - 1] if last_only else None)
        self.cache.length = start + T
        return out

    @torch.inference_mode()
    def forward_rows(self, tokens: Tensor, rows: Rows, capture: Sequence[int] = (),
                     logits_rows: Sequence[int] | None = None, greedy_rows: Sequence[int] = ()) -> Output:
        """The new tokens [R] of every segment of `rows` in one pass; logits of `logits_rows` (all
        when None). Each segment must fit its slot: start + T <= max_len. `greedy_rows` (indices
        into the logits) are rows only an argmax reads: with a screen (`screen_head`) they come
        back with their argmax's logit and its few rivals exact, -inf elsewhere."""
        self._check_fits(rows)
        x = self.embed_tokens(tokens)  # [R, H]
        x, aux = (self._fused_layers if self.fused is not None else self._layers)(x, rows, capture)
        if logits_rows is not None:
            x = x[torch.as_tensor(logits_rows, dtype=torch.long, device=x.device)]
        return Output(self.head(self.norm(x), greedy_rows), aux)

    def head(self, x: Tensor, greedy_rows: Sequence[int] = ()) -> Tensor:
        """lm_head over final-normed rows x [K, H] -> fp32 logits; `greedy_rows` as in `forward_rows`."""
        if self.screen is not None and len(greedy_rows):
            return self.screen.logits(x, greedy_rows)
        return self.lm_head(x).float()

    def screen_head(self) -> bool:
        """Let greedy rows skip most of the head (kernels/screen.py) where it runs on the packed
        kernel; True when they now do."""
        from specpack.runtime.kernels.screen import GreedyScreen

        self.screen = GreedyScreen.of(self.lm_head)
        return self.screen is not None

    def compact(self, slot: int, src: Sequence[int], dst: Sequence[int]) -> None:
        """Move cache rows of `slot` from positions `src` to `dst` (KVCache.compact)."""
        self.cache.compact(slot, src, dst)

    def _check_fits(self, rows: Rows) -> None:
        c = self.cache
        bad = [f"slot {s.slot}: {s.start + s.T} positions" for s, _ in rows.segments
               if s.start + s.T > c.max_len or not 0 <= s.slot < c.slots]
        if bad:
            raise InputError(f"rows do not fit the KV cache of {c.slots} slot(s) x {c.max_len} positions",
                             problems=bad, hint="call setup_cache with a larger max_len or more slots")

    def _layers(self, x: Tensor, rows: Rows, capture: Sequence[int]) -> tuple[Tensor, Tensor | None]:
        """Every layer over x [R, H] as modules: the last layer's output, and the inputs of the
        layers in `capture` (len(layers): the output) side by side, [R, len(capture)·H] (None
        without a capture)."""
        cos, sin = self.cos[rows.pos, None], self.sin[rows.pos, None]  # [R, 1, rope dims]
        captured = {}
        for i, layer in enumerate(self.layers):
            if i in capture:
                captured[i] = x
            x = self._layer(i, layer, x, cos, sin, rows)
        captured[len(self.layers)] = x
        return x, torch.cat([captured[i] for i in capture], dim=-1) if capture else None

    def _fused_layers(self, x: Tensor, rows: Rows, capture: Sequence[int]) -> tuple[Tensor, Tensor | None]:
        """`_layers` in one C call, which copies the captured inputs as it reaches them (no call per
        stretch between captures, no copies of x to keep: a return to Python mid-forward waits for
        the GIL behind a server's HTTP threads)."""
        step = self.fused.step(rows, self.cos, self.sin, self.cache)
        aux = x.new_empty(len(x), len(capture) * x.shape[1]) if capture else None
        return self.fused.layers(x, step, 0, len(self.layers), capture, aux), aux  # x: updated in place

    def _layer(self, i: int, layer: nn.Module, x: Tensor, cos: Tensor, sin: Tensor, rows: Rows) -> Tensor:
        return layer(x, cos, sin, self.cache.k[i], self.cache.v[i], rows)

    def new_cache(self, layers: int, max_len: int, slots: int = 1):
        raise NotImplementedError

    def _rope_tables(self, max_len: int) -> tuple[Tensor, Tensor]:
        raise NotImplementedError


class Transformer(Decoder):
    """The Llama-family target (and draft models; Qwen3-MoE with its experts). Call `setup_cache(max_len)`
    before `forward`."""

    def __init__(self, spec: TargetSpec):
        super().__init__(spec)
        s = spec
        self.layers = nn.ModuleList(
            Block(s, SparseMoE(s.hidden_size, s.moe_intermediate_size, s.experts, s.experts_per_tok, s.norm_topk_prob,
                               MLP) if s.is_moe(i) else None) for i in range(s.num_layers))

    def fuse_layers(self) -> bool:
        """Run each layer as a few C calls (kernels/layers.py) when every linear layer of the model
        runs on the packed CPU kernel; True when it now does."""
        from specpack.runtime.kernels.layers import FusedLayers

        self.fused = FusedLayers.of(self.spec, self.layers)
        return self.fused is not None

    def new_cache(self, layers: int, max_len: int, slots: int = 1) -> KVCache:
        s = self.spec
        return KVCache(layers, s.num_kv_heads, s.head_dim, max_len, self.cache_dtype, self.device, slots)

    def _rope_tables(self, max_len: int) -> tuple[Tensor, Tensor]:
        s = self.spec
        return rope_tables(rope_inv_freq(s.head_dim, s.rope_theta, s.rope_scaling), max_len, self.dtype, self.device)
