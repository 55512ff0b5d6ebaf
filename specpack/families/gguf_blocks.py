"""llama.cpp's quantized blocks (GGUF tensor types), read in torch: sizes, checks and decoding.

A GGUF matrix of logical shape [rows, cols] stores each row as cols / QK blocks side by side, every
block `nbytes` long; `import-gguf` keeps those bytes as they are (a U8 tensor [rows, row_bytes]), and
the runtime repacks them into the CPU kernels' panels (runtime/kernels/linear.py) without widening.

| type | QK | bytes | a block | value |
|---|---|---|---|---|
| Q8_0 | 32 | 34 | d (f16), qs (32 x i8) | d * q |
| Q4_0 | 32 | 18 | d (f16), qs (16 bytes: k in low nibbles, k + 16 in high) | d * (q - 8) |
| Q4_1 | 32 | 20 | d (f16), m (f16), qs as Q4_0 | d * q + m |
| Q5_0 | 32 | 22 | d (f16), qh (32 bits: bit 4 of value i at bit i), qs as Q4_0 | d * (q - 16) |
| Q5_1 | 32 | 24 | d (f16), m (f16), qh, qs as Q5_0 | d * q + m |
| Q4_K | 256 | 144 | d, dmin (f16), 12 bytes of 6-bit scales and mins, qs (128 bytes) | d * sc_j * q - dmin * m_j per 32 |
| Q5_K | 256 | 176 | as Q4_K, then qh (32 bytes: bit 4 of each q), qs | as Q4_K with 5-bit q |
| Q6_K | 256 | 210 | ql (128), qh (64), scales (16 x i8), d (f16) | d * sc_j * (q - 32) per 16 |

Sources (read, not guessed): ggml/src/ggml-common.h (block_q4_0 ... block_q6_K), ggml-quants.c
(dequantize_row_*, get_scale_min_k4), gguf-py/gguf/constants.py GGML_QUANT_SIZES and quants.py (whose
numpy decoding tests/test_gguf_blocks.py compares with, bit for bit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from specpack.errors import ConversionError

QK_K = 256
# type -> (values per block, bytes per block): gguf-py constants.GGML_QUANT_SIZES
BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
          "Q4_K": (QK_K, 144), "Q5_K": (QK_K, 176), "Q6_K": (QK_K, 210)}
TYPES = tuple(BLOCKS)


def row_bytes(kind: str, cols: int) -> int:
    """The bytes one row of `cols` values takes in `kind` blocks."""
    qk, nbytes = BLOCKS[kind]
    return cols // qk * nbytes


def columns(kind: str, nbytes: int) -> int:
    """The values a row of `nbytes` of `kind` blocks holds (`row_bytes` backwards)."""
    qk, size = BLOCKS[kind]
    return nbytes // size * qk


def shape_problems(name: str, kind: str, shape: tuple[int, ...], nbytes: int) -> list[str]:
    """Why `nbytes` of `kind` blocks cannot hold a tensor of logical `shape` (empty when they can)."""
    if kind not in BLOCKS:
        return [f"{name}: type {kind} is not one specpack keeps quantized (supported: {', '.join(TYPES)})"]
    qk, size = BLOCKS[kind]
    cols, rows = shape[-1], math.prod(shape[:-1])
    if cols % qk:
        return [f"{name}: {cols} columns are not whole {kind} blocks of {qk}"]
    want = rows * row_bytes(kind, cols)
    if nbytes != want:
        return [f"{name}: {nbytes:,} bytes of {kind} data, but {list(shape)} takes {want:,} "
                f"({rows:,} rows of {cols // qk} blocks of {size} bytes)"]
    return []


@dataclass(frozen=True)
class Affine:
    """Blocks decoded to integers and per-group floats: value = scale * q + min (min None: 0), per group of
    `group` values along a row. q [rows, groups, group] (uint8, or int8 where signed), scale and min
    [rows, groups] fp32, each exactly the value llama.cpp's dequantization multiplies and adds."""

    q: Tensor
    scale: Tensor
    min: Tensor | None

    @property
    def group(self) -> int:
        return self.q.shape[-1]

    def dense(self) -> Tensor:
        """The fp32 [rows, cols] values, in llama.cpp's arithmetic (one product, then one sum)."""
        v = self.q.float() * self.scale[..., None]
        if self.min is not None:
            v = v + self.min[..., None]
        return v.reshape(len(self.q), -1)


def _f16(raw: Tensor) -> Tensor:
    """[..., 2] bytes -> [...] fp32 (their fp16 values)."""
    return raw.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: Tensor) -> Tensor:
    """[..., n] bytes -> [..., 2n]: the n low nibbles, then the n high ones (ggml's order in a block)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _high_bits(qh: Tensor) -> Tensor:
    """[..., 4] bytes (a little-endian uint32) -> [..., 32]: bit i, the fifth bit of value i (Q5_0 / Q5_1)."""
    bits = (qh[..., :, None] >> torch.arange(8, dtype=torch.uint8)) & 1
    return bits.reshape(*qh.shape[:-1], 32)


def _scale_min_k4(scales: Tensor) -> tuple[Tensor, Tensor]:
    """Q4_K / Q5_K's 12 bytes -> the eight 6-bit scales and mins (ggml-quants.c get_scale_min_k4)."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.float(), mn.float()


def decode(kind: str, raw: Tensor, cols: int) -> Affine:
    """`raw` (uint8 [rows, row_bytes] of `kind` blocks, each row `cols` values) as integers and scales."""
    qk, size = BLOCKS[kind]
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != row_bytes(kind, cols):
        raise ConversionError(f"{kind} data of {cols} columns must be uint8 [rows, {row_bytes(kind, cols)}], "
                              f"got {raw.dtype} {list(raw.shape)}")
    rows = raw.shape[0]
    b = raw.reshape(rows, cols // qk, size)
    if kind == "Q8_0":
        return Affine(b[..., 2:].contiguous().view(torch.int8), _f16(b[..., :2]), None)
    if kind == "Q4_0":
        d = _f16(b[..., :2])
        return Affine(_nibbles(b[..., 2:]), d, -8 * d)
    if kind == "Q4_1":
        return Affine(_nibbles(b[..., 4:]), _f16(b[..., :2]), _f16(b[..., 2:4]))
    if kind == "Q5_0":
        q = _nibbles(b[..., 6:]) | (_high_bits(b[..., 2:6]) << 4)
        return Affine(q.to(torch.int8) - 16, _f16(b[..., :2]), None)
    if kind == "Q5_1":
        return Affine(_nibbles(b[..., 8:]) | (_high_bits(b[..., 4:8]) << 4), _f16(b[..., :2]), _f16(b[..., 2:4]))
    if kind in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
        sc, mn = _scale_min_k4(b[..., 4:16])
        qs = b[..., -128:].reshape(rows, -1, 4, 32)  # 4 chunks of 64 values: 32 low nibbles, 32 high
        q = torch.stack([qs & 0x0F, qs >> 4], dim=3).reshape(rows, -1, 8, 32)
        if kind == "Q5_K":
            qh = b[..., 16:48].reshape(rows, -1, 1, 32) >> torch.arange(8, dtype=torch.uint8).view(1, 1, 8, 1)
            q = q | ((qh & 1) << 4)
        return Affine(q.reshape(rows, -1, 32), (d * sc).reshape(rows, -1), (-(dmin * mn)).reshape(rows, -1))
    if kind == "Q6_K":
        ql, qh = b[..., :128].reshape(rows, -1, 2, 64), b[..., 128:192].reshape(rows, -1, 2, 1, 32)
        scales = b[..., 192:208].contiguous().view(torch.int8).float()
        low = torch.stack([ql & 0x0F, ql >> 4], dim=3).reshape(rows, -1, 2, 4, 32)  # per half: 4 runs of 32
        high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 1, 4, 1)) & 3
        q = ((low | (high << 4)).to(torch.int8) - 32).reshape(rows, -1, 16)
        return Affine(q, (_f16(b[..., 208:210])[..., None] * scales).reshape(rows, -1), None)
    raise ConversionError(f"type {kind} is not one specpack keeps quantized (supported: {', '.join(TYPES)})")


def dequantize(kind: str, raw: Tensor, cols: int) -> Tensor:
    """fp32 [rows, cols] values of `raw` (uint8 [rows, row_bytes] of `kind` blocks)."""
    return decode(kind, raw, cols).dense()
