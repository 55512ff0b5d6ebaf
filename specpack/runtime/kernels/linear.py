"""Fast linear layer for a few rows (speculative verification), in C with AVX2/FMA/F16C.

`pack(weight, weights=...)` lays the weight out once, at load time, as K-major panels of 16 output
columns, in one of five formats: fp32 (as given), fp16 or bf16 (rounded to nearest, half the
bytes), int8 (llama.cpp's Q8_0 blocks: one fp32 scale per 32 k and column, a quarter of the
bytes plus 1/8 for the scales), or w8a8 (the same blocks, and every row of activations rounded to
int8 blocks of 32 too: llama.cpp's Q8_0 x Q8_0 arithmetic, int8 dot products with AVX-512 VNNI,
w8a8.c). `PackedLinear(x)` then streams every weight byte once whatever the number of rows M; the
first four widen the weights to fp32 in registers and keep activations and sums in fp32. On a CPU with
AMX tiles (Sapphire Rapids and later), `--weights bf16` packs its layers as "bf16-amx" instead
(bf16_tiles.c: the same rounded weights in AMX's pair layout, each activation split in two bf16 parts,
16 significant bits, fp32 sums): one tile instruction multiplies up to 16 rows, so verifying 9 rows
costs ~1.1x one where the vector kernel's fp32 multiply-adds cost ~1.5x.
Where the kernel cannot run (no compiler, no AVX2/F16C, a failed build, or `SPECPACK_KERNELS=0`),
`pack` keeps an fp32 copy of the (rounded or dequantized) weight and calls `F.linear` (w8a8: its
blocks, and `w8a8_linear`, the same integer arithmetic in torch).

Determinism: every output element is summed in the same fixed k-blocks, one FMA chain per block
(see linear.c), so results do not depend on M, on the thread count or on the machine's core count:
row i of an M-row product is bit-identical to the product of row i alone, in every format.
Speculative and plain greedy decoding therefore see the same logits. fp16/bf16 results are
bit-identical to the fp32 kernel on the rounded weights (bf16-amx: within ~1e-5 relative of them, a
model packs every row count alike); they differ from `F.linear`'s in the last
bits (another summation order). w8a8 quantizes each row on its own and sums integers exactly, so it
keeps the same row-exactness (and its AVX2 tiles, on CPUs without VNNI, give the same bits).
"""

from __future__ import annotations

import ctypes
import logging
import sys

import torch
import torch.nn.functional as F
from torch import Tensor

from specpack.runtime.kernels import _lib  # noqa: F401 - for tests
from specpack.runtime.kernels._lib import (  # noqa: F401 - re-exported for callers and tests
    SPIN_US, _library, _log_once, available, default_threads, unavailable_reason)

log = logging.getLogger(__name__)
NR = 16  # output columns per panel (linear.c)
Q8_BLOCK = 32  # k per int8 scale block (linear.c)
Q8_BLOCK_BYTES = NR * 4 + Q8_BLOCK * NR  # 16 fp32 scales + 32 x 16 int8
# weight format name -> linear.c's code
FORMATS = {"fp32": 0, "fp16": 1, "bf16": 2, "int8": 3, "w8a8": 4, "bf16-amx": 7, "w4a8": 8, "w4a8k": 9, "w4a8s": 10,
           "w6a8": 11, "w5a8s": 12, "w5a8k": 13, "w5a8": 14}
BF16_TILES = "bf16-amx"  # bf16 on AMX tiles (bf16_tiles.c): packed only where `bf16_tiles()` says they run
TILE_K = 32  # k per AMX block (bf16_tiles.c)
QUANTIZED = ("int8", "w8a8")  # the formats in Q8_0 blocks
W4A8 = "w4a8"  # GGUF Q4_0 / Q4_1 blocks kept 4-bit, int8 activations (w4a8.c); packed from blocks only
W4A8K = "w4a8k"  # the same with fp32 scales and offsets: Q4_K's sub-blocks (d * sc, -dmin * m: not fp16 values)
W4A8S = "w4a8s"  # the same with scales alone, values d (u - 8): Q4_0's blocks, 4.5 bits, llama.cpp's integer offset
W4_FORMATS = (W4A8, W4A8K, W4A8S)
W4_BLOCK_BYTES = NR * 4 + Q8_BLOCK * NR // 2  # 16 fp16 scales + 16 fp16 offsets + 32 x 16 nibbles = 320
W4K_BLOCK_BYTES = NR * 8 + Q8_BLOCK * NR // 2  # fp32 scales and offsets: 384
W4S_BLOCK_BYTES = NR * 2 + Q8_BLOCK * NR // 2  # fp16 scales alone: 288
W4_BYTES = {W4A8: W4_BLOCK_BYTES, W4A8K: W4K_BLOCK_BYTES, W4A8S: W4S_BLOCK_BYTES}
# the 5-bit formats: each a 4-bit layout plus a mask of the values' fifth bits a group of 4 k (w4a8.c)
W5A8S = "w5a8s"  # GGUF Q5_0: w4a8s's layout, values d (u - 16), 5.5 bits
W5A8 = "w5a8"  # GGUF Q5_1: w4a8's (fp16 d, m)
W5A8K = "w5a8k"  # GGUF Q5_K's sub-blocks: w4a8k's (fp32 d, m)
PLANE = Q8_BLOCK * NR // 8  # 64 bytes of fifth bits a block
W5_BYTES = {W5A8S: W4S_BLOCK_BYTES + PLANE, W5A8: W4_BLOCK_BYTES + PLANE, W5A8K: W4K_BLOCK_BYTES + PLANE}
W5_FORMATS = tuple(W5_BYTES)
OFFSETS = {W4A8S: 8, W5A8S: 16}  # the integer offset of the formats that store no m
W6A8 = "w6a8"  # GGUF Q6_K's 6-bit values, a scale per 16 k, int8 activations (w6a8.c); packed from blocks only
W6_BLOCK_BYTES = NR * 8 + Q8_BLOCK * NR // 2 + Q8_BLOCK * NR // 4  # 2 x 16 fp32 scales, nibbles, high bits: 512
PACKED_BYTES = {"w8a8": Q8_BLOCK_BYTES, **W4_BYTES, **W5_BYTES, W6A8: W6_BLOCK_BYTES}  # per panel and block of 32 k
BLOCK_FORMATS = (*W4_FORMATS, *W5_FORMATS, W6A8)  # packed from GGUF blocks only
ISAS = ("avx2", "avx512")  # the tile sets (linear.c): the same bits, AVX-512 where the CPU has it
_HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}
# Below this many weight bytes one thread wins: waking the pool costs more than it saves.
MIN_PARALLEL_BYTES = 256 * 1024
HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
PACK_PANELS = 512  # panels quantized at a time: bounds the temporaries for a large head


def isa_bits(settings: dict) -> int:
    """linear.c's `isa` argument from tuned settings: bit 0, slabs of one or two rows run AVX-512
    ("isa_few"); bit 1, slabs of three or more do ("isa")."""
    return int(settings.get("isa_few") == "avx512") | int(settings.get("isa") == "avx512") << 1


def _advise_huge_pages(t: Tensor) -> None:
    """Ask for 2 MB pages on the aligned interior of `t` before it is first written (THP in
    "madvise" mode): streaming the 113 MB head then runs ~8% faster (fewer TLB misses, and the
    hardware prefetchers stop at page ends). Best effort: nothing happens where unsupported."""
    start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (t.data_ptr() + t.numel() * t.element_size()) // HUGE_PAGE * HUGE_PAGE
    if end > start and sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_HUGEPAGE)


def pack_panels(weight: Tensor, dtype=torch.float32) -> Tensor:
    """[N, K] -> [ceil(N/16), K, 16] of `dtype` (fp32, fp16 or bf16, rounded to nearest): panel p,
    row k holds W[16p:16p+16, k], zero-padded past N."""
    N, K = weight.shape
    P = -(-N // NR)
    panels = torch.empty(P, K, NR, dtype=dtype)
    _advise_huge_pages(panels)
    full = N // NR
    panels[:full] = weight[: full * NR].reshape(full, NR, K).transpose(1, 2)
    if full < P:
        panels[full].zero_()
        panels[full, :, : N - full * NR] = weight[full * NR:].T
    return panels


def _padded_rows(weight: Tensor, p0: int, p1: int, width: int) -> Tensor:
    """The rows of panels [p0, p1) of `weight` [N, K] as fp32 [(p1 - p0) * 16, width], zero past N and K."""
    N, K = weight.shape
    w = torch.zeros((p1 - p0) * NR, width)
    w[: max(0, min(N, p1 * NR) - p0 * NR), :K] = weight[p0 * NR: p1 * NR].float()
    return w


def pack_q8(weight: Tensor) -> Tensor:
    """[N, K] -> [ceil(N/16), ceil(K/32), 576] bytes: per panel and block of 32 k, the 16 columns'
    scales (fp32, amax / 127) then the 32 x 16 int8 values round(W / scale), k-major."""
    N, K = weight.shape
    P, B = -(-N // NR), -(-K // Q8_BLOCK)
    out = torch.empty(P, B, Q8_BLOCK_BYTES, dtype=torch.uint8)
    _advise_huge_pages(out)
    scales = out[..., : NR * 4].view(torch.float32)  # [P, B, 16]
    q = out[..., NR * 4:].view(torch.int8).view(P, B, Q8_BLOCK, NR)
    for p0 in range(0, P, PACK_PANELS):
        p1 = min(P, p0 + PACK_PANELS)
        w = _padded_rows(weight, p0, p1, B * Q8_BLOCK).view(p1 - p0, NR, B, Q8_BLOCK)
        w = w.permute(0, 2, 3, 1)  # [p, B, 32 (k), 16 (column)]
        d = w.abs().amax(dim=2) / 127  # [p, B, 16]
        scales[p0:p1] = d
        q[p0:p1] = torch.where(d[:, :, None] > 0, w / d[:, :, None], 0).round().clamp(-127, 127)
    return out


def pack_w8a8(weight: Tensor) -> Tensor:
    """[N, K] -> [ceil(N/16), ceil(K/32), 576] bytes: `pack_q8`'s blocks (the same scales and
    values) with each value stored as q + 128 (unsigned) in VNNI order: per group of 4 k, column j's
    four values at bytes 4j..4j+3 (w8a8.c)."""
    out = pack_q8(weight)
    q = out[..., NR * 4:].view(torch.int8).view(*out.shape[:2], Q8_BLOCK // 4, 4, NR)
    out[..., NR * 4:] = (q.to(torch.int16) + 128).to(torch.uint8).transpose(-1, -2).reshape(*out.shape[:2], Q8_BLOCK * NR)
    return out


def pack_bf16_tiles(weight: Tensor) -> Tensor:
    """[N, K] -> [ceil(N/16), ceil(K/32), 16, 16, 2] bf16 (rounded to nearest, zero past N and K): panel p,
    block b, pair i, column j holds W[16p + j, 32b + 2i] and W[16p + j, 32b + 2i + 1] (bf16_tiles.c)."""
    N, K = weight.shape
    P, B = -(-N // NR), -(-K // TILE_K)
    out = torch.empty(P, B, TILE_K // 2, NR, 2, dtype=torch.bfloat16)
    _advise_huge_pages(out)
    for p0 in range(0, P, PACK_PANELS):
        p1 = min(P, p0 + PACK_PANELS)
        w = _padded_rows(weight, p0, p1, B * TILE_K).view(p1 - p0, NR, B, TILE_K // 2, 2)
        out[p0:p1] = w.permute(0, 2, 3, 1, 4)
    return out


def bf16_tiles() -> bool:
    """Whether bf16 weights can run on AMX tiles here (AMX-BF16, AVX512-BF16, the OS's permission, the
    kernel library; SPECPACK_AMX=0 says no)."""
    return available() and bool(_library()[0].sp_bf16_tiles())


def q8_values(panels: Tensor, weights: str) -> tuple[Tensor, Tensor]:
    """The Q8_0 blocks of packed int8 or w8a8 panels: values [N', B, 32] (as floats, N' = panels x 16)
    and scales [N', B]."""
    P, B, _ = panels.shape
    scales = panels[..., : NR * 4].view(torch.float32)
    data = panels[..., NR * 4:]
    if weights == "w8a8":
        q = data.reshape(P, B, Q8_BLOCK // 4, NR, 4).float().sub(128).transpose(-1, -2).reshape(P, B, Q8_BLOCK, NR)
    else:
        q = data.view(torch.int8).view(P, B, Q8_BLOCK, NR).float()
    return q.permute(0, 3, 1, 2).reshape(P * NR, B, Q8_BLOCK), scales.permute(0, 2, 1).reshape(P * NR, B)


def unpack(panels: Tensor, weights: str, N: int, K: int) -> Tensor:
    """The fp32 [N, K] weight the kernel computes with (rounded or dequantized): the inverse of
    `pack_panels` / `pack_q8` / `pack_w8a8` (w8a8 also rounds its activations: see `w8a8_linear`)."""
    if weights == BF16_TILES:
        return panels.float().permute(0, 3, 1, 2, 4).reshape(len(panels) * NR, -1)[:N, :K].contiguous()
    if weights == W6A8:
        u, lo, hi = w6a8_values(panels)
        v = (u - 32) * torch.stack([lo, hi], dim=-1).repeat_interleave(16, dim=-1)
        return v.reshape(len(u), -1)[:N, :K].contiguous()
    if weights in (*W4_FORMATS, *W5_FORMATS):
        u, d, m = w5a8_values(panels) if weights in W5_FORMATS else w4a8_values(panels)
        v = d[..., None] * (u - OFFSETS.get(weights, 0)) if m is None else u * d[..., None] + m[..., None]
        return v.reshape(len(u), -1)[:N, :K].contiguous()
    if weights not in QUANTIZED:
        return panels.float().transpose(1, 2).reshape(-1, K)[:N]
    q, scales = q8_values(panels, weights)
    return (q * scales[..., None]).reshape(len(q), -1)[:N, :K].contiguous()


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """w8a8's activations: x [M, K] -> values [M, B, 32] (integers, as floats) and scales [M, B],
    per block of 32 k d = amax / 127 and q = round-half-even(x * (1 / d)), 0 where d is 0 (w8a8.c)."""
    M, K = x.shape
    blocks = F.pad(x, (0, -K % Q8_BLOCK)).view(M, -1, Q8_BLOCK)
    d = blocks.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1 / torch.where(d > 0, d, 1.0), 0.0)
    return (blocks * inv[..., None]).round().clamp(-127, 127), d


def w8a8_linear(x: Tensor, q: Tensor, scales: Tensor, bias: Tensor | None, N: int) -> Tensor:
    """w8a8.c's product in torch (the fallback): per block the exact integer sum of the quantized
    row and weight values (an fp32 product of integers below 2^24 is exact), times the row's scale,
    then summed over blocks with the weight's scale, in block order."""
    xq, d = quantize_rows(x.reshape(x.shape[:-1].numel(), x.shape[-1]))
    acc = torch.zeros(len(xq), N)
    for b in range(xq.shape[1]):
        f = (xq[:, b] @ q[:N, b].T) * d[:, b:b + 1]
        # fma(f, scale, acc): the product is exact in float64, one rounding of the sum (two at most)
        acc = f * scales[:N, b] if b == 0 else (f.double() * scales[:N, b].double() + acc.double()).float()
    if bias is not None:
        acc = acc + bias
    return acc.reshape(*x.shape[:-1], N)


def pack_q8_blocks(q: Tensor, d: Tensor) -> Tensor:
    """GGUF Q8_0 blocks (q int8 [N, B, 32], d fp32 [N, B]) as `pack_w8a8` panels, bit for bit what
    `pack_w8a8` makes of their dequantized weight (a block's largest |q| is 127, so amax / 127 is d exactly),
    without the fp32 weight."""
    N, B, _ = q.shape
    P = -(-N // NR)
    out = torch.zeros(P, B, Q8_BLOCK_BYTES, dtype=torch.uint8)
    _advise_huge_pages(out)
    _columns_into(out[..., : NR * 4].view(torch.float32), d)
    # stored q + 128: the sign bit flipped; [N, B, 8 (group), 4 (k)] -> [P, B, group, column, k]
    values = out[..., NR * 4:].view(P, B, Q8_BLOCK // 4, NR, 4)
    for p0 in range(0, P, PACK_PANELS):
        p1 = min(P, p0 + PACK_PANELS)
        rows = torch.full(((p1 - p0) * NR, B, Q8_BLOCK), 0x80, dtype=torch.uint8)
        n = min(N, p1 * NR) - p0 * NR
        rows[:n] = q[p0 * NR: p0 * NR + n].view(torch.uint8) ^ 0x80
        values[p0:p1] = rows.view(p1 - p0, NR, B, Q8_BLOCK // 4, 4).permute(0, 2, 3, 1, 4)
    return out


def _columns_into(dst: Tensor, values: Tensor) -> None:
    """values [N, B] (one per column and block) into panels' per-block column slots dst [P, B, 16]."""
    P, B, _ = dst.shape
    column_major = torch.zeros(P * NR, B, dtype=dst.dtype)
    column_major[: len(values)] = values
    dst[:] = column_major.view(P, NR, B).permute(0, 2, 1)


def pack_w4a8(u: Tensor, d: Tensor, m: Tensor | None, wide: bool = False) -> Tensor:
    """4-bit blocks (u uint8 [N, B, 32] in 0..15, d and m fp32 [N, B]: value d u + m, each d and m exactly an
    fp16 unless `wide`; m None: value d (u - 8)) -> [ceil(N/16), B, 320] bytes (wide: 384, m None: 288): per
    panel and block the 16 columns' d then m (fp16; wide: fp32, w4a8k; m None: d alone, w4a8s), then the
    values as nibbles, region r (64 bytes) holding k = 8r..8r+3 in low nibbles and 8r+4..8r+7 in high ones,
    column j's four at bytes 4j..4j+3 (w4a8.c)."""
    N, B, _ = u.shape
    P = -(-N // NR)
    scale_type = torch.float32 if wide else torch.float16
    stored = [d] if m is None else [d, m]
    narrow = [t.to(scale_type) for t in stored]
    if not all(torch.equal(a.float(), b) for a, b in zip(narrow, stored)):
        raise ValueError("w4a8 keeps scales and offsets in fp16: these are not all fp16 values (w4a8k: fp32)")
    out = torch.zeros(P, B, W4_BYTES[W4A8K if wide else W4A8 if m is not None else W4A8S], dtype=torch.uint8)
    _advise_huge_pages(out)
    width = NR * scale_type.itemsize
    for i, values in enumerate(narrow):
        _columns_into(out[..., i * width: (i + 1) * width].view(scale_type), values)
    start = len(narrow) * width
    for p0 in range(0, P, PACK_PANELS):
        p1 = min(P, p0 + PACK_PANELS)
        rows = torch.zeros((p1 - p0) * NR, B, Q8_BLOCK, dtype=torch.uint8)
        n = min(N, p1 * NR) - p0 * NR
        rows[:n] = u[p0 * NR: p0 * NR + n]
        # [p, 16 (j), B, 4 (r), 2 (low / high), 4 (i)] -> [p, B, r, j, i, low / high]
        v = rows.view(p1 - p0, NR, B, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
        out[p0:p1, :, start:] = (v[..., 0] | (v[..., 1] << 4)).reshape(p1 - p0, B, -1)
    return out


def w4a8_values(panels: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    """The blocks of w4a8 (w4a8k, w4a8s) panels: values u [N', B, 32] (as floats), scales d and offsets m
    [N', B] (None for w4a8s: the values are d (u - 8))."""
    P, B, per_block = panels.shape
    scale_type = torch.float32 if per_block == W4K_BLOCK_BYTES else torch.float16
    width, count = NR * scale_type.itemsize, 1 if per_block == W4S_BLOCK_BYTES else 2
    scales = [panels[..., i * width: (i + 1) * width].contiguous().view(scale_type).float().permute(0, 2, 1)
              .reshape(P * NR, B) for i in range(count)]  # [P, B, 16] -> [N', B]
    nib = panels[..., count * width:].reshape(P, B, 4, NR, 4)  # [P, B, r, j, i]
    u = torch.stack([nib & 0x0F, nib >> 4], dim=-2)  # [P, B, r, j, 2, i]
    u = u.permute(0, 3, 1, 2, 4, 5).reshape(P * NR, B, Q8_BLOCK).float()
    return u, scales[0], scales[1] if count == 2 else None


def pack_w5a8(u: Tensor, d: Tensor, m: Tensor | None = None, wide: bool = False) -> Tensor:
    """5-bit blocks (u uint8 [N, B, 32] in 0..31, d fp32 [N, B] exactly fp16: value d (u - 16), Q5_0, w5a8s;
    with m: value d u + m, d and m fp16 (Q5_1, w5a8) or, `wide`, any fp32 (Q5_K's sub-blocks, w5a8k)) ->
    [ceil(N/16), B, 352 | 384 | 448] bytes: `pack_w4a8`'s bytes of the low 4 bits, then the fifth bits, a 64-bit
    little-endian mask a group of 4 k: bit L for lane L = 4 j + i (column j, k 4 g + i)."""
    N, B, _ = u.shape
    low = pack_w4a8(u & 0x0F, d, m, wide)
    P, head = len(low), low.shape[-1]
    out = torch.zeros(P, B, head + PLANE, dtype=torch.uint8)
    _advise_huge_pages(out)
    out[..., :head] = low
    del low
    weights = torch.tensor([1 << e for e in range(8)], dtype=torch.uint8)
    for p0 in range(0, P, PACK_PANELS):
        p1 = min(P, p0 + PACK_PANELS)
        rows = torch.zeros((p1 - p0) * NR, B, Q8_BLOCK, dtype=torch.uint8)
        n = min(N, p1 * NR) - p0 * NR
        rows[:n] = u[p0 * NR: p0 * NR + n] >> 4
        # [p, 16 (j), B, 8 (g), 4 (i)] -> lanes [p, B, g, 64] -> [p, B, g, 8 (byte), 8 (bit)]
        lanes = rows.view(p1 - p0, NR, B, 8, 4).permute(0, 2, 3, 1, 4).reshape(p1 - p0, B, 8, 8, 8)
        out[p0:p1, :, head:] = (lanes * weights).sum(-1, dtype=torch.uint8).reshape(p1 - p0, B, -1)
    return out


def w5a8_values(panels: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    """The blocks of 5-bit panels: values u [N', B, 32] (as floats), scales d [N', B] and offsets m (None for
    w5a8s: values d (u - 16))."""
    P, B, per_block = panels.shape
    head = per_block - PLANE
    u, d, m = w4a8_values(panels[..., :head])
    plane = panels[..., head:].reshape(P, B, 8, 8, 1)  # [p, B, g, byte, 1]
    bits = (plane >> torch.arange(8, dtype=torch.uint8)) & 1  # [p, B, g, byte, bit]: lane 8 byte + bit
    high = bits.reshape(P, B, 8, NR, 4).permute(0, 3, 1, 2, 4).reshape(P * NR, B, Q8_BLOCK)
    return u + 16 * high.float(), d, m


def pack_w6a8(u: Tensor, lo: Tensor, hi: Tensor) -> Tensor:
    """6-bit blocks (u uint8 [N, B, 32] in 0..63, lo and hi fp32 [N, B]: value scale * (u - 32), lo the scale of
    k 0..15 and hi of k 16..31) -> [ceil(N/16), B, 512] bytes: per panel and block the 16 columns' lo, their hi,
    the values' low 4 bits as `pack_w4a8` stores nibbles, then their high 2 bits, 16 bytes a group of 4 k:
    byte t holding lanes t, t + 16, t + 32, t + 48 (lane 4 j + i: column j, k 4 g + i) at bits 0-1 .. 6-7."""
    N, B, _ = u.shape
    P = -(-N // NR)
    out = torch.zeros(P, B, W6_BLOCK_BYTES, dtype=torch.uint8)
    _advise_huge_pages(out)
    for i, values in enumerate((lo, hi)):
        _columns_into(out[..., i * NR * 4: (i + 1) * NR * 4].view(torch.float32), values)
    plane = NR * 8 + Q8_BLOCK * NR // 2
    for p0 in range(0, P, PACK_PANELS):
        p1 = min(P, p0 + PACK_PANELS)
        rows = torch.zeros((p1 - p0) * NR, B, Q8_BLOCK, dtype=torch.uint8)
        n = min(N, p1 * NR) - p0 * NR
        rows[:n] = u[p0 * NR: p0 * NR + n]
        low, high = rows & 0x0F, rows >> 4
        # nibbles: [p, 16 (j), B, 4 (r), 2 (low / high), 4 (i)] -> [p, B, r, j, i, low / high]
        v = low.view(p1 - p0, NR, B, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
        out[p0:p1, :, NR * 8: plane] = (v[..., 0] | (v[..., 1] << 4)).reshape(p1 - p0, B, -1)
        # high bits: lanes [p, B, 8 (g), 64 (4 j + i)] -> [p, B, g, 4 (which sixteen), 16 (t)]
        lanes = high.view(p1 - p0, NR, B, 8, 4).permute(0, 2, 3, 1, 4).reshape(p1 - p0, B, 8, 4, 16)
        packed = lanes[..., 0, :] | lanes[..., 1, :] << 2 | lanes[..., 2, :] << 4 | lanes[..., 3, :] << 6
        out[p0:p1, :, plane:] = packed.reshape(p1 - p0, B, -1)
    return out


def w6a8_values(panels: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The blocks of w6a8 panels: values u [N', B, 32] (as floats) and the scales lo, hi [N', B]."""
    P, B, _ = panels.shape
    lo, hi = (panels[..., i * NR * 4: (i + 1) * NR * 4].contiguous().view(torch.float32).permute(0, 2, 1)
              .reshape(P * NR, B) for i in range(2))
    plane = NR * 8 + Q8_BLOCK * NR // 2
    nib = panels[..., NR * 8: plane].reshape(P, B, 4, NR, 4)
    low = torch.stack([nib & 0x0F, nib >> 4], dim=-2).permute(0, 3, 1, 2, 4, 5).reshape(P * NR, B, Q8_BLOCK)
    bits = panels[..., plane:].reshape(P, B, 8, 1, 16) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)
    high = (bits & 3).reshape(P, B, 8, NR, 4).permute(0, 3, 1, 2, 4).reshape(P * NR, B, Q8_BLOCK)
    return (low | high << 4).float(), lo, hi


def w6a8_linear(x: Tensor, u: Tensor, lo: Tensor, hi: Tensor, bias: Tensor | None, N: int) -> Tensor:
    """w6a8.c's product in torch (the fallback): per block and half of k the exact integer sum of the
    quantized row and the values less 32 times the row's sum, times the row's scale, folded with the half's
    scale, low half then high, in block order."""
    xq, da = quantize_rows(x.reshape(x.shape[:-1].numel(), x.shape[-1]))
    acc = torch.zeros(len(xq), N)
    for b in range(xq.shape[1]):
        for h, scale in enumerate((lo, hi)):
            part = slice(16 * h, 16 * h + 16)
            t = xq[:, b, part] @ u[:N, b, part].T - 32 * xq[:, b, part].sum(-1, keepdim=True)
            g = t * da[:, b:b + 1]
            acc = g * scale[:N, b] if b == 0 and h == 0 else _fma(g, scale[:N, b], acc)
    if bias is not None:
        acc = acc + bias
    return acc.reshape(*x.shape[:-1], N)


def _fma(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    """fma(a, b, c) in fp32 through float64 (the product exact, one rounding of the sum, two at most)."""
    return (a.double() * b.double() + c.double()).float()


def w4a8_linear(x: Tensor, u: Tensor, d: Tensor, m: Tensor | None, bias: Tensor | None, N: int,
                offset: int = 8) -> Tensor:
    """w4a8.c's product in torch (the fallback): per block the exact integer sum of the quantized row and
    the 4-bit values (m None: minus `offset` times the row's sum), times the row's scale, folded with the
    weight's scale, then (m given) its offset times the row's scaled sum, in block order."""
    xq, da = quantize_rows(x.reshape(x.shape[:-1].numel(), x.shape[-1]))
    sums = xq.sum(-1)  # exact in fp32
    sa = da * sums  # d_a * sum(q)
    acc = torch.zeros(len(xq), N)
    for b in range(xq.shape[1]):
        t = xq[:, b] @ u[:N, b].T
        if m is None:
            t = t - offset * sums[:, b:b + 1]  # integers below 2^24: exact
        g = t * da[:, b:b + 1]
        acc = g * d[:N, b] if b == 0 else _fma(g, d[:N, b], acc)
        if m is not None:
            acc = _fma(m[:N, b].expand_as(acc), sa[:, b:b + 1].expand_as(acc), acc)
    if bias is not None:
        acc = acc + bias
    return acc.reshape(*x.shape[:-1], N)


def panel_layout(weights: str, N: int, K: int) -> tuple[tuple[int, ...], torch.dtype]:
    """(shape, dtype) of the panels a [N, K] weight packs into in `weights` (fp32 / fp16 / bf16: [P, K, 16];
    int8, w8a8 and the block formats: bytes per panel and block of 32 k; bf16 AMX tiles: pairs), P = ceil(N / 16):
    panel p holds rows 16p..16p+15 only, so rows packed apart fill the panels packed together."""
    P, B = -(-N // NR), -(-K // Q8_BLOCK)
    if weights in PACKED_BYTES or weights in QUANTIZED:
        return (P, B, PACKED_BYTES.get(weights, Q8_BLOCK_BYTES)), torch.uint8
    if weights == BF16_TILES:
        return (P, -(-K // TILE_K), TILE_K // 2, NR, 2), torch.bfloat16
    return (P, K, NR), _HALF.get(weights, torch.float32)


def packed_panels(weight: Tensor, weights: str) -> Tensor:
    """The panels the kernel reads for `weight` [N, K] in `weights` (`panel_layout`'s shape and dtype)."""
    if weights == "int8":
        return pack_q8(weight)
    if weights == "w8a8":
        return pack_w8a8(weight)
    if weights == BF16_TILES:
        return pack_bf16_tiles(weight)
    return pack_panels(weight, _HALF.get(weights, torch.float32))


class PackedLinear:
    """`y = x @ W.T + bias` for fp32 CPU x of shape [..., K], for inference (no autograd); made by
    `pack`.

    `weights` is the format the weight is kept in (fp32, fp16, bf16, int8, w8a8); `tuned` the settings
    kernels/tuning.py measured for it (`tuning.pack` passes them): the thread count (`threads`
    overrides it), the panel grouping and the prefetch distance; they change speed only, never
    results.
    `backend` is "avx2" or "torch" (the fallback, which keeps an fp32 weight). Any number of rows
    works; the kernel is built for 1..16 (speculative verification).
    """

    def __init__(self, weight: Tensor, bias: Tensor | None = None, threads: int | None = None,
                 weights: str = "fp32", tuned: dict | None = None):
        if weight.dim() != 2 or not weight.is_floating_point() or weight.device.type != "cpu":
            raise TypeError(f"pack() needs a 2-D floating-point CPU weight, got {tuple(weight.shape)} "
                            f"{weight.dtype} on {weight.device}")
        if weights in BLOCK_FORMATS:
            raise TypeError(f"{weights} weights are packed from GGUF blocks (PackedLinear.of_panels with "
                            "pack_w4a8), not from a float weight")
        self._setup(tuple(weight.shape), bias, threads, weights, tuned)
        with torch.no_grad():
            self.weight = self._layout(weight.detach())
        self._bind()

    @classmethod
    def of_panels(cls, panels: Tensor, weights: str, shape: tuple[int, int], bias: Tensor | None = None,
                  threads: int | None = None, tuned: dict | None = None) -> "PackedLinear":
        """A layer over panels already packed in `weights` for a weight of `shape` [out, in] (`panel_layout`): what
        a GGUF's blocks become without an fp32 weight in between ("w8a8": `pack_q8_blocks`, "w4a8": `pack_w4a8`,
        ...), or a large weight packed a few rows at a time (accelerate.packed_linear: every format, the kernels'
        only)."""
        if weights not in PACKED_BYTES and not available():
            raise TypeError(f"{weights} panels run on the CPU kernels, which are not available here; without them "
                            f"of_panels takes {', '.join(PACKED_BYTES)} panels")
        want, dtype = panel_layout(weights, *shape)
        if panels.dtype != dtype or tuple(panels.shape) != want:
            raise TypeError(f"{weights} panels of a {list(shape)} weight are {str(dtype).removeprefix('torch.')} "
                            f"{list(want)}, got {panels.dtype} {list(panels.shape)}")
        self = cls.__new__(cls)
        self._setup(shape, bias, threads, weights, tuned)
        self.weight = panels
        self._bind()
        return self

    def _setup(self, shape, bias, threads, weights, tuned) -> None:
        if weights not in FORMATS:
            raise TypeError(f"unknown weight format {weights!r}: use one of {', '.join(FORMATS)}")
        self.out_features, self.in_features = shape
        if bias is not None and bias.shape != (self.out_features,):
            raise TypeError(f"bias must have shape ({self.out_features},), got {tuple(bias.shape)}")
        self.weights = weights
        self.bias = None if bias is None else bias.detach().float().contiguous()
        if weights == BF16_TILES and not bf16_tiles():
            raise TypeError(f"{BF16_TILES} weights need AMX-BF16 tiles, which do not run here: use bf16")
        self.backend = "avx2" if available() else "torch"
        tuned = (tuned or {}) if self.backend == "avx2" else {}
        self.threads = threads or tuned.get("threads") or default_threads()
        self.group, self.prefetch = tuned.get("group", 1), tuned.get("prefetch", 128)
        self.isa = isa_bits(tuned)

    def _bind(self) -> None:
        self._parallel = self.weight.numel() * self.weight.element_size() >= MIN_PARALLEL_BYTES
        if self.backend == "torch" and self.weights == "w8a8":  # the fallback's integer values and scales
            self._q8 = q8_values(self.weight, self.weights)
        if self.backend == "torch" and self.weights in (*W4_FORMATS, *W5_FORMATS):
            self._q4 = w5a8_values(self.weight) if self.weights in W5_FORMATS else w4a8_values(self.weight)
        if self.backend == "torch" and self.weights == W6A8:
            self._q6 = w6a8_values(self.weight)
        if self.backend == "avx2":  # looked up once: a call costs a few microseconds in all
            self._fn = _library()[0].sp_linear
            self._fmt = FORMATS[self.weights]
            self._wptr = self.weight.data_ptr()
            self._bptr = None if self.bias is None else self.bias.data_ptr()

    def _layout(self, weight: Tensor) -> Tensor:
        if self.backend == "avx2" or self.weights == "w8a8":
            return packed_panels(weight, self.weights)
        if weight.dtype == torch.float32 and self.weights == "fp32":
            return weight  # as before: torch's path on the weight as given
        packed = packed_panels(weight, self.weights)  # the same rounding as the kernel's
        return unpack(packed, self.weights, self.out_features, self.in_features)

    def dense(self) -> Tensor:
        """The fp32 [out, in] weight this layer computes with (rounded or dequantized)."""
        if self.backend == "torch" and self.weights not in ("w8a8", *BLOCK_FORMATS):
            return self.weight
        return unpack(self.weight, self.weights, self.out_features, self.in_features)

    def __call__(self, x: Tensor, out: Tensor | None = None, residual: Tensor | None = None) -> Tensor:
        """x @ W.T + bias, plus `residual` (same shape as the output) when given, added last:
        `residual + (x @ W.T + bias)` bit for bit, in one pass."""
        K, N = self.in_features, self.out_features
        if x.dtype != torch.float32 or x.shape[-1] != K or not x.is_cpu:
            raise TypeError(f"expected fp32 CPU input [..., {K}], got {tuple(x.shape)} {x.dtype} "
                            f"on {x.device}")
        lead = x.shape[:-1]
        if residual is not None and (residual.shape != (*lead, N) or residual.dtype != torch.float32):
            raise TypeError(f"residual must be an fp32 tensor of shape {(*lead, N)}")
        if self.backend == "torch":
            if self.weights in (*W4_FORMATS, *W5_FORMATS):
                y = w4a8_linear(x, *self._q4, self.bias, N, OFFSETS.get(self.weights, 8))
            elif self.weights == W6A8:
                y = w6a8_linear(x, *self._q6, self.bias, N)
            else:
                y = w8a8_linear(x, *self._q8, self.bias, N) if self.weights == "w8a8" else F.linear(x, self.weight, self.bias)
            if residual is not None:
                y = residual + y
            return y if out is None else out.copy_(y)
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
        rptr, ldr = None, 0
        if residual is not None:
            residual = residual.reshape(M, N)
            if residual.stride(-1) != 1 or (M > 1 and residual.stride(0) < N):
                residual = residual.contiguous()
            rptr, ldr = residual.data_ptr(), residual.stride(0)
        self._fn(x.data_ptr(), M, K, x.stride(0), self._wptr, self._fmt, N, self._bptr, rptr, ldr,
                 out.data_ptr(), N, self.threads if self._parallel else 1, self.group, self.prefetch,
                 self.isa)
        return out

    def __repr__(self) -> str:
        return (f"PackedLinear(in={self.in_features}, out={self.out_features}, weights={self.weights}, "
                f"backend={self.backend}, threads={self.threads})")
