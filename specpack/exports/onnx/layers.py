"""What every step graph is made of: functional modules over the runtime model's weights (fp32),
the cache passed in and the new slots returned, and how a graph declares itself (`Graph`).

A family module (dense, deepseek) gives `block(layer, spec, seen)`, `cache(spec)` and `rope(spec)`;
`family.of(spec)` picks it. `seen` maps a weight's storage to its parameter, so a tensor used twice
(tied embeddings) becomes one initializer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Graph(NamedTuple):
    """One graph to export: its file, role, module, signature (`io`) and cached layers."""

    file: str
    role: str
    module: nn.Module
    io: tuple[list[tuple], list[tuple]]  # (inputs, outputs) as (name, dtype, shape) with symbolic dims
    num_layers: int
    layer: int | None = None  # mtp_step: which MTP layer
    examples: dict | None = None  # example sizes of symbolic dims for tracing, where the defaults do not fit


@dataclass(frozen=True)
class CacheSlot:
    """What one layer caches per token: one tensor per name, each of `shape`."""

    names: tuple[str, ...]  # ("key", "value"), or ("latent",) for MLA
    shape: tuple[int, ...]


def cache_io(prefix: str, layers: int, slot: CacheSlot, dim: str, single: bool = False) -> list[tuple]:
    """`{prefix}_{name}.{i}` [dim, *slot.shape] per layer and name (no `.{i}` for a one-layer graph)."""
    suffixes = [""] if single else [f".{i}" for i in range(layers)]
    return [(f"{prefix}_{name}{s}", "float32", [dim, *slot.shape]) for s in suffixes for name in slot.names]


def batch_inputs() -> list[tuple]:
    """The inputs every step graph but the block drafter's takes after its own (see `Batch`): T new
    rows of B sequences."""
    return [("tokens", "int64", ["T"]), ("positions", "int64", ["T"]), ("logits_index", "int64", ["K"]),
            ("seq_rows", "int64", ["B", "Q"]), ("row_place", "int64", ["T"]), ("cache_rows", "int64", ["B", "P"]),
            ("mask", "bool", ["B", "Q", "P+Q"])]


class Batch(NamedTuple):
    """Where the T new rows of a many-sequence step graph come from and what they attend.

    Every linear layer runs once over all T rows (the weights stream once per step); attention
    runs per sequence: sequence b's rows padded to Q (`seq_rows` [B, Q]: the row at each of its
    places, any row where it has fewer), its cached keys gathered from the whole cache buffer
    [N, ...] (`cache_rows` [B, P]: the buffer row of each of its P cached positions, any row past
    its length), and `mask` [B, Q, P+Q] saying which of them (then of its new rows) each place
    sees. `row_place` [T] puts each row back: row t was place row_place[t] of the B*Q."""

    seq_rows: Tensor
    row_place: Tensor
    cache_rows: Tensor
    mask: Tensor


# ---- weights ----

def linear_params(module) -> tuple[Tensor, Tensor | None]:
    """(weight [out, in], bias) of a linear layer of the runtime model, whatever kernel it runs on:
    nn.Linear, or a packed layer (kernels.linear: its fp32 weight, rounded or dequantized as the
    kernel computes with it)."""
    w, b = module.weight, getattr(module, "bias", None)
    if hasattr(module, "dense_weight"):
        w = module.dense_weight()
    elif w.dim() == 3:
        w = w.transpose(1, 2).reshape(-1, w.shape[1])[: module.out_features]
    return w.detach(), None if b is None else b.detach()


def param(t: Tensor | None, seen: dict) -> nn.Parameter | None:
    """A parameter sharing `t`'s storage; the same tensor gives the same parameter."""
    if t is None:
        return None
    key = (t.data_ptr(), tuple(t.shape), t.dtype)
    if key not in seen:
        seen[key] = nn.Parameter(t.float(), requires_grad=False)
    return seen[key]


def linear(module, seen: dict) -> tuple[nn.Parameter, nn.Parameter | None]:
    """(weight, bias) parameters of a runtime linear layer."""
    w, b = linear_params(module)
    return param(w, seen), param(b, seen)


# ---- math ----

def rms(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: [T, heads, hd]; cos, sin: [T, 1, hd]
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class Rope(nn.Module):
    """cos, sin [T, 1, hd] of the positions, as the runtime's tables: from `inv_freq`, times `factor` (YaRN)."""

    def __init__(self, inv_freq: Tensor, factor: float = 1.0):
        super().__init__()
        self.factor = factor
        self.register_buffer("inv_freq", inv_freq)

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        ang = positions.float()[:, None] * self.inv_freq[None]  # [T, hd/2]
        emb = torch.cat([ang, ang], dim=-1)[:, None]  # [T, 1, hd]
        if self.factor == 1.0:
            return emb.cos(), emb.sin()
        return emb.cos() * self.factor, emb.sin() * self.factor


def attend(q: Tensor, k: Tensor, v: Tensor, past_k: Tensor, past_v: Tensor, batch: Batch,
           scale: float | None = None) -> Tensor:
    """GQA attention of the T new rows of many sequences (`Batch`), each over its own cached keys
    and its new rows, without concatenating the cache.

    q: [T, heads, hd]; k: [T, kv, hd]; v: [T, kv, vd]; past_k, past_v: the whole cache buffer
    [N, kv, hd | vd] -> [T, heads*vd]. `scale` defaults to 1/sqrt(hd)."""
    heads, hd = q.shape[1], q.shape[2]
    kv, vd = k.shape[1], v.shape[-1]
    G = heads // kv
    B, Q = batch.seq_rows.shape
    scale = 1.0 / math.sqrt(hd) if scale is None else scale
    P = batch.cache_rows.shape[1]
    keys = torch.cat([past_k[batch.cache_rows], k[batch.seq_rows]], 1).permute(0, 2, 3, 1)  # [B, kv, hd, P+Q]
    qg = q[batch.seq_rows].reshape(B, Q, kv, G, hd).permute(0, 2, 3, 1, 4).reshape(B, kv, G * Q, hd) * scale
    scores = qg @ keys  # [B, kv, G*Q, P+Q]
    S = scores.shape[-1]
    scores = scores.reshape(B, kv, G, Q, S).masked_fill(~batch.mask[:, None, None], float("-inf"))
    # softmax as exp(s - max) @ [V | 1], normalised after, the cached and the new keys in two products:
    # each sums its keys in order and its padding (masked: exact zeros) comes last, so a sequence's
    # bits do not depend on the padding its batch adds (see runtime.backends.batch_layout)
    e = (scores - scores.amax(-1, keepdim=True)).exp().reshape(B, kv, G * Q, S)
    y = e[..., :P] @ _with_ones(past_v[batch.cache_rows].transpose(1, 2)) \
        + e[..., P:] @ _with_ones(v[batch.seq_rows].transpose(1, 2))  # [B, kv, G*Q, vd + 1]
    y = y[..., :vd] / y[..., vd:]
    return y.reshape(B, kv, G, Q, vd).permute(0, 3, 1, 2, 4).reshape(B * Q, heads * vd)[batch.row_place]


def _with_ones(x: Tensor) -> Tensor:
    """x [..., d] with a column of ones after: [..., d + 1] (a product with it also sums the weights)."""
    return torch.cat([x, torch.ones_like(x[..., :1])], -1)


class MLP(nn.Module):
    """SwiGLU over the runtime's fused [gate; up] matrix."""

    def __init__(self, mlp, seen: dict):
        super().__init__()
        self.gate_up = param(linear_params(mlp.gate_up_proj)[0], seen)
        self.down = param(linear_params(mlp.down_proj)[0], seen)

    def forward(self, x):
        gate, up = F.linear(x, self.gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down)


class RoutedExperts(nn.Module):
    """Routed experts (and shared ones, where the runtime's module has them): a subclass's `route`
    gives each token's expert ids and weights [T, k]; then each expert, unrolled in expert order, runs
    on only the tokens routed to it (NonZero, Gather) and adds its weighted output back, as the
    runtime's `moe.dispatch`: the work of the routed tokens, nothing dense over all experts."""

    def __init__(self, moe, seen: dict):
        super().__init__()
        self.router = param(moe.gate.weight, seen)
        self.experts = nn.ModuleList(MLP(e, seen) for e in moe.experts)
        shared = getattr(moe, "shared_experts", None)
        self.shared = MLP(shared, seen) if shared is not None else None

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def forward(self, x):
        ids, weights = self.route(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            hit = ids == e  # [T, k]: at most one slot per token
            tok = hit.any(-1).nonzero()[:, 0]  # the tokens routed to expert e
            w = (weights * hit).sum(-1).index_select(0, tok)  # and their weight for it
            out = out.index_add(0, tok, expert(x.index_select(0, tok)) * w[:, None])
        return out + self.shared(x) if self.shared is not None else out


class SoftmaxExperts(RoutedExperts):
    """Qwen3-MoE's experts, routed as `runtime.models.moe.SoftmaxRouter`."""

    def __init__(self, moe, seen: dict):
        super().__init__(moe, seen)
        self.k, self.renormalize = moe.gate.k, moe.gate.renormalize

    def route(self, x):
        weights, ids = F.linear(x, self.router).softmax(-1).topk(self.k, dim=-1)
        return ids, weights / weights.sum(-1, keepdim=True) if self.renormalize else weights


def mlp_of(layer, seen: dict) -> nn.Module:
    """The graph module of a runtime layer's MLP: dense, or Qwen3-MoE's routed experts."""
    from specpack.runtime.models.moe import SparseMoE

    return SoftmaxExperts(layer.mlp, seen) if isinstance(layer.mlp, SparseMoE) else MLP(layer.mlp, seen)


class Block(nn.Module):
    """A pre-norm decoder layer over a family's attention and MLP: the runtime's `Block` /
    `DeepseekBlock` with the cache explicit. forward -> (x [T, H], new cache slots)."""

    def __init__(self, block, attn: nn.Module, mlp: nn.Module, eps: float, seen: dict):
        super().__init__()
        self.eps, self.attn, self.mlp = eps, attn, mlp
        self.ln1 = param(block.input_layernorm.weight, seen)
        self.ln2 = param(block.post_attention_layernorm.weight, seen)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor,
                past: Sequence[Tensor]) -> tuple[Tensor, list[Tensor]]:
        a, new = self.attn(rms(x, self.ln1, self.eps), cos, sin, mask, past)
        x = x + a
        return x + self.mlp(rms(x, self.ln2, self.eps)), new
