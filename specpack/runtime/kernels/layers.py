"""A dense decoder layer (Llama / Mistral / Qwen2 / Qwen3) as nine C calls over every row of a
batched forward, instead of ~40 torch ops and nine module calls.

    RMSNorm ─ q/k/v ─ RoPE + KV-cache write ─ attention ─ o_proj + residual
    RMSNorm ─ gate/up ─ SiLU·up ─ down + residual

At one row per forward the torch ops between the matrix products cost several milliseconds per
token in dispatch alone, more than the products themselves take with int8 weights. Row-exact like
every kernel here (a row's result does not depend on the other rows). RoPE and the residual adds
give the same bits as the torch ops they replace; RMSNorm and SiLU differ from torch's in the last
bits (another summation order for the mean of squares, another exp polynomial), within fp32
rounding. `SPECPACK_FUSED=0` keeps the module path (for comparison).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
from torch import Tensor

from specpack.runtime.kernels._lib import _library, available, default_threads

MAX_HEAD_DIM = 1024  # sp_rope_cache's scratch


def enabled() -> bool:
    return os.environ.get("SPECPACK_FUSED", "1").strip().lower() not in ("0", "false", "no", "off")


class _Layer(NamedTuple):
    in_norm: Tensor
    post_norm: Tensor
    q_norm: Tensor | None
    k_norm: Tensor | None
    qkv: object  # PackedLinear
    o: object
    gate_up: object
    down: object


class Step(NamedTuple):
    """What every layer of one forward shares: the rows' slots, positions and masks as C arrays."""
    R: int
    cos: Tensor  # [R, hd]
    sin: Tensor
    slot: Tensor  # int64 [R]
    write: Tensor
    ctx: Tensor
    end: Tensor
    mask: Tensor | None  # uint8 [R, W]


class FusedLayers:
    """The layers of a dense `Transformer` whose linear layers all run on the packed kernel; made
    by `of`, which says None where they cannot run fused."""

    def __init__(self, model):
        s = model.spec
        self.lib = _library()[0]
        self.heads, self.kv_heads, self.hd = s.num_heads, s.num_kv_heads, s.head_dim
        self.hidden, self.inter, self.eps = s.hidden_size, s.intermediate_size, float(s.rms_norm_eps)
        self.scale = self.hd ** -0.5
        self.threads = default_threads()
        self.layers = [_layer(b) for b in model.layers]

    @classmethod
    def of(cls, model) -> "FusedLayers | None":
        if not (enabled() and available() and model.spec.head_dim <= MAX_HEAD_DIM and model.dtype == torch.float32
                and model.device.type == "cpu"):
            return None
        packed = [getattr(m, "packed", None) for b in model.layers
                  for m in (b.self_attn.qkv_proj, b.self_attn.o_proj, b.mlp.gate_up_proj, b.mlp.down_proj)]
        if not all(p is not None and p.backend == "avx2" for p in packed):
            return None
        return cls(model)

    def step(self, rows, cos: Tensor, sin: Tensor) -> Step:
        """The per-forward arrays for `rows`; cos, sin: the model's [max_len, hd] tables."""
        i64 = [t.to(torch.int64).contiguous() for t in (rows.slot, rows.write, rows.ctx, rows.end)]
        mask = None if rows.mask is None else rows.mask.to(torch.uint8).contiguous()
        return Step(rows.count, cos[rows.pos].contiguous(), sin[rows.pos].contiguous(), *i64, mask)

    def layer(self, i: int, x: Tensor, st: Step, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        """Layer i over the rows x [R, hidden]; k_cache, v_cache: its [slots, kv_heads, max_len, hd]."""
        L, lib, R, H = self.layers[i], self.lib, st.R, self.hidden
        h = self._norm(x, L.in_norm)
        qkv = L.qkv(h)  # [R, (heads + 2 kv_heads) * hd]
        ldq = qkv.shape[1]
        kp, vp, strides = k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride()[:3]
        lib.sp_rope_cache(qkv.data_ptr(), R, ldq, self.heads, self.kv_heads, self.hd, st.cos.data_ptr(),
                          st.sin.data_ptr(), self.hd, _ptr(L.q_norm), _ptr(L.k_norm), self.eps, kp, vp, *strides,
                          st.slot.data_ptr(), st.write.data_ptr())
        a = torch.empty(R, self.heads * self.hd)
        lib.sp_attention(qkv.data_ptr(), R, self.heads, ldq, kp, vp, self.kv_heads, *strides, self.hd, self.hd,
                         st.slot.data_ptr(), st.ctx.data_ptr(), st.end.data_ptr(), _ptr(st.mask),
                         0 if st.mask is None else st.mask.shape[1], self.scale, a.data_ptr(), self.heads * self.hd,
                         self.threads)
        x = L.o(a, residual=x)
        gu = L.gate_up(self._norm(x, L.post_norm))
        m = torch.empty(R, self.inter)
        lib.sp_silu_mul(gu.data_ptr(), R, self.inter, 2 * self.inter, m.data_ptr(), self.inter)
        return L.down(m, residual=x)

    def _norm(self, x: Tensor, w: Tensor) -> Tensor:
        y = torch.empty_like(x)
        self.lib.sp_rmsnorm(x.data_ptr(), x.shape[0], self.hidden, x.stride(0), w.data_ptr(), self.eps,
                            y.data_ptr(), self.hidden)
        return y


def _layer(block) -> _Layer:
    a, m = block.self_attn, block.mlp
    w = lambda norm: None if norm is None else norm.weight.detach().float().contiguous()  # noqa: E731
    return _Layer(w(block.input_layernorm), w(block.post_attention_layernorm), w(a.q_norm), w(a.k_norm),
                  a.qkv_proj.packed, a.o_proj.packed, m.gate_up_proj.packed, m.down_proj.packed)


def _ptr(t: Tensor | None):
    return None if t is None else t.data_ptr()
