"""GGUF blocks (import-gguf's layout, families/gguf_blocks.py) as packed linear layers, without an fp32 weight
in between: Q4_0 and Q4_1 as w4a8 panels (w4a8.c), Q8_0 as w8a8 panels (w8a8.c: llama.cpp's Q8_0 x Q8_0).
Other types, and a fused matrix whose parts need different kernels, are widened to fp32 panels for now (a
warning says so, once per load).

`Blocks` is one such matrix as the checkpoint holds it (views of the mapped file until packed); `cat` joins
the rows of several (fused q/k/v, gate/up), which keeps every block whole."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from specpack.families import gguf_blocks
from specpack.runtime.kernels.linear import PackedLinear, pack_q8_blocks, pack_w4a8

log = logging.getLogger(__name__)
NATIVE = {"Q4_0": "w4a8", "Q4_1": "w4a8", "Q8_0": "w8a8"}  # GGML type -> the packed format that reads it


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
    """`blocks` as a packed linear layer: natively where one kernel reads every part, else on fp32 panels."""
    from specpack.runtime.kernels import tuning

    fmt = blocks.format
    if fmt is None:
        return tuning.pack(blocks.dense(), bias, threads)
    n, k = blocks.shape
    decoded = [gguf_blocks.decode(kind, raw, k) for kind, raw in blocks.parts]
    q = torch.cat([a.q for a in decoded]).view(n, k // 32, 32)
    scale = torch.cat([a.scale for a in decoded])
    if fmt == "w8a8":
        panels = pack_q8_blocks(q, scale)
    else:
        panels = pack_w4a8(q, scale, torch.cat([a.min for a in decoded]))
    return PackedLinear.of_panels(panels, fmt, (n, k), bias, threads, tuning.settings("w8a8"))
