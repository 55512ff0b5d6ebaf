"""Attention of a few query rows against their sequences' KV caches, in C (attention.c).

Every row of a batched forward in one call: row r belongs to the sequence in cache slot `slot[r]`
and sees that slot's keys [0, ctx[r]) plus, among its segment's new keys [ctx[r], end[r]), all of
them up to its own (chains: `mask` None, the row sees [0, end[r])) or those its tree mask marks.

Row-exact: a row's output does not depend on the other rows of the call, on their number or on
the thread count (see attention.c), so a sequence decodes bit-identically alone, in any batch, and
verifying a draft of any length.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specpack.runtime.kernels._lib import _library, available, default_threads


CACHE_DTYPES = (torch.float32, torch.float16)  # cache elements the kernel reads (fp16 widened exactly)


def usable(q: Tensor, k_cache: Tensor) -> bool:
    """Whether the kernel can run this attention (fp32 queries, an fp32 or fp16 cache, CPU tensors,
    contiguous head dims, AVX2)."""
    return (q.dtype == torch.float32 and k_cache.dtype in CACHE_DTYPES and not q.is_cuda
            and not k_cache.is_cuda and k_cache.stride(-1) == 1 and available())


def attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, slot: Tensor, ctx: Tensor, end: Tensor,
              mask: Tensor | None, scale: float, dv: int | None = None, threads: int | None = None) -> Tensor:
    """q [R, H, dk] fp32; k_cache, v_cache [S, KVH, L, ld] fp32 or fp16 (views of one layer; MLA
    passes the latent cache as both, with `dv` its latent width); slot, ctx, end [R] int64; mask
    [R, W] bool or None. Returns [R, H, dv] fp32. On an fp16 cache the result is, bit for bit, the
    result on that cache widened to fp32."""
    R, H, dk = q.shape
    S, KVH, L, ld = k_cache.shape
    dv = dv or v_cache.shape[-1]
    q = q.contiguous()
    out = torch.empty(R, H, dv, dtype=torch.float32)
    if R == 0:
        return out
    if v_cache.stride() != k_cache.stride() or v_cache.dtype != k_cache.dtype:
        raise ValueError("k_cache and v_cache must share strides and dtype")
    idx = [t.to(torch.int64).contiguous() for t in (slot, ctx, end)]
    m = None if mask is None else mask.to(torch.uint8).contiguous()
    _library()[0].sp_attention(
        q.data_ptr(), R, H, H * dk, k_cache.data_ptr(), v_cache.data_ptr(), int(k_cache.dtype == torch.float16), KVH,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), dk, dv,
        idx[0].data_ptr(), idx[1].data_ptr(), idx[2].data_ptr(),
        None if m is None else m.data_ptr(), 0 if m is None else m.shape[1],
        float(scale), out.data_ptr(), H * dv, threads or default_threads())
    return out


def reference(q: Tensor, k_cache: Tensor, v_cache: Tensor, slot: Tensor, ctx: Tensor, end: Tensor,
              mask: Tensor | None, scale: float, dv: int | None = None) -> Tensor:
    """The same in plain torch, one row at a time (float64): what the tests compare against."""
    R, H, dk = q.shape
    KVH = k_cache.shape[1]
    dv = dv or v_cache.shape[-1]
    out = torch.zeros(R, H, dv, dtype=torch.float64)
    for r in range(R):
        c, e = int(ctx[r]), int(end[r])
        keep = torch.arange(e) < (e if mask is None else c)
        if mask is not None:
            keep[c:e] = mask[r, : e - c].bool()
        for h in range(H):
            g = h // (H // KVH)
            K = k_cache[int(slot[r]), g, :e, :dk].double()[keep]
            V = v_cache[int(slot[r]), g, :e, :dv].double()[keep]
            if len(K):
                out[r, h] = ((K @ q[r, h].double()) * scale).softmax(0) @ V
    return out
