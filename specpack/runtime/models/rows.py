"""Which sequence each row of a forward belongs to, where it sits, and what it may attend.

One forward runs the new tokens of any number of sequences together (the batched engine): the
linear layers see all R rows at once, attention sees each row against its own sequence's cache.
A `Segment` is one sequence's run of consecutive rows: `T` new tokens that fill cache positions
`start..start+T-1` of cache slot `slot`, attending every committed position before `start` plus,
among themselves, a chain (causal) or a tree (`block` [T, T], True where row i may see row j).
A wider `block` [T, W] (W > T) also covers the W - T positions just before `start` (draft rows an
earlier forward wrote, e.g. a tree drafter's previous levels): the rows see every position before
those in full and, among the last W, the ones their block marks.

`Rows` is the per-row form the layers use; build it with `Rows.of(segments)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class Segment:
    slot: int  # cache slot (sequence)
    start: int  # cache length before this forward: the rows fill start..start+T-1
    T: int  # rows
    block: Tensor | None = None  # [T, W] bool over the last W positions (tree; W >= T); None: causal chain
    positions: Tensor | None = None  # [T] RoPE positions (tree: by depth); None: start..start+T-1


class Rows(NamedTuple):
    slot: Tensor  # [R] cache slot of each row
    write: Tensor  # [R] cache position the row's keys and values go to
    pos: Tensor  # [R] RoPE position
    ctx: Tensor  # [R] the positions [0, ctx) are seen in full (its segment's start, or before a wide block)
    end: Tensor  # [R] no mask: the row sees [0, end) (a chain, up to itself); with one: its segment's end
    mask: Tensor | None  # [R, W] bool, when any segment is a tree: row r sees ctx + j where mask[r, j]
    segments: tuple[tuple[Segment, int], ...]  # (segment, first row)

    @classmethod
    def of(cls, segments: Sequence[Segment], device=None) -> "Rows":
        """The rows of `segments`, in order."""
        trees = any(s.block is not None for s in segments)
        if segments and not trees and all(s.positions is None for s in segments):
            return cls._chains(segments, device)
        width = max((_width(s) for s in segments), default=0) if trees else 0
        slot, write, pos, ctx, end, masks, firsts, a = [], [], [], [], [], [], [], 0
        for s in segments:
            w = torch.arange(s.start, s.start + s.T)
            slot.append(torch.full((s.T,), s.slot))
            write.append(w)
            pos.append(w if s.positions is None else s.positions.to("cpu", torch.int64))
            ctx.append(torch.full((s.T,), s.start + s.T - _width(s)))
            end.append(torch.full((s.T,), s.start + s.T) if trees else w + 1)
            if trees:  # chains among trees: their block is causal
                block = torch.ones(s.T, s.T, dtype=torch.bool).tril() if s.block is None else s.block
                masks.append(F.pad(block.to("cpu", torch.bool), (0, width - block.shape[1])))
            firsts.append((s, a))
            a += s.T
        if not segments:
            empty = torch.zeros(0, dtype=torch.long, device=device)
            return cls(empty, empty, empty, empty, empty, None, ())
        cat = lambda xs: torch.cat(xs).to(device)  # noqa: E731
        return cls(cat(slot), cat(write), cat(pos), cat(ctx), cat(end),
                   torch.cat(masks).to(device) if trees else None, tuple(firsts))

    @classmethod
    def _chains(cls, segments: Sequence[Segment], device) -> "Rows":
        """`of` for causal chains at their own positions (every decode and verify step, every draft step of a
        chain): the rows from Python ints, three tensors made, where `of` makes five a segment and joins them
        (a draft step's rows cost ~0.1 ms that way, right after a weight stream)."""
        slot, write, ctx, firsts, a = [], [], [], [], 0
        for s in segments:
            slot += [s.slot] * s.T
            write += range(s.start, s.start + s.T)
            ctx += [s.start] * s.T
            firsts.append((s, a))
            a += s.T
        w = torch.tensor(write, dtype=torch.long, device=device)
        return cls(torch.tensor(slot, dtype=torch.long, device=device), w, w,
                   torch.tensor(ctx, dtype=torch.long, device=device), w + 1, None, tuple(firsts))

    @property
    def count(self) -> int:
        return self.slot.shape[0]

    def last_rows(self) -> list[int]:
        """The index of each segment's last row."""
        return [a + s.T - 1 for s, a in self.segments]


def attend(q: Tensor, k_cache: Tensor, v_cache: Tensor, rows: Rows, scale: float | None = None,
           dv: int | None = None) -> Tensor:
    """Each row's query heads q [R, H, dk] against its own sequence's cache, [S, KVH, L, ld] per
    layer (MLA: the latent cache as both, `dv` its latent width) -> [R, H, dv].

    On the CPU in fp32 (an fp32 or fp16 cache) one row-exact kernel call takes every row
    (kernels/attention.py); elsewhere (CUDA, half precision, no kernel) each segment is one SDPA
    call, a cache narrower than q widened first."""
    from specpack.runtime.kernels import attention as kernel

    R, H, dk = q.shape
    dv = dv or v_cache.shape[-1]
    if kernel.usable(q, k_cache):
        s = dk ** -0.5 if scale is None else scale
        return kernel.attention(q, k_cache, v_cache, rows.slot, rows.ctx, rows.end, rows.mask, s, dv)
    out = q.new_empty(R, H, dv)
    for seg, a in rows.segments:
        e = seg.start + seg.T
        ks = k_cache[seg.slot : seg.slot + 1, :, :e, :dk].to(q.dtype)  # [1, KVH, e, dk]
        vs = v_cache[seg.slot : seg.slot + 1, :, :e, :dv].to(q.dtype)
        y = F.scaled_dot_product_attention(q[a : a + seg.T].transpose(0, 1)[None], ks, vs,
                                           attn_mask=_segment_mask(seg, q.device), scale=scale,
                                           enable_gqa=H != ks.shape[1])  # [1, H, T, dv]
        out[a : a + seg.T] = y[0].transpose(0, 1)
    return out


def _width(seg: Segment) -> int:
    """Positions the segment's block covers (its rows, plus earlier draft rows for a wide block)."""
    return seg.T if seg.block is None else seg.block.shape[1]


def _segment_mask(seg: Segment, device) -> Tensor | None:
    """[T, start+T] bool: every position before the block, then the chain's or tree's own rule."""
    if seg.block is None:
        if seg.T == 1:
            return None  # one token sees everything: no mask needed
        slots = torch.arange(seg.start + seg.T, device=device)
        return slots[None, :] <= slots[seg.start :, None]
    block = seg.block.to(device, torch.bool)
    return torch.cat([block.new_ones(seg.T, seg.start + seg.T - block.shape[1]), block], dim=1)
