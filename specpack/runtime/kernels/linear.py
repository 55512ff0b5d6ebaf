"""Fast fp32 linear layer for a few rows (speculative verification), in C with AVX2/FMA.

`pack(weight)` lays the weight out once, at load time, as K-major panels of 16 output columns;
`PackedLinear(x)` then streams every weight byte once whatever the number of rows M, so verifying 8
drafted tokens costs about what decoding one does. Where the kernel cannot run (no compiler, no
AVX2, a failed build, or `SPECPACK_KERNELS=0`), `pack` keeps the weight and calls `F.linear`.

Determinism: every output element is summed in the same fixed k-blocks, one FMA chain per block
(see linear.c), so results do not depend on M, on the thread count or on the machine's core count:
row i of an M-row product is bit-identical to the product of row i alone. Speculative and plain
greedy decoding therefore see the same logits. The values differ from `F.linear`'s in the last
bits (another summation order).
"""

from __future__ import annotations

import ctypes
import sys

import torch
import torch.nn.functional as F
from torch import Tensor

from specpack.runtime.kernels._lib import (  # noqa: F401 - re-exported for callers and tests
    SPIN_US, _library, _log_once, available, default_threads, unavailable_reason)

NR = 16  # output columns per panel (linear.c)
# Below this many weight bytes one thread wins: waking the pool costs more than it saves.
MIN_PARALLEL_BYTES = 256 * 1024
HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14


def _advise_huge_pages(t: Tensor) -> None:
    """Ask for 2 MB pages on the aligned interior of `t` before it is first written (THP in
    "madvise" mode): streaming the 113 MB head then runs ~8% faster (fewer TLB misses, and the
    hardware prefetchers stop at page ends). Best effort: nothing happens where unsupported."""
    start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (t.data_ptr() + t.numel() * 4) // HUGE_PAGE * HUGE_PAGE
    if end > start and sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_HUGEPAGE)


def pack_panels(weight: Tensor) -> Tensor:
    """[N, K] -> [ceil(N/16), K, 16]: panel p, row k holds W[16p:16p+16, k], zero-padded past N."""
    N, K = weight.shape
    P = -(-N // NR)
    panels = torch.empty(P, K, NR, dtype=torch.float32)
    _advise_huge_pages(panels)
    full = N // NR
    panels[:full] = weight[: full * NR].reshape(full, NR, K).transpose(1, 2)
    if full < P:
        panels[full].zero_()
        panels[full, :, : N - full * NR] = weight[full * NR:].T
    return panels


class PackedLinear:
    """`y = x @ W.T + bias` for fp32 CPU x of shape [..., K], for inference (no autograd); made by
    `pack`.

    `threads` is the kernel's thread count (default: `default_threads()`); it changes speed only,
    never results. `backend` is "avx2" or "torch" (the fallback, which keeps the weight as given).
    Any number of rows works; the kernel is built for 1..16 (speculative verification).
    """

    def __init__(self, weight: Tensor, bias: Tensor | None = None, threads: int | None = None):
        if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise TypeError(f"pack() needs a 2-D fp32 CPU weight, got {tuple(weight.shape)} "
                            f"{weight.dtype} on {weight.device}")
        self.out_features, self.in_features = weight.shape
        if bias is not None and bias.shape != (self.out_features,):
            raise TypeError(f"bias must have shape ({self.out_features},), got {tuple(bias.shape)}")
        self.threads = threads or default_threads()
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.backend = "avx2" if available() else "torch"
        with torch.no_grad():
            self.weight = pack_panels(weight.detach()) if self.backend == "avx2" else weight.detach()
        self._parallel = self.weight.numel() * 4 >= MIN_PARALLEL_BYTES
        if self.backend == "avx2":  # looked up once: a call costs a few microseconds in all
            self._fn = _library()[0].sp_linear
            self._wptr = self.weight.data_ptr()
            self._bptr = None if self.bias is None else self.bias.data_ptr()

    def __call__(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        K, N = self.in_features, self.out_features
        if x.dtype != torch.float32 or x.shape[-1] != K or not x.is_cpu:
            raise TypeError(f"expected fp32 CPU input [..., {K}], got {tuple(x.shape)} {x.dtype} "
                            f"on {x.device}")
        if self.backend == "torch":
            y = F.linear(x, self.weight, self.bias)
            return y if out is None else out.copy_(y)
        lead = x.shape[:-1]
        M = lead.numel()
        if x.dim() != 2 or not x.is_contiguous():
            x = x.reshape(M, K)
            if x.stride(-1) != 1 or (M > 1 and x.stride(0) < K):
                x = x.contiguous()
        if out is None:
            out = torch.empty((*lead, N), dtype=torch.float32)
        elif (out.shape != (*lead, N) or out.dtype != torch.float32 or not out.is_contiguous()
              or not out.is_cpu):
            raise TypeError(f"out must be a contiguous fp32 tensor of shape {(*lead, N)}")
        self._fn(x.data_ptr(), M, K, x.stride(0), self._wptr, N, self._bptr, out.data_ptr(), N,
                 self.threads if self._parallel else 1)
        return out

    def __repr__(self) -> str:
        return (f"PackedLinear(in={self.in_features}, out={self.out_features}, "
                f"backend={self.backend}, threads={self.threads})")


def pack(weight: Tensor, bias: Tensor | None = None, threads: int | None = None) -> PackedLinear:
    """Lay out `weight` [N, K] (fp32) for the kernel, once, at load time.

    The packed copy is ~1x the weight (N rounded up to 16); drop your reference to `weight`
    afterwards to release it. Falls back to `F.linear` on the same weight when `available()` is
    False.
    """
    return PackedLinear(weight, bias, threads)
