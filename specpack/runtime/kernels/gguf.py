"""GGUF blocks (import-gguf's layout, families/gguf_blocks.py) as packed linear layers, without an fp32 weight
in between, each type on the kernel that reads it (`NATIVE`; docs/running.md "GGUF blocks"). Other types
(Q5_1, Q5_K), and a fused matrix whose parts no one kernel reads, are widened to fp32 panels of the same values
(weights.py warns, once per load).

`Blocks` is one such matrix as the checkpoint holds it (views of the mapped file until packed); `cat` joins
the rows of several (fused q/k/v, gate/up), which keeps every block whole."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from specpack.families import gguf_blocks
from specpack.runtime.kernels._lib import _library, available
from specpack.runtime.kernels.linear import (NR, PACKED_BYTES, Q8_BLOCK, PackedLinear, pack_q8_blocks, pack_w4a8,
                                             pack_w5a8, pack_w6a8)

log = logging.getLogger(__name__)
# GGML type -> the packed format that reads it at the file's size (kernels/linear.py): Q4_1 w4a8 (fp16 d, m);
# Q4_0 w4a8s (d alone, offset 8); Q4_K's 32-value sub-blocks w4a8k (d * sc, -dmin * m: exact in fp32 only);
# Q5_0, Q5_1, Q5_K: w5a8s, w5a8, w5a8k (those layouts plus the fifth bits); Q6_K w6a8 (a scale per 16); Q8_0 w8a8 (llama.cpp's Q8_0 x Q8_0)
NATIVE = {"Q4_0": "w4a8s", "Q4_1": "w4a8", "Q8_0": "w8a8", "Q5_0": "w5a8s", "Q5_1": "w5a8", "Q4_K": "w4a8k",
          "Q5_K": "w5a8k", "Q6_K": "w6a8"}
# in a fused layer, the narrowest format that reads every part's blocks (Q4_0's offset as m = -8 d; fp16 values
# are fp32 ones; 4-bit values are 5-bit ones)
READS = {"w4a8s": {"w4a8s"}, "w4a8": {"w4a8s", "w4a8"}, "w5a8": {"w4a8s", "w4a8", "w5a8"},
         "w4a8k": {"w4a8s", "w4a8", "w4a8k"}, "w5a8k": {"w4a8s", "w4a8", "w4a8k", "w5a8", "w5a8k"}}
# int8 panels hold every type whose values are int8 multiples of one fp16 d per 32: beside Q8_0 in a fused layer
# (Q4_K_M's q/k in Q5_0 and v in Q8_0), Q5_0 and Q4_0 go there exactly
INT8_EXACT = {"Q8_0": 0, "Q5_0": 0, "Q4_0": 8}  # type -> what to subtract from its decoded q


@dataclass(frozen=True)
class Blocks:
    """A matrix of rows of `cols` values, stored as `parts`: (GGML type, raw uint8 [rows, row bytes]) each,
    their rows one after another."""

    parts: tuple[tuple[str, Tensor], ...]
    cols: int

    @classmethod
    def of(cls, kind: str, raw: Tensor, cols: int) -> "Blocks":
        return cls(((kind, raw),), cols)

    @property
    def shape(self) -> tuple[int, int]:
        return sum(raw.shape[0] for _, raw in self.parts), self.cols

    @property
    def kinds(self) -> list[str]:
        return [kind for kind, _ in self.parts]

    @property
    def format(self) -> str | None:
        """The packed format every part is read in natively, None where there is none."""
        formats = {NATIVE.get(kind) for kind in self.kinds}
        if len(formats) > 1:
            reader = next((f for f, reads in READS.items() if formats <= reads), None)
            if reader is not None:
                return reader
        if len(formats) > 1 and set(self.kinds) <= set(INT8_EXACT):
            return "w8a8"
        return formats.pop() if len(formats) == 1 else None

    def dense(self) -> Tensor:
        """The fp32 values (llama.cpp's dequantization)."""
        return torch.cat([gguf_blocks.dequantize(kind, raw, self.cols) for kind, raw in self.parts])


def cat(parts: list) -> "Blocks | Tensor":
    """Rows of several tensors joined: blocks stay blocks; with any float tensor among them, fp32 values."""
    if all(isinstance(p, Blocks) for p in parts) and len({p.cols for p in parts}) == 1:
        return Blocks(tuple(part for p in parts for part in p.parts), parts[0].cols)
    return torch.cat([p.dense() if isinstance(p, Blocks) else p.float() for p in parts])


def packed(blocks: Blocks, bias: Tensor | None = None, threads: int | None = None) -> PackedLinear:
    """`blocks` as a packed linear layer: natively where one kernel reads every part, else on fp32 panels.
    Rows are decoded and packed CHUNK_ROWS at a time, so the temporaries stay small beside the panels."""
    from specpack.runtime.kernels import tuning

    fmt = blocks.format
    if fmt is None:
        return tuning.pack(blocks.dense(), bias, threads)
    n, k = blocks.shape
    per_block = PACKED_BYTES[fmt]
    panels = torch.empty(-(-n // NR), k // Q8_BLOCK, per_block, dtype=torch.uint8)
    for r0 in range(0, n, CHUNK_ROWS):
        parts = _rows(blocks.parts, r0, r0 + CHUNK_ROWS)
        decoded = [gguf_blocks.decode(kind, raw, k) for kind, raw in parts]
        q = torch.cat([a.q for a in decoded]).view(-1, k // Q8_BLOCK, Q8_BLOCK)
        scale = torch.cat([a.scale for a in decoded])
        if fmt == "w5a8s":  # Q5_0: q - 16
            chunk = pack_w5a8((q.to(torch.int16) + 16).to(torch.uint8), scale)
        elif fmt in ("w5a8", "w5a8k"):  # Q5_1, Q5_K's sub-blocks (or 4-bit ones beside them): d u + m
            chunk = pack_w5a8(q, scale, torch.cat([a.min for a in decoded]), wide=fmt == "w5a8k")
        elif fmt == "w6a8":  # Q6_K: q - 32 per 16 values, a scale each
            halves = scale.view(len(q), -1, 2)
            chunk = pack_w6a8((q.to(torch.int16) + 32).to(torch.uint8), halves[..., 0], halves[..., 1])
        elif fmt == "w8a8":
            q = torch.cat([(a.q.to(torch.int16) - INT8_EXACT[kind]).to(torch.int8) for a, (kind, _) in
                           zip(decoded, parts)]).view(-1, k // Q8_BLOCK, Q8_BLOCK)
            chunk = pack_q8_blocks(q, scale)
        else:
            offsets = None if fmt == "w4a8s" else torch.cat([a.min for a in decoded])
            chunk = pack_w4a8(q, scale, offsets, wide=fmt == "w4a8k")
        panels[r0 // NR: r0 // NR + len(chunk)] = chunk
    return PackedLinear.of_panels(panels, fmt, (n, k), bias, threads, tuning.settings("w8a8"))


CHUNK_ROWS = 4096  # rows decoded at a time (a multiple of the panels' 16)


def _rows(parts, r0: int, r1: int) -> list[tuple[str, Tensor]]:
    """The (type, raw rows) of rows [r0, r1) of a matrix stored as `parts` one after another."""
    out, at = [], 0
    for kind, raw in parts:
        lo, hi = max(r0, at), min(r1, at + len(raw))
        if lo < hi:
            out.append((kind, raw[lo - at: hi - at]))
        at += len(raw)
    return out


class BlockEmbedding(nn.Module):
    """An embedding table kept as GGUF blocks: each lookup dequantizes only the rows it gathers (the same
    values as the whole table's dequantization; one C call, gguf_rows.c, where the kernels are built). `weight`, for the few kernels that read the table as fp32
    (a block drafter's fused step), is made on first use and kept."""

    def __init__(self, blocks: Blocks):
        super().__init__()
        (self.kind, raw), = blocks.parts
        self.raw = raw  # a view of the mapped file: a lookup reads only its rows' pages
        self.num_embeddings, self.embedding_dim = blocks.shape
        self._type = gguf_blocks.TYPES.index(self.kind)  # gguf_rows.c's enum
        self._dense = None

    def forward(self, ids: Tensor) -> Tensor:
        flat = ids.reshape(-1)
        if not (available() and self.raw.is_cpu and self.raw.is_contiguous()):
            rows = self.raw[flat]
            return gguf_blocks.dequantize(self.kind, rows, self.embedding_dim).view(*ids.shape, self.embedding_dim)
        flat = flat.to(torch.int64).contiguous()
        out = torch.empty(len(flat), self.embedding_dim)
        bad = _library()[0].sp_gguf_rows(self._type, self.raw.data_ptr(), self.num_embeddings, self.raw.shape[1],
                                         flat.data_ptr(), len(flat), self.embedding_dim, out.data_ptr())
        if bad:
            raise IndexError(f"token id {int(flat[bad - 1])} is outside the {self.num_embeddings}-row embedding table")
        return out.view(*ids.shape, self.embedding_dim)

    @property
    def weight(self) -> Tensor:
        if self._dense is None:
            log.info("dequantizing the %s embedding table (%d x %d) for a kernel that reads it whole", self.kind,
                     self.num_embeddings, self.embedding_dim)
            self._dense = gguf_blocks.dequantize(self.kind, self.raw, self.embedding_dim)
        return self._dense
